"""Carrying out what the room state machines decide: NIXL writes, staging and
device copies, peer calls and notices.
"""

from kvbroker.broker.execution._executor import Executor
from kvbroker.broker.execution._room_end import receive_wait_owner
from kvbroker.broker.execution._tasks import TaskSet

__all__ = ["Executor", "TaskSet", "receive_wait_owner"]

"""The order waiting work is served in: priority classes, deadlines, fair
shares between engines and a floor share for lower classes (:class:`FairQueue`).
"""

from kvbroker.broker.scheduling._deadlines import deadline_in, deadline_ms
from kvbroker.broker.scheduling._queue import (
    FairQueue,
    Priority,
    Ticket,
    Waiter,
    joint_ticket,
    priority_of,
)

__all__ = [
    "FairQueue",
    "Priority",
    "Ticket",
    "Waiter",
    "deadline_in",
    "deadline_ms",
    "joint_ticket",
    "priority_of",
]

"""The NIXL data plane: the agent, the one thread that drives it, and the worker threads."""

from kvbroker.broker.dataplane._agent import Agent, AgentConfig, UcxAgent, XferState, import_nixl
from kvbroker.broker.dataplane._pacing import MAX_WAIT_S, MIN_WAIT_S, Pacing
from kvbroker.broker.dataplane._thread import DataPlane, Event, Notices, Posting, Settled
from kvbroker.broker.dataplane._workers import (
    WARM_NICE,
    LoopInbox,
    Workers,
    name_thread,
    settle,
    settle_later,
)

__all__ = [
    "MAX_WAIT_S",
    "MIN_WAIT_S",
    "WARM_NICE",
    "Agent",
    "AgentConfig",
    "DataPlane",
    "Event",
    "LoopInbox",
    "Notices",
    "Pacing",
    "Posting",
    "Settled",
    "UcxAgent",
    "Workers",
    "XferState",
    "import_nixl",
    "name_thread",
    "settle",
    "settle_later",
]

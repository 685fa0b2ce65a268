"""One broker built and running: its construction, the route of every
engine, session-stream, peer and housekeeping call into the room state
machines, and the read-only queries about it.
"""

from kvbroker.broker.runtime._broker import Broker, Endpoints
from kvbroker.broker.runtime._build import build_broker
from kvbroker.broker.runtime._bundles import Internals, Routes, Services
from kvbroker.broker.runtime._engine_calls import EngineCalls
from kvbroker.broker.runtime._late import Late, LateCalls
from kvbroker.broker.runtime._operators import Operators
from kvbroker.broker.runtime._peer_loss import PeerLoss
from kvbroker.broker.runtime._peer_requests import PeerRequests
from kvbroker.broker.runtime._queries import Queries
from kvbroker.broker.runtime._sessions import Sessions, SessionStream

__all__ = [
    "Broker",
    "Endpoints",
    "EngineCalls",
    "Internals",
    "Late",
    "LateCalls",
    "Operators",
    "PeerLoss",
    "PeerRequests",
    "Queries",
    "Routes",
    "Services",
    "SessionStream",
    "Sessions",
    "build_broker",
]

"""One broker built and running: its construction, and the route of every
engine, session-stream, peer and housekeeping call into the room state
machines.
"""

from kvbroker.broker.runtime._broker import Broker, Endpoints
from kvbroker.broker.runtime._build import build_broker
from kvbroker.broker.runtime._engine_calls import EngineCalls
from kvbroker.broker.runtime._peer_requests import PeerRequests
from kvbroker.broker.runtime._sessions import Sessions, SessionStream

__all__ = ["Broker", "Endpoints", "EngineCalls", "PeerRequests", "SessionStream", "Sessions", "build_broker"]

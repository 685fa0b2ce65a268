"""One broker built and running: its construction, and the route of every
engine, session-stream, peer and housekeeping call into the room state
machines.
"""

from kvbroker.broker.runtime._broker import Broker, Endpoints
from kvbroker.broker.runtime._build import build_broker
from kvbroker.broker.runtime._sessions import SessionStream

__all__ = ["Broker", "Endpoints", "SessionStream", "build_broker"]

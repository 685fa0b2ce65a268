"""One broker built and running: its construction, and the route of every engine, session-stream, peer and housekeeping call into the room state machines."""

from kvbroker.broker.runtime._broker import Broker
from kvbroker.broker.runtime._streams import SessionStream

__all__ = ["Broker", "SessionStream"]

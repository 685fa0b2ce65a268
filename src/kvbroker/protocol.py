"""The wire protocol version this build speaks (``kvbroker.v1.ProtocolVersion``).

The proto is the one source: the highest value of the ``ProtocolVersion``
enum is the version. Brokers refuse peer messages that name another one, and
the client refuses a broker that speaks another one.
"""

from __future__ import annotations

from kvbroker.v1 import common_pb2

__all__ = ["PROTOCOL_VERSION"]

PROTOCOL_VERSION: int = max(common_pb2.ProtocolVersion.values())

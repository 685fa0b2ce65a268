"""The broker's gRPC seam: the server, its servicers, and the queries operators
reach with grpcurl.
"""

from kvbroker.broker.api._admin import Admin
from kvbroker.broker.api._server import BrokerServer

__all__ = ["Admin", "BrokerServer"]

"""The broker's gRPC seam: the server, its servicers, the one chain that
answers peer calls, and the queries operators reach with grpcurl.
"""

from kvbroker.broker.api._admin import Admin
from kvbroker.broker.api._peer_calls import PeerAnswers
from kvbroker.broker.api._peer_stream import ServedStreams, serve_stream
from kvbroker.broker.api._server import BrokerServer
from kvbroker.broker.api._servicers import PeerService

__all__ = ["Admin", "BrokerServer", "PeerAnswers", "PeerService", "ServedStreams", "serve_stream"]

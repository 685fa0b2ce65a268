"""Other brokers: the peer table, a peer's life (its states), the peer client, liveness, and the fleet in etcd."""

from kvbroker.broker.peers._caller import PeerCaller, call_unary
from kvbroker.broker.peers._calls import BY_FIELD, PEER_METHODS, PeerMethod, answers, handlers_of
from kvbroker.broker.peers._client import HandshakeMessage, PeerClient, reach_back, server_options
from kvbroker.broker.peers._discovery import FleetView, Member, find_in_fleet
from kvbroker.broker.peers._fleet import (
    FleetRecord,
    etcd_client,
    groups_of,
    parse_endpoint,
    read_fleet,
)
from kvbroker.broker.peers._life import TRANSITIONS, PeerState, transition
from kvbroker.broker.peers._liveness import PeerMonitor
from kvbroker.broker.peers._stream import PeerStream
from kvbroker.broker.peers._table import (
    DEVICE_SPEED,
    HOST_FALLBACK,
    Peer,
    PeerTable,
    PoolKey,
    RemoteEngine,
    TransportVerdict,
    pool_name,
)

__all__ = [
    "DEVICE_SPEED",
    "HOST_FALLBACK",
    "FleetRecord",
    "FleetView",
    "HandshakeMessage",
    "Member",
    "Peer",
    "PeerClient",
    "reach_back",
    "PeerMonitor",
    "PeerState",
    "PeerTable",
    "PoolKey",
    "RemoteEngine",
    "BY_FIELD",
    "PEER_METHODS",
    "PeerCaller",
    "PeerMethod",
    "PeerStream",
    "TRANSITIONS",
    "answers",
    "call_unary",
    "handlers_of",
    "TransportVerdict",
    "etcd_client",
    "find_in_fleet",
    "groups_of",
    "parse_endpoint",
    "pool_name",
    "read_fleet",
    "server_options",
    "transition",
]

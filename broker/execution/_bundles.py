"""What belongs together, handed on together: small frozen bundles of a
broker's parts (not a locator: each part takes the bundles it uses).

- :class:`Machines`: the room state machines, their tables, the watch hub,
  and the turn every entry into them is made in (``_turn``);
- :class:`Transport`: what moves bytes and reaches peers (the data plane,
  the peer table and client, the transfer buffers);
- :class:`Copying`: the device path (worker threads, array views, copy lanes);
- :class:`Telemetry`: the counters Admin reads and the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbroker.broker.dataplane import DataPlane, Workers
from kvbroker.broker.device import ArrayViews, Lanes
from kvbroker.broker.execution._turn import Turn
from kvbroker.broker.memory import StagingPools
from kvbroker.broker.peers import PeerClient, PeerTable
from kvbroker.broker.rooms import ReceiverCore, RoomTables, SenderCore, WatchHub
from kvbroker.broker.telemetry import BrokerMetrics, Counters

__all__ = ["Copying", "Machines", "Telemetry", "Transport"]


@dataclass(frozen=True, eq=False)
class Machines:
    """The room state machines of one broker, and the turn that enters them."""

    broker_id: str
    rooms: RoomTables
    sender: SenderCore
    receiver: ReceiverCore
    hub: WatchHub
    turn: Turn


@dataclass(frozen=True, eq=False)
class Transport:
    """What moves bytes and reaches peers."""

    dataplane: DataPlane
    peers: PeerTable
    client: PeerClient
    pools: StagingPools


@dataclass(frozen=True, eq=False)
class Copying:
    """The device path: worker threads, array views, copy lanes."""

    workers: Workers
    views: ArrayViews
    lanes: Lanes


@dataclass(frozen=True, eq=False)
class Telemetry:
    """The counters Admin reads, and the metrics."""

    counters: Counters
    metrics: BrokerMetrics

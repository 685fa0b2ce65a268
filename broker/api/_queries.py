"""What operators may read of a broker: a narrow, read-only view for ``admin`` and metrics.

Admin code reads the broker through this view, never through its tables:
the records it hands out are the live ones, to be read on the control loop
and not changed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvbroker.broker.execution import transport_text
from kvbroker.broker.memory import Engine
from kvbroker.broker.peers import Peer
from kvbroker.broker.rooms import Receiver, Side, Source
from kvbroker.broker.telemetry import Counters

if TYPE_CHECKING:
    from kvbroker.broker.runtime import Broker

__all__ = ["Queries"]


class Queries:
    """Read-only questions about one broker. Control loop only."""

    def __init__(self, broker: Broker) -> None:
        self._b = broker

    @property
    def broker_id(self) -> str:
        return self._b.broker_id

    @property
    def draining(self) -> bool:
        return self._b.operators.draining

    @property
    def counters(self) -> Counters:
        return self._b.counters

    def uptime_seconds(self) -> float:
        return time.monotonic() - self._b.started_at

    def table_sizes(self) -> dict[str, int]:
        """Every per-room table and its size (``GetStats.per_room_state``)."""
        return self._b.rooms.sizes()

    def staging_in_use(self, direction: str) -> int:
        return self._b.pools.in_use_bytes(direction)

    def engines(self) -> list[Engine]:
        return list(self._b.engines.by_id.values())

    def peers(self) -> list[Peer]:
        return self._b.peers.peers()

    def handshaken_peers(self) -> int:
        return len(self._b.peers.by_id)

    def peer_at(self, address: str) -> Peer | None:
        return self._b.peers.by_address.get(address)

    def transport(self) -> str:
        return transport_text(self._b.config)

    def sides(self) -> Iterator[Side]:
        """Every room side held (sources, then receivers)."""
        yield from self._b.rooms.all_sources()
        yield from self._b.rooms.all_receivers()

    def sides_of(self, room: int) -> list[Side]:
        return self._b.operators.sides_of(room)

    def open_rooms(self) -> int:
        return self._b.operators.open_rooms()

    @staticmethod
    def peer_of(side: Side) -> str:
        """The peer broker id(s) of a side, comma-separated (its address until handshaken)."""
        if isinstance(side, Source):
            return ",".join(sorted({d.info.receiver_broker_id for d in side.destinations.values()}))
        assert isinstance(side, Receiver)
        return side.peer_broker_id or side.sender_address

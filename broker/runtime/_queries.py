"""What may be read of a broker: a narrow, read-only view for ``admin``,
metrics and tests (``Broker.queries``).

Readers go through this view, never through the broker's tables: the records
it hands out are the live ones, to be read on the control loop and not
changed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.execution import Copying, Machines, Telemetry, Transport, transport_text
from kvbroker.broker.memory import Engine
from kvbroker.broker.peers import FleetView, Peer
from kvbroker.broker.rooms import Receiver, Side, Source
from kvbroker.broker.runtime._bundles import Services
from kvbroker.broker.runtime._operators import Operators
from kvbroker.broker.telemetry import Counters

__all__ = ["Queries", "RoomQueries", "TrafficQueries"]


class Queries:
    """Read-only questions about one broker. Control loop only."""

    def __init__(
        self,
        *,
        config: BrokerConfig,
        machines: Machines,
        transport: Transport,
        copying: Copying,
        telemetry: Telemetry,
        services: Services,
        operators: Operators,
    ) -> None:
        self._config = config
        self._machines = machines
        self._transport = transport
        self._copying = copying
        self._telemetry = telemetry
        self._services = services
        self._engines = services.engines
        self._operators = operators
        self._started_at = time.monotonic()
        self._rooms = RoomQueries(machines, operators)
        self._traffic = TrafficQueries(transport, services)

    @property
    def rooms(self) -> RoomQueries:
        """The room sides held, and the tables' sizes."""
        return self._rooms

    @property
    def traffic(self) -> TrafficQueries:
        """What is moving: buffers reserved, transfers in flight, credits, background tasks."""
        return self._traffic

    # -- the broker ------------------------------------------------------------------
    @property
    def broker_id(self) -> str:
        return self._machines.broker_id

    @property
    def config(self) -> BrokerConfig:
        return self._config

    @property
    def draining(self) -> bool:
        return self._operators.draining

    @property
    def counters(self) -> Counters:
        return self._telemetry.counters

    def transport_gbps(self) -> dict[tuple[str, str, str], float]:
        """The transport self-test's gauge: (peer, pair of pools, verdict) -> GB/s."""
        return dict(self._telemetry.metrics.transport_gbps)

    def uptime_seconds(self) -> float:
        return time.monotonic() - self._started_at

    def device_launches(self) -> int:
        return self._copying.views.launches

    def transport(self) -> str:
        return transport_text(self._config)

    def etcd_status(self) -> str:
        """"off" (no --etcd), "ok" (registered and watching) or "unreachable"."""
        return self._operators.etcd_status()

    @property
    def fleet(self) -> FleetView | None:
        """This broker's view of the fleet in etcd (None without --etcd)."""
        return self._services.fleet_view

    # -- engines and peers -------------------------------------------------------------
    def engines(self) -> list[Engine]:
        return list(self._engines.by_id.values())

    def engine(self, engine_id: str) -> Engine:
        return self._engines.get(engine_id)

    def engine_keys(self) -> int:
        """Engines registered by rank key."""
        return len(self._engines.by_key)

    def peers(self) -> list[Peer]:
        return self._transport.peers.peers()

    def handshaken_peers(self) -> int:
        return len(self._transport.peers.by_id)

    def peer_at(self, address: str) -> Peer | None:
        return self._transport.peers.by_address.get(address)

    def peer(self, broker_id: str) -> Peer | None:
        """The handshaken peer ``broker_id``."""
        return self._transport.peers.by_id.get(broker_id)


class RoomQueries:
    """The room sides one broker holds (``Queries.rooms``). Control loop only."""

    def __init__(self, machines: Machines, operators: Operators) -> None:
        self._tables = machines.rooms
        self._operators = operators

    def table_sizes(self) -> dict[str, int]:
        """Every per-room table and its size (``GetStats.per_room_state``)."""
        return self._tables.sizes()

    def sources(self) -> Iterator[Source]:
        yield from self._tables.all_sources()

    def receivers(self) -> Iterator[Receiver]:
        yield from self._tables.all_receivers()

    def sides(self) -> Iterator[Side]:
        """Every room side held (sources, then receivers)."""
        yield from self.sources()
        yield from self.receivers()

    def sides_of(self, room: int) -> list[Side]:
        return self._operators.sides_of(room)

    def receivers_of(self, room: int) -> list[Receiver]:
        """This broker's receiving sides of ``room``."""
        return [s for s in self.sides_of(room) if isinstance(s, Receiver)]

    def open_rooms(self) -> int:
        return self._operators.open_rooms()

    @staticmethod
    def peer_of(side: Side) -> str:
        """The peer broker id(s) of a side, comma-separated (its address until handshaken)."""
        if isinstance(side, Source):
            return ",".join(sorted({d.info.receiver_broker_id for d in side.destinations.values()}))
        assert isinstance(side, Receiver)
        return side.peer_broker_id or side.sender_address


class TrafficQueries:
    """What is moving through one broker (``Queries.traffic``). Control loop only."""

    def __init__(self, transport: Transport, services: Services) -> None:
        self._transport = transport
        self._services = services

    def staging_in_use(self, direction: str) -> int:
        return self._transport.pools.in_use_bytes(direction)

    def inflight(self) -> int:
        """NIXL transfers posted and not yet settled."""
        return self._transport.dataplane.inflight

    def waiting_reservations(self, direction: str) -> int:
        """Reservations waiting for room in this broker's ``direction`` buffers."""
        pools = self._transport.pools
        return sum(p.waiting for key in pools.keys(direction) if (p := pools.pool(direction, *key)) is not None)

    def parts_waiting_for_credits(self) -> int:
        """Parts waiting for receive credits from their peer (the device path)."""
        return self._services.credits.waiting_parts()

    def background_tasks(self) -> int:
        return len(self._services.tasks)

    def granted_credit_bytes(self) -> int:
        """Receive credits this broker granted its senders and holds now."""
        return self._services.credits.ledger.granted_bytes()

    def awaiting_credit_returns(self) -> bool:
        return self._services.credits.awaiting_returns()

    def credit_business_with(self, peer_id: str) -> bool:
        """Whether credits are granted to or held from ``peer_id``."""
        return self._services.credits.has_business(peer_id)

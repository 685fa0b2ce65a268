"""Housekeeping: what happens to rooms while nobody calls. Timeouts of open
rooms and the lease renewals of announced rooms that are due every
housekeeping interval; eviction of finished rooms and
tombstones, orphaned transfer infos and the metric gauges every
``_SLOW_PASSES`` intervals. None of them scans every record: eviction and
the orphans look only at rooms old enough (``RoomTables`` keeps rooms in
the order they were made), the gauges read tallies kept as states change."""

from __future__ import annotations

import asyncio
import time

import structlog

from kvbroker.broker.aio import cancel_and_wait
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.execution import Machines, Transport, transport_text
from kvbroker.broker.memory import EngineTable
from kvbroker.broker.telemetry import BrokerMetrics, GaugeSnapshot, child_done
from kvbroker.v1 import common_pb2

__all__ = ["Housekeeping"]

log = structlog.get_logger(__name__)

#: Housekeeping passes per pass that evicts, answers orphans and refreshes the gauges.
_SLOW_PASSES = 4


class Housekeeping:
    """The periodic passes over one broker's rooms. Control loop only."""

    def __init__(
        self,
        *,
        config: BrokerConfig,
        machines: Machines,
        engines: EngineTable,
        transport: Transport,
        metrics: BrokerMetrics,
    ) -> None:
        self._config = config
        self._rooms = machines.rooms
        self._sender = machines.sender
        self._receiver = machines.receiver
        self._turn = machines.turn
        self._engines = engines
        self._pools = transport.pools
        self._peers = transport.peers
        self._metrics = metrics
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="housekeeping")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _run(self) -> None:
        """Timeouts of open rooms every housekeeping interval; eviction, orphaned
        transfer infos and the gauges every ``_SLOW_PASSES`` intervals."""
        cfg = self._config
        slow_every = cfg.housekeeping_interval_seconds * _SLOW_PASSES
        slow_at = 0.0
        while True:
            await asyncio.sleep(cfg.housekeeping_interval_seconds)
            try:
                now = time.monotonic()
                with self._turn:
                    self._sender.tick(
                        now,
                        info_timeout_seconds=cfg.sender_info_timeout_seconds,
                        orphan_timeout_seconds=cfg.orphan_room_timeout_seconds,
                        orphans_every=slow_every,
                    )
                    self._receiver.tick(
                        now,
                        data_timeout_seconds=cfg.receiver_data_timeout_seconds,
                        retry_seconds=cfg.peer_heartbeat_seconds,
                        lease_renew_max_seconds=cfg.lease_renew_max_seconds,
                    )
                    if now - slow_at >= slow_every:
                        slow_at = now
                        self.evict(now)
                        self._refresh_gauges()
            except Exception:
                log.exception("housekeeping_failed")

    def evict(self, now: float, *, everything: bool = False) -> int:
        """One eviction pass (``everything``: as if every TTL had passed; tests)."""
        cfg = self._config
        return self._rooms.evict(
            now,
            0.0 if everything else cfg.finished_room_ttl_seconds,
            0.0 if everything else cfg.tombstone_ttl_seconds,
            0.0 if everything else cfg.orphan_room_timeout_seconds,
            0.0 if everything else max(cfg.unsettled_room_ttl_seconds, cfg.finished_room_ttl_seconds),
            on_evict=lambda side: child_done(side.span, "kvbroker.cleanup", {"kvbroker.settled": side.pages_settled}),
            notice_ttl_seconds=0.0 if everything else cfg.sender_info_timeout_seconds,
        )

    def _refresh_gauges(self) -> None:
        """The snapshot the metric gauges read (scrapes run on another thread)."""
        rooms = {
            (name, common_pb2.RoomState.Name(state)): n
            for name, tally in self._rooms.tallies.items()
            for state, n in tally.counts.items()
            if n
        }
        peers = [p for p in self._peers.peers() if not p.is_self and p.broker_id]
        transport = transport_text(self._config)
        self._metrics.snapshot = GaugeSnapshot(
            rooms=rooms,
            staging={"send": self._pools.in_use_bytes("send"), "receive": self._pools.in_use_bytes("receive")},
            sessions=len(self._engines.by_id),
            peers=len(peers),
            throughput={(p.address, transport): p.throughput_bps for p in peers if p.throughput_bps},
        )

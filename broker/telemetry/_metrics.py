"""Broker metrics (OpenTelemetry metrics; Prometheus scrape with ``serve --metrics-port``).

Histograms are recorded on the event-loop thread as things happen. The
per-part counters (bytes, transfers) are totals the loop adds to in plain
dicts (:meth:`BrokerMetrics.count_bytes`, :meth:`BrokerMetrics.count_transfer`)
and a scrape reads: an OpenTelemetry ``Counter.add`` cost about 6 us, a
part's worth of them a tenth of a packed part's budget (issue 28). Gauges (rooms by state, staging occupancy, sessions, peers, per-peer
throughput) read a snapshot the event loop refreshes every fourth housekeeping
pass, because a scrape runs on another thread.

Instruments:

- ``kvbroker.bytes`` (counter, By; ``direction`` sent/received)
- ``kvbroker.transfers`` (counter; ``path`` prepped/gathered/staged/per_token/token_runs/packed, ``result``)
- ``kvbroker.transfer.duration`` (histogram, s; ``path``)
- ``kvbroker.room.duration`` (histogram, s; ``side``, ``state``): open to end
- ``kvbroker.room.failures`` (counter; ``side``, ``cause``)
- ``kvbroker.rooms`` (gauge; ``side``, ``state``): rooms held now
- ``kvbroker.staging.bytes_in_use`` (gauge, By; ``direction``)
- ``kvbroker.sessions`` (gauge): registered engine ranks
- ``kvbroker.peers`` (gauge): handshaken peers
- ``kvbroker.peer.throughput`` (gauge, By/s; ``peer``, ``transport``):
  observed write throughput to each peer (moving average)
- ``kvbroker.transport.gbps`` (gauge, GB/s; ``peer``, ``pair``,
  ``verdict``): the transport self-test of each pair of transfer buffers
  probed ("device speed", "host fallback", "failed")
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from kvbroker.broker.telemetry._queues import QueueStats

__all__ = ["BrokerMetrics", "GaugeSnapshot"]

#: Latency buckets from 100 us to a minute.
_SECONDS_BUCKETS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


#: Prometheus labels of the priority classes (``common_pb2.RoomPriority``; 0 serves as standard).
_CLASSES = {0: "standard", 1: "bulk", 2: "standard", 3: "interactive"}


@dataclass
class GaugeSnapshot:
    """What the gauges report; replaced whole by the event loop."""

    rooms: dict[tuple[str, str], int] = field(default_factory=dict)
    staging: dict[str, int] = field(default_factory=dict)
    sessions: int = 0
    peers: int = 0
    #: (peer address, transport) -> bytes/s
    throughput: dict[tuple[str, str], float] = field(default_factory=dict)


class BrokerMetrics:
    """The broker's instruments, on the global meter provider."""

    def __init__(self, queues: QueueStats) -> None:
        meter = metrics.get_meter("kvbroker")
        self.snapshot = GaugeSnapshot()
        #: direction -> bytes; (path, result) -> transfers: totals since start (loop only; a scrape copies them).
        self._bytes: dict[str, int] = {}
        self._transfers: dict[tuple[str, str], int] = {}
        meter.create_observable_counter("kvbroker.bytes", callbacks=[self._bytes_total], unit="By", description="bytes moved")
        meter.create_observable_counter("kvbroker.transfers", callbacks=[self._transfers_total], description="NIXL transfers settled")
        self.transfer_seconds = meter.create_histogram(
            "kvbroker.transfer.duration",
            unit="s",
            description="post to settle of one NIXL transfer",
            explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
        )
        self.room_seconds = meter.create_histogram(
            "kvbroker.room.duration",
            unit="s",
            description="open to SUCCESS or FAILED of one side of a room",
            explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
        )
        self.failures = meter.create_counter("kvbroker.room.failures", description="failed room sides by cause")
        meter.create_observable_gauge("kvbroker.rooms", callbacks=[self._rooms], description="rooms held, by state")
        meter.create_observable_gauge(
            "kvbroker.staging.bytes_in_use", unit="By", callbacks=[self._staging], description="staging reserved"
        )
        meter.create_observable_gauge("kvbroker.sessions", callbacks=[self._sessions], description="engine ranks registered")
        #: The queues' rows (the broker's one ``QueueStats``, ``Counters.queues`` too).
        self._queues = queues
        meter.create_observable_gauge(
            "kvbroker.queue.waiting", callbacks=[self._queue_waiting], description="work waiting, by queue, class and engine group"
        )
        meter.create_observable_counter(
            "kvbroker.queue.served", callbacks=[self._queue_served], description="work served, by queue, class and engine group"
        )
        meter.create_observable_counter(
            "kvbroker.queue.bytes", unit="By", callbacks=[self._queue_bytes], description="bytes of the work served"
        )
        meter.create_observable_counter(
            "kvbroker.queue.wait", unit="s", callbacks=[self._queue_wait], description="seconds the work served waited"
        )
        meter.create_observable_gauge("kvbroker.peers", callbacks=[self._peers], description="peers handshaken")
        meter.create_observable_gauge(
            "kvbroker.peer.throughput", unit="By/s", callbacks=[self._throughput], description="observed write throughput"
        )
        #: (peer address, pair, verdict) -> GB/s of its last self-test; replaced whole on the loop.
        self.transport_gbps: dict[tuple[str, str, str], float] = {}
        meter.create_observable_gauge(
            "kvbroker.transport.gbps", unit="GBy/s", callbacks=[self._transport], description="transport self-test, per pair of transfer buffers"
        )

    def count_bytes(self, direction: str, nbytes: int) -> None:
        """``nbytes`` moved (``direction``: sent, received)."""
        self._bytes[direction] = self._bytes.get(direction, 0) + nbytes

    def count_transfer(self, path: str, result: str) -> None:
        """One transfer of ``path`` settled with ``result`` (done, error)."""
        key = (path, result)
        self._transfers[key] = self._transfers.get(key, 0) + 1

    def _bytes_total(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"direction": d}) for d, n in list(self._bytes.items())]

    def _transfers_total(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"path": p, "result": r}) for (p, r), n in list(self._transfers.items())]

    def _rooms(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"side": side, "state": state}) for (side, state), n in self.snapshot.rooms.items()]

    def _staging(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"direction": d}) for d, n in self.snapshot.staging.items()]

    def _queue_rows(self, value: str) -> Iterable[Observation]:
        rows = self._queues.rows()
        return [
            Observation(max(0, getattr(r, value)), {"queue": r.queue, "class": _CLASSES.get(r.priority, str(r.priority)), "engine": r.engine})
            for r in rows
        ]

    def _queue_waiting(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._queue_rows("waiting")

    def _queue_served(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._queue_rows("served")

    def _queue_bytes(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._queue_rows("bytes")

    def _queue_wait(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._queue_rows("waited_seconds")

    def _sessions(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self.snapshot.sessions)]

    def _peers(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self.snapshot.peers)]

    def _throughput(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, {"peer": p, "transport": t}) for (p, t), v in self.snapshot.throughput.items()]

    def _transport(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(v, {"peer": p, "pair": pair, "verdict": verdict}) for (p, pair, verdict), v in self.transport_gbps.items()]

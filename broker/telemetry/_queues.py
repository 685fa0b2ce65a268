"""What the broker's queues hold and served, by queue, priority class and
engine group (``Admin.GetStats.queues``, Prometheus ``kvbroker_queue_*``):
the queues (``scheduling.FairQueue``) report to it from whichever thread
serves them."""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["QueueObserver", "QueueRow", "QueueStats"]


@dataclass
class QueueRow:
    """One (queue, class, engine group): items waiting now; since the start, items served, their
    bytes and the seconds they waited."""

    queue: str
    priority: int
    engine: str
    waiting: int = 0
    served: int = 0
    bytes: int = 0
    waited_seconds: float = 0.0


class QueueStats:
    """Every queue's rows. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[tuple[str, int, str], QueueRow] = {}

    def observer(self, queue: str) -> QueueObserver:
        """What queue ``queue`` reports to."""
        return QueueObserver(self, queue)

    def _row(self, queue: str, priority: int, engine: str) -> QueueRow:
        key = (queue, priority, engine)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = QueueRow(queue, priority, engine)
        return row

    def rows(self) -> list[QueueRow]:
        """A copy of every row, by queue, class (highest first), engine."""
        with self._lock:
            rows = [QueueRow(**vars(r)) for r in self._rows.values()]
        return sorted(rows, key=lambda r: (r.queue, -r.priority, r.engine))


class QueueObserver:
    """One queue's reports (``FairQueue``'s observer)."""

    __slots__ = ("_queue", "_stats")

    def __init__(self, stats: QueueStats, queue: str) -> None:
        self._stats, self._queue = stats, queue

    def queued(self, priority: int, engine: str) -> None:
        with self._stats._lock:
            self._stats._row(self._queue, priority, engine).waiting += 1

    def served(self, priority: int, engine: str, nbytes: int, waited_seconds: float) -> None:
        with self._stats._lock:
            row = self._stats._row(self._queue, priority, engine)
            row.waiting -= 1
            row.served += 1
            row.bytes += nbytes
            row.waited_seconds += waited_seconds

    def left(self, priority: int, engine: str) -> None:
        """An item left without being served (its room ended)."""
        with self._stats._lock:
            self._stats._row(self._queue, priority, engine).waiting -= 1

"""kvbroker's transfers as vLLM sees its connectors' metrics.

Each worker of the vLLM connector (``adapters/vllm.py``) counts the rooms
it saw end since vLLM last asked (``get_kv_connector_stats``): transfers
that succeeded and failed, per direction, the bytes the broker reported
for them, and how long each took from opening the room to its end.
vLLM aggregates the workers' counts, logs them with its other stats
(:meth:`KVBrokerStats.reduce`) and, through :class:`KVBrokerPromMetrics`,
exports them on its Prometheus ``/metrics`` as ``vllm:kvbroker_*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["KVBrokerPromMetrics", "KVBrokerStats", "empty_stats"]

#: Counts kept per interval (the data vLLM carries from workers to its logger).
_COUNTS = ("sent", "received", "send_failures", "receive_failures", "bytes_sent", "bytes_received")


def empty_stats() -> dict[str, Any]:
    """The data of an interval with nothing in it."""
    return {**dict.fromkeys(_COUNTS, 0), "seconds": []}


@dataclass
class KVBrokerStats(KVConnectorStats):
    """Rooms that ended in one interval, as counts and durations."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = empty_stats()

    def record(self, direction: str, ok: bool, nbytes: int, seconds: float) -> None:
        """One room of this rank ended (``direction``: "sent" or "received")."""
        if ok:
            self.data[direction] += 1
            self.data[f"bytes_{direction}"] += nbytes
        else:
            self.data["send_failures" if direction == "sent" else "receive_failures"] += 1
        self.data["seconds"].append(seconds)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _COUNTS:
            self.data[key] += other.data.get(key, 0)
        self.data["seconds"] = [*self.data["seconds"], *other.data.get("seconds", [])]
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["seconds"]
        return {
            "Rooms sent": self.data["sent"],
            "Rooms received": self.data["received"],
            "Failed rooms": self.data["send_failures"] + self.data["receive_failures"],
            "MiB sent": round(self.data["bytes_sent"] / 2**20, 3),
            "MiB received": round(self.data["bytes_received"] / 2**20, 3),
            "Avg room time (ms)": round(1000 * sum(seconds) / len(seconds), 3) if seconds else 0.0,
        }

    def is_empty(self) -> bool:
        return not self.data["seconds"]


class KVBrokerPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvbroker_rooms`` (by direction and result), ``vllm:kvbroker_bytes``
    (by direction), ``vllm:kvbroker_room_seconds``: one series per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        rooms = self._counter_cls(
            name="vllm:kvbroker_rooms",
            documentation="kvbroker rooms this engine's ranks saw end, by direction and result.",
            labelnames=[*labelnames, "direction", "result"],
        )
        self.rooms = {
            (direction, result): create_metric_per_engine(
                rooms, {i: [*v, direction, result] for i, v in per_engine_labelvalues.items()}
            )
            for direction in ("sent", "received")
            for result in ("success", "failure")
        }
        nbytes = self._counter_cls(
            name="vllm:kvbroker_bytes",
            documentation="KV bytes kvbroker moved for this engine's rooms that succeeded, by direction.",
            labelnames=[*labelnames, "direction"],
        )
        self.bytes = {
            direction: create_metric_per_engine(nbytes, {i: [*v, direction] for i, v in per_engine_labelvalues.items()})
            for direction in ("sent", "received")
        }
        seconds = self._histogram_cls(
            name="vllm:kvbroker_room_seconds",
            documentation="Time from opening a kvbroker room to its end, per rank.",
            buckets=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0],
            labelnames=labelnames,
        )
        self.seconds = create_metric_per_engine(seconds, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for direction, failures in (("sent", "send_failures"), ("received", "receive_failures")):
            self.rooms[(direction, "success")][engine_idx].inc(data.get(direction, 0))
            self.rooms[(direction, "failure")][engine_idx].inc(data.get(failures, 0))
            self.bytes[direction][engine_idx].inc(data.get(f"bytes_{direction}", 0))
        for value in data.get("seconds", []):
            self.seconds[engine_idx].observe(value)

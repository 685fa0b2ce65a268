"""Whether brokers are back to idle: no room in any table, nothing reserved in any buffer;
and whether their engines' memory is warm.

After any test, and above all after a failure, a broker must hold nothing for
the rooms it moved: every per-room table empty (once finished rooms are
evicted) and every staging and transfer buffer back to zero bytes reserved
(seed #27011: state left behind after a failure). This reads both through the
Admin service, as an operator would (``GetStats``).
"""

from __future__ import annotations

import time
from typing import Protocol

from kvbroker.testing.waiting import eventually
from kvbroker.v1 import admin_pb2

__all__ = ["wait_until_idle", "wait_until_warm"]


class _WithStats(Protocol):
    @property
    def name(self) -> str: ...

    def stats(self, timeout_seconds: float = 10.0) -> admin_pb2.Stats: ...


class _WithEngines(Protocol):
    def engines(self, timeout_seconds: float = 10.0) -> list[admin_pb2.EngineInfo]: ...


def wait_until_warm(*brokers: _WithEngines, timeout_seconds: float = 120.0) -> float:
    """Wait until no engine of these brokers has memory still being faulted in
    (``EngineInfo.memory_warming``, as an operator sees it in ListEngines); the
    seconds waited. A benchmark that times an idle figure right after engines
    register would take it while their memory warms."""
    waited = time.monotonic()

    def warming() -> list[str]:
        return [e.engine_label for b in brokers for e in b.engines() if e.memory_warming]

    eventually(lambda: not warming(), timeout_seconds, interval_seconds=0.05, describe=lambda: f"memory still warming: {warming()}")
    return time.monotonic() - waited


def _held(broker: _WithStats) -> dict[str, int]:
    stats = broker.stats()
    held = {f"rooms {state}": count for state, count in stats.per_room_state.items() if count}
    if stats.staging_send_bytes_in_use:
        held["send bytes reserved"] = stats.staging_send_bytes_in_use
    if stats.staging_receive_bytes_in_use:
        held["receive bytes reserved"] = stats.staging_receive_bytes_in_use
    return held


def wait_until_idle(
    *brokers: _WithStats, timeout_seconds: float = 30.0, interval_seconds: float = 0.1
) -> None:
    """Wait until every broker's room tables are empty and its buffers hold
    nothing reserved; ``AssertionError`` naming what each still holds if not
    within ``timeout_seconds``. (Idle receive credits go back to their
    receiver after a second without use, so a device-path test may wait that
    long.)"""

    def left() -> dict[str, dict[str, int]]:
        return {b.name: held for b in brokers if (held := _held(b))}

    eventually(
        lambda: not left(),
        timeout_seconds,
        interval_seconds=interval_seconds,
        describe=lambda: f"brokers not idle: {left()}",
    )

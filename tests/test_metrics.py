"""Metrics: the Prometheus scrape endpoint of a running broker (the transport self-test's gauge: tests/test_transport_probe.py)."""

from __future__ import annotations

import socket
import time
import urllib.request

import numpy as np
import pytest

from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.testing import BrokerProcess, scratch_dir
from kvbroker.testing.engine_child import MODEL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.nixl
def test_prometheus_endpoint_reports_bytes_rooms_and_latency() -> None:
    """After a room, the scrape endpoint shows bytes moved, transfer and room latency, rooms and sessions."""
    port = _free_port()
    with scratch_dir("kvb-metrics-") as workdir:
        (b,) = BrokerProcess.start_many(["m"], workdir, ["--log-level", "warning", "--metrics-port", str(port)])
        engines = []
        try:
            for role, group in (("prefill", "mp"), ("decode", "md")):
                spec = RankSpec(group=group, role=role)  # type: ignore[arg-type]
                client = BrokerClient(b.address)
                engines.append((client, client.register_engine(spec, EngineMemory.allocate(spec, MODEL, num_pages=8, aux_rows=1, aux_row_bytes=[8]))))
            (_, pe), (_, de) = engines
            de.receiver(1, SenderRef("", "mp")).init(np.array([1, 2]), aux_row=0)
            sender = pe.sender(1)
            sender.init(2, aux_row=0)
            sender.send([3, 4])
            assert de.wait([1], timeout_seconds=20)[1].state == RoomState.SUCCESS
            time.sleep(0.6)  # gauges read a snapshot the broker refreshes every 0.25 s
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        finally:
            for client, engine in engines:
                engine.close()
                client.close()
            b.stop()
    ours = [line for line in text.splitlines() if line.startswith("kvbroker_")]

    def value(prefix: str, *labels: str) -> float:
        for line in ours:
            if line.startswith(prefix + "{") and all(label in line for label in labels):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{prefix} {labels} missing from the scrape:\n" + "\n".join(ours))

    assert value("kvbroker_bytes_total", 'direction="sent"') == value("kvbroker_bytes_total", 'direction="received"') > 0
    assert value("kvbroker_transfers_total", 'path="prepped"', 'result="done"') >= 1
    assert value("kvbroker_transfer_duration_seconds_count", 'path="prepped"') >= 1
    assert value("kvbroker_transfer_duration_seconds_bucket", 'le="1.0"', 'path="prepped"') >= 1
    assert value("kvbroker_room_duration_seconds_count", 'side="receiver"', 'state="ROOM_STATE_SUCCESS"') == 1
    assert value("kvbroker_sessions") == 2
    assert value("kvbroker_staging_bytes_in_use_bytes", 'direction="receive"') == 0


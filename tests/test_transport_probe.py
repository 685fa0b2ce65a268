"""The transport self-test (issue 28, finding 1), on the fake CUDA driver and the fake NIXL agent.

Timing each part against a floor raised false alarms (a part was timed with its descriptors and
the data plane's polling; the first write opens a CUDA IPC handle), so every GPU test and demo
would have failed with every byte right. Instead a broker probes each pair of its send transfer
buffer and a peer's receive buffer, once, before the pair's first packed part: a few timed
writes slot to slot. These tests show the verdict for a pair at device speed and for one that
moves through the host (the fake agent delays its writes as TCP on an H100 did), where it is
shown (ListPeers, ProbeTransport, spans, the log), that the probe's slots come back on both
sides, that a failing probe leaves the rooms moving, and that a lost ReleaseProbe is covered by
the receiver's lease.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from structlog.testing import capture_logs

from kvbroker.client import RoomState, SenderRef
from kvbroker.errors import Unimplemented
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.testing import FakeBroker, eventually
from kvbroker.testing.fake_nixl import HOST_SPEED_BPS
from kvbroker.v1 import admin_pb2, admin_pb2_grpc, common_pb2, peer_pb2

VRAM = common_pb2.MEMORY_KIND_VRAM
MEMORY_KINDS = ("vram",)
#: The fake agent copies with memmove: a few GB/s here, not a GPU's hundreds. The floor sits
#: between that and the host fallback it emulates (0.45 GB/s, as TCP on an H100).
FLOOR = {"transport_floor_gbps": 1.0}


def _room(pe: Any, de: Any, p: FakeBroker, room: int, group: str = "prefill-group") -> None:
    de.handle.receiver(room, SenderRef(p.address, group)).init([room % 8, room % 8 + 8], aux_row=0)
    sender = pe.handle.sender(room)
    sender.init(2, aux_row=1)
    sender.send([1, 2])
    status = de.handle.wait([room], timeout_seconds=20)[room]
    assert status.state == RoomState.SUCCESS, status


def _admin(broker: FakeBroker) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(grpc.insecure_channel(broker.address))


def test_a_gpu_pair_is_probed_once_before_its_first_part_and_judged_device_speed(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any], finished_spans: InMemorySpanExporter
) -> None:
    """The first packed part to a peer's GPU waits for one probe of the pair (one untimed and three
    timed writes, slot to slot); the verdict is "device speed" at the floor or above, is kept for
    the peer (ListPeers, and the room and part spans), and later rooms do not probe again. The
    probe's slots come back on both sides."""
    p, d = fake_brokers("p", **FLOOR), fake_brokers("d", **FLOOR)
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    posted = p.agent.posted
    with capture_logs() as logs:
        _room(pe, de, p, 1)
        _room(pe, de, p, 2)
    probed = [e for e in logs if e["event"] == "transport_probed"]
    assert len(probed) == 1, probed
    assert probed[0]["pair"] == "VRAM:0->VRAM:0" and probed[0]["verdict"] == "device speed" and probed[0]["writes"] == 3
    assert probed[0]["gbps"] >= 1 and probed[0]["bytes"] == 4 << 20, "half the 8 MiB test buffers"
    assert p.agent.posted - posted == 4 + 2, "four probe writes, then one packed part per room (its KV and aux row)"
    [peer] = _admin(p).ListPeers(admin_pb2.ListPeersRequest(), timeout=10).peers
    [verdict] = peer.transports
    assert (verdict.local, verdict.remote, verdict.verdict, verdict.writes, verdict.floor_gbps) == (
        "VRAM:0", "VRAM:0", "device speed", 3, 1.0
    )
    assert verdict.gbps >= 1 and verdict.bytes == 4 << 20
    assert p.broker.queries.transport_gbps() == {(d.address, "VRAM:0->VRAM:0", "device speed"): verdict.gbps}
    assert _admin(d).ListPeers(admin_pb2.ListPeersRequest(), timeout=10).peers[0].transports == [], "the decode broker wrote nothing"
    rooms = [s for s in finished_spans.get_finished_spans() if s.name == "kvbroker.room" and s.attributes.get("kvbroker.transport")]
    assert {s.attributes["kvbroker.room"] for s in rooms} == {1, 2}
    assert all(s.attributes["kvbroker.transport"].startswith("VRAM:0->VRAM:0 device speed") for s in rooms)
    parts = [s for s in finished_spans.get_finished_spans() if s.name == "kvbroker.transfer" and s.attributes.get("kvbroker.path") == "packed"]
    assert parts and all("device speed" in s.attributes["kvbroker.transport"] for s in parts)
    eventually(lambda: p.pools_in_use() == d.pools_in_use() == (0, 0), 5)


def _host_speed(broker: FakeBroker) -> None:
    """The broker's fake agent moves every write as TCP on the host did on an H100 (~0.45 GB/s)."""
    post = broker.agent.post_write_descs

    def slow(local: Any, local_kind: int, remote: Any, remote_kind: int, agent: str, notif: bytes) -> Any:
        xfer = post(local, local_kind, remote, remote_kind, agent, notif)
        xfer.not_before = time.monotonic() + int(local[:, 1].sum()) / HOST_SPEED_BPS
        return xfer

    broker.agent.post_write_descs = slow  # type: ignore[method-assign]


def test_a_pair_that_moves_through_the_host_is_judged_host_fallback_and_warned_once(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any]
) -> None:
    """Writes that move at host speed: the verdict is "host fallback" with its figure (under the
    floor), one warning says so with the figure (not one per room), the rooms still move byte-exact,
    and ProbeTransport probes the pair again on demand, with the same verdict."""
    p, d = fake_brokers("p", **FLOOR), fake_brokers("d", **FLOOR)
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    _host_speed(p)
    with capture_logs() as logs:
        for room in (1, 2, 3):
            _room(pe, de, p, room)
    warned = [e for e in logs if e["event"] == "transport_host_fallback"]
    assert len(warned) == 1, warned
    assert warned[0]["log_level"] == "warning" and warned[0]["pair"] == "VRAM:0->VRAM:0" and warned[0]["peer"] == d.address
    assert 0.2 < warned[0]["gbps"] < 0.6 and warned[0]["floor_gbps"] == 1.0
    response = _admin(p).ProbeTransport(admin_pb2.ProbeTransportRequest(peer=d.address), timeout=30)
    [peer] = response.peers
    [verdict] = [t for t in peer.transports if (t.local, t.remote) == ("VRAM:0", "VRAM:0")]
    assert verdict.verdict == "host fallback" and 0.2 < verdict.gbps < 0.6 and verdict.age_seconds < 5
    assert verdict.writes == 1, "the first write under the floor ends the probe"
    eventually(lambda: p.pools_in_use() == d.pools_in_use() == (0, 0), 5)


def test_a_probe_that_cannot_run_is_a_failed_verdict_and_the_rooms_move(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that cannot reserve a probe slot (here: a build without ReserveProbe): the verdict
    says why, once as a warning, and the pair's parts move all the same."""
    p, d = fake_brokers("p", **FLOOR), fake_brokers("d", **FLOOR)

    async def refuse(request: peer_pb2.ReserveProbeRequest) -> peer_pb2.ReserveProbeResponse:
        raise Unimplemented("no ReserveProbe here")

    monkeypatch.setitem(d.server._peer_service.answers.handlers, "ReserveProbe", refuse)
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    with capture_logs() as logs:
        _room(pe, de, p, 1)
    [failed] = [e for e in logs if e["event"] == "transport_probe_failed"]
    assert failed["verdict"].startswith("failed:") and "ReserveProbe" in failed["verdict"]
    [peer] = _admin(p).ListPeers(admin_pb2.ListPeersRequest(), timeout=10).peers
    assert peer.transports[0].verdict.startswith("failed:")


def test_admin_probe_transport_probes_every_gpu_pair_of_a_peer_now(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any]
) -> None:
    """ProbeTransport before any room: every pair of this broker's send buffers (GPU 0, GPU 1 and
    host staging) and the peer's receive buffers where either side is a GPU's; an unknown peer is
    NOT_FOUND."""
    p, d = fake_brokers("p", **FLOOR), fake_brokers("d", **FLOOR)
    make_engine(p.address, "prefill", tp_size=2, tp_rank=0)
    make_engine(p.address, "prefill", tp_size=2, tp_rank=1)
    de = make_engine(d.address, "decode", "dg")
    de.handle.receiver(5, SenderRef(p.address, "prefill-group")).init([1], aux_row=0)  # the brokers handshake
    eventually(lambda: p.loop.call(lambda: any(x.broker_id for x in p.broker.queries.peers() if not x.is_self)), 10)
    response = _admin(p).ProbeTransport(admin_pb2.ProbeTransportRequest(), timeout=30)
    pairs = sorted((t.local, t.remote, t.verdict) for peer in response.peers for t in peer.transports)
    assert pairs == [
        ("DRAM", "VRAM:0", "device speed"),
        ("VRAM:0", "DRAM", "device speed"),
        ("VRAM:0", "VRAM:0", "device speed"),
        ("VRAM:1", "DRAM", "device speed"),
        ("VRAM:1", "VRAM:0", "device speed"),
    ]
    with pytest.raises(grpc.RpcError) as err:
        _admin(p).ProbeTransport(admin_pb2.ProbeTransportRequest(peer="127.0.0.1:1"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_probe_slot_whose_release_never_comes_is_freed_by_the_lease(fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any]) -> None:
    """The receiver holds a probe slot for no room: if ReleaseProbe never comes (the sender died),
    the slot goes back after the lease (the transfer timeout and the peer RPC timeout)."""
    p = fake_brokers("p", **FLOOR)
    d = fake_brokers("d", transfer_timeout_seconds=0.3, peer_rpc_timeout_seconds=0.3, **FLOOR)
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    _room(pe, de, p, 1)
    eventually(lambda: d.pools_in_use() == (0, 0), 5)  # the prefill broker's idle credits went back
    request = peer_pb2.ReserveProbeRequest(
        protocol_version=PROTOCOL_VERSION, sender_broker_id=p.broker.broker_id, kind=VRAM, device_id=0, bytes=1 << 20
    )
    response = d.loop.run(d.broker.routes.peer_requests.reserve_probe(request))
    assert response.lease_seconds == pytest.approx(0.6) and d.pools_in_use()[1] == 1 << 20
    eventually(lambda: d.pools_in_use()[1] == 0, 5)
    d.broker.routes.peer_requests.release_probe(peer_pb2.ReleaseProbeRequest(protocol_version=PROTOCOL_VERSION, probe_id=response.probe_id))

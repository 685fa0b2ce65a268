"""One trace per room across both brokers, collected by a real OTLP receiver.

Two ``kvbroker serve`` processes export spans over OTLP/gRPC to a receiver in
the test. ``kvbroker demo`` moves rooms with its engine ranks as processes;
the test's own engine ranks add a room aborted by the decode side and a room
whose decode broker is killed. Then: each room's spans from both brokers
share one trace id, the parent/child structure is the documented one, the
attributes carry the right bytes and states, and failed rooms carry the cause.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kvbroker import errors
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.testing import BrokerProcess, Cleanup, eventually, scratch_dir
from kvbroker.testing.engine_child import MODEL
from kvbroker.testing.otlp import OtlpReceiver, SpanRecord

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

COMMON = [
    "--peer-heartbeat", "0.2", "--peer-dead-after", "1.0",
    "--finished-room-ttl", "30", "--tombstone-ttl", "30", "--log-level", "warning",
]


def _env(receiver: OtlpReceiver, service: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="100",
        OTEL_SERVICE_NAME=service,
    )
    return env


@pytest.fixture
def traced() -> Iterator[tuple[OtlpReceiver, dict[str, BrokerProcess]]]:
    receiver = OtlpReceiver()
    with scratch_dir("kvb-trace-") as workdir:
        brokers: dict[str, BrokerProcess] = {}
        try:
            for name in ("prefill", "decode", "doomed"):
                brokers[name] = BrokerProcess.launch(name, workdir, COMMON, env=_env(receiver, f"kvbroker-{name}"))
            for broker in brokers.values():
                broker.wait_ready()
            yield receiver, brokers
        finally:
            with Cleanup() as cleanup:
                for broker in brokers.values():
                    cleanup.run(broker.stop)
                cleanup.run(receiver.stop)


#: A span of the engine's own (its request's trace), as the engine's tracer would make it.
ENGINE_SPAN = SpanContext(
    trace_id=0x5EED0000000000000000000000000001, span_id=0x00000000000000E1, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)
)

#: The prefill engine's span in the same request trace.
PREFILL_SPAN = SpanContext(
    trace_id=ENGINE_SPAN.trace_id, span_id=0x00000000000000E2, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)
)


def _rank(address: str, role: str, group: str) -> tuple[BrokerClient, object, EngineMemory]:
    spec = RankSpec(group=group, role=role)  # type: ignore[arg-type]
    memory = EngineMemory.allocate(spec, MODEL, num_pages=16, aux_rows=2, aux_row_bytes=[16])
    client = BrokerClient(address)
    return client, client.register_engine(spec, memory), memory


def test_each_room_is_one_trace_across_both_brokers(traced) -> None:
    """Both sides of every room share one trace; structure, bytes, states and causes are right."""
    receiver, brokers = traced
    p, d, doomed = brokers["prefill"], brokers["decode"], brokers["doomed"]
    out = subprocess.run(
        [sys.executable, "-m", "kvbroker", "demo", "--rooms", "3", "--layers", "2", "--pages", "5", "--json",
         "--prefill-broker", p.address, "--decode-broker", d.address],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["rooms_verified"] == 3

    pc, prefill, _ = _rank(p.address, "prefill", "pg")
    dc, decode, _ = _rank(d.address, "decode", "dg")
    kc, victim, _ = _rank(doomed.address, "decode", "kg")
    aborted, killed = 7_000_001, 7_000_002
    try:
        receiver_a = decode.receiver(aborted, SenderRef(p.address, "pg"))  # type: ignore[attr-defined]
        # This room is opened inside the engine's own request trace: its spans join it.
        token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(ENGINE_SPAN)))
        try:
            receiver_a.init([1, 2, 3], aux_row=0)
        finally:
            otel_context.detach(token)
        sender_a = prefill.sender(aborted)  # type: ignore[attr-defined]
        # The prefill engine opens its side in the same request trace, from a span of its own.
        token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(PREFILL_SPAN)))
        try:
            sender_a.init(3, aux_row=1)
        finally:
            otel_context.detach(token)
        sender_a.send([4], is_last=False)
        eventually(lambda: sender_a.poll() == RoomState.TRANSFERRING, 15.0, interval_seconds=0.05)
        receiver_a.abort("the user closed the stream")
        assert sender_a.wait(15).state == RoomState.FAILED
        victim.receiver(killed, SenderRef(p.address, "pg")).init([1, 2], aux_row=0)  # type: ignore[attr-defined]
        sender_k = prefill.sender(killed)  # type: ignore[attr-defined]
        sender_k.init(2, aux_row=1)
        sender_k.send([5], is_last=False)
        eventually(lambda: sender_k.poll() == RoomState.TRANSFERRING, 15.0, interval_seconds=0.05)
        doomed.kill()
        assert sender_k.wait(15).state == RoomState.FAILED
    finally:
        with Cleanup() as cleanup:
            for engine, client in ((prefill, pc), (decode, dc)):
                cleanup.run(engine.close)  # type: ignore[attr-defined]
                cleanup.run(client.close)
            # The test killed the victim's broker: unregistering there can only fail as Unavailable.
            cleanup.run(victim.close, expect=errors.Unavailable)  # type: ignore[attr-defined]
            cleanup.run(kc.close)
    p.stop()
    d.stop()
    eventually(lambda: len(_rooms(receiver.spans())) >= 5, 15.0, interval_seconds=0.05)
    spans = receiver.spans()
    rooms = _rooms(spans)

    # The hot-path calls make no RPC span (the filter once matched nothing).
    untraced = ("TransferBroker/SendChunk", "TransferBroker/Poll", "TransferBroker/Session", "PeerBroker/RegisterRooms")
    assert not [s.name for s in spans if s.name.endswith(untraced)]
    assert any(s.name.endswith("PeerBroker/Handshake") for s in spans)
    ok_rooms = [r for r, sides in rooms.items() if {s.attributes["kvbroker.state"] for s in sides} == {"ROOM_STATE_SUCCESS"}]
    assert len(ok_rooms) == 3
    for room in ok_rooms:
        sides = {s.attributes["kvbroker.side"]: s for s in rooms[room]}
        sender, receiver_span = sides["sender"], sides["receiver"]
        assert sender.trace_id == receiver_span.trace_id, f"room {room}: two traces"
        assert (sender.service, receiver_span.service) == ("kvbroker-prefill", "kvbroker-decode")
        # receiver room: the root (the demo's engine has no trace of its own);
        # sender room <- receiver room (its registration carried the room's
        # trace context; the batched RegisterRooms call has a trace of its own)
        assert receiver_span.parent_span_id == ""
        assert sender.parent_span_id == receiver_span.span_id
        transfers = [s for s in spans if s.name == "kvbroker.transfer" and s.parent_span_id == sender.span_id]
        assert transfers and all(t.ok for t in transfers)
        assert sum(t.attributes["kvbroker.bytes"] for t in transfers) == sender.attributes["kvbroker.bytes"]
        assert sender.attributes["kvbroker.bytes"] == receiver_span.attributes["kvbroker.bytes"] > 0
        assert any(s.name == "kvbroker.aux" and s.parent_span_id in {t.span_id for t in transfers} for s in spans)
        children = {s.name for s in spans if s.parent_span_id == receiver_span.span_id}
        # wait_for_data starts when the sender's broker answers the registration; when the data
        # (and the room's end) arrives before that answer is handled (seen once in CI), there was
        # no wait, and no such span.
        assert "kvbroker.completion" in children
        assert {"kvbroker.completion"} <= {s.name for s in spans if s.parent_span_id == sender.span_id}

    sides = {s.attributes["kvbroker.side"]: s for s in rooms[aborted]}
    assert sides["sender"].trace_id == sides["receiver"].trace_id == f"{ENGINE_SPAN.trace_id:032x}"
    assert sides["receiver"].parent_span_id == f"{ENGINE_SPAN.span_id:016x}"
    assert sides["sender"].parent_span_id == f"{PREFILL_SPAN.span_id:016x}"
    for span in sides.values():
        assert not span.ok and span.attributes["kvbroker.failure.kind"] == "FAILURE_KIND_ABORTED"
        assert span.attributes["kvbroker.failure.message"] == "the user closed the stream"
    assert any(s.name == "kvbroker.abort" and s.parent_span_id == sides["receiver"].span_id for s in spans)

    (sender_k_span,) = [s for s in rooms[killed] if s.service == "kvbroker-prefill"]
    assert not sender_k_span.ok
    assert sender_k_span.attributes["kvbroker.failure.kind"] in ("FAILURE_KIND_PEER", "FAILURE_KIND_TRANSFER")
    assert doomed.address in sender_k_span.attributes["kvbroker.failure.message"]


def _rooms(spans: list[SpanRecord]) -> dict[int, list[SpanRecord]]:
    out: dict[int, list[SpanRecord]] = defaultdict(list)
    for span in spans:
        if span.name == "kvbroker.room":
            out[int(span.attributes["kvbroker.room"])].append(span)
    return out

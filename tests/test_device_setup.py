"""The device path's setup, on the fake CUDA driver: what a GPU's transfer buffers and lane need
before the first part, on which thread, and under which device's context.

Regressions of issue 28 (findings 4-6), each failing on 84c710c:

- the GPU lane (torch's CUDA, a stream, a waiter thread) came up on the control loop at the first
  packed part, after NIXL and UCX had loaded: seconds of stall near ``--peer-dead-after``;
- an engine was listed (and the engine epoch bumped) before its GPU's transfer buffers existed: a
  handshake in that window told the peer no receive buffer and nothing refreshed it ("receiver
  none for GPU 0");
- with two GPUs in one broker, writes from one GPU's buffer were posted under the other GPU's
  context (the last one registration made current on the data-plane thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvbroker.broker.device import ArrayViews, Extent, Work
from kvbroker.broker.memory import StagingBuffer
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.testing import FakeBroker
from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
from kvbroker.testing.scenario import Scenario, run_scenario
from kvbroker.v1 import common_pb2

from .conftest import SMALL_MODEL, fill_regions, page_bytes

VRAM, DRAM = common_pb2.MEMORY_KIND_VRAM, common_pb2.MEMORY_KIND_DRAM


class _RecordingStreams:
    """A GPU's streams (``device.Streams``) that record where each device's stream was made; a job
    runs at once where it is launched, its event is done when launched."""

    def __init__(self) -> None:
        self.made: list[tuple[int, str]] = []

    def open(self, device: int) -> int:
        self.made.append((device, threading.current_thread().name))
        return device

    def launch(self, stream: int, job: Callable[[], Callable[[], Any]], work: Work) -> tuple[Callable[[], Any], None]:
        return job(), None

    def query(self, stream: int, event: None) -> bool:
        return True

    def finish(self, stream: int, read: Callable[[], Any]) -> Any:
        return read()


def test_a_gpus_lane_comes_up_at_registration_on_the_memory_thread(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lane of a GPU (on a GPU: torch's CUDA initialised, a stream, a waiter thread) is made when
    the first engine with memory there registers, on the memory thread, before the registration
    returns: never on the control loop, never at the first packed part."""
    # VRAM copies go to the (recording) GPU lane, though the fake's VRAM is host memory.
    streams = _RecordingStreams()
    fake = FakeCudaLib(devices=2, granularity=4096)
    p = fake_brokers("p", cuda=fake, streams=streams)
    de = make_engine(fake_brokers("d").address, "decode")
    rank = RankSpec(group="pg", role="prefill")
    memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=16)
    fill_regions(memory, 3)
    reference = [t.clone() for t in page_bytes(memory, 1, [2, 5])]
    as_fake_vram(memory, fake, device=1)
    with BrokerClient(p.address) as client:
        engine = client.register_engine(rank, memory)
        assert streams.made, "no lane was made at registration"
        assert [device for device, _ in streams.made] == [1]
        assert streams.made[0][1].startswith("kvbroker-memory"), streams.made
        de.handle.receiver(1, SenderRef(p.address, "pg")).init([7, 8])
        sender = engine.sender(1)
        sender.init(2)
        sender.send([2, 5])
        assert de.handle.wait([1], timeout_seconds=10)[1].state == RoomState.SUCCESS
        assert all(torch.equal(a, b) for a, b in zip(page_bytes(de.memory, 1, [7, 8]), reference))
        assert p.broker.queries.counters.transfers_packed == 1
        assert len(streams.made) == 1, "the part used the lane made at registration"
        engine.close()
    memory.close()


def test_a_handshake_while_an_engine_registers_on_a_new_gpu_does_not_hide_its_receive_buffer(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode broker handshakes with the prefill broker (for another engine's room) while a
    VRAM engine registers there and its GPU's transfer buffers are being made. The engine is not
    announced before its buffers exist, so the handshake after its registration tells the prefill
    broker the new receive buffer, and the engine's rooms move (on 84c710c they failed: the
    handshake in the window announced the engine with no receive buffer on its GPU, and nothing
    refreshed it)."""
    fake = FakeCudaLib(devices=2, granularity=4096)
    p, d = fake_brokers("p", cuda=fake), fake_brokers("d", cuda=fake)
    pe = make_engine(p.address, "prefill", "pg")
    early = make_engine(d.address, "decode", "early")
    entered, release = threading.Event(), threading.Event()
    original = StagingBuffer.device.__func__  # type: ignore[attr-defined]

    def slow_device(cls: type[StagingBuffer], size_bytes: int, ordinal: int, driver: Any) -> StagingBuffer:
        entered.set()
        release.wait(20)
        return original(cls, size_bytes, ordinal, driver)  # type: ignore[no-any-return]

    monkeypatch.setattr(StagingBuffer, "device", classmethod(slow_device))
    rank = RankSpec(group="late", role="decode")
    memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=32, aux_rows=4, aux_row_bytes=[16])
    as_fake_vram(memory, fake, device=0)
    client = BrokerClient(d.address)
    registered: list[Any] = []
    registering = threading.Thread(target=lambda: registered.append(client.register_engine(rank, memory)))
    registering.start()
    try:
        assert entered.wait(10), "the transfer buffers were never asked for"
        # The window: the decode broker's first handshake with the prefill broker.
        early.handle.receiver(1, SenderRef(p.address, "pg")).init([1, 2], aux_row=0)
        sender = pe.handle.sender(1)
        sender.init(2, aux_row=0)
        sender.send([3, 4])
        assert early.handle.wait([1], timeout_seconds=10)[1].state == RoomState.SUCCESS
    finally:
        release.set()
        registering.join(20)
    [late] = registered
    try:
        late.receiver(2, SenderRef(p.address, "pg")).init([9, 10, 11], aux_row=2)
        sender = pe.handle.sender(2)
        sender.init(3, aux_row=1)
        sender.send([5, 6, 7])
        status = late.wait([2], timeout_seconds=10)[2]
        assert status.state == RoomState.SUCCESS, status
        for got, sent in zip(page_bytes(memory, 0, [9, 10, 11]), page_bytes(pe.memory, 0, [5, 6, 7])):
            assert torch.equal(got, sent)
    finally:
        late.close()
        client.close()
        memory.close()


class _PerThreadCuda(FakeCudaLib):
    """The fake driver, recording the context each thread made current (a context is per thread)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.thread_context: dict[int, int] = {}

    def _cuCtxSetCurrent(self, ctx: Any) -> None:
        super()._cuCtxSetCurrent(ctx)
        self.thread_context[threading.get_ident()] = ctx.value if hasattr(ctx, "value") else ctx


def test_writes_from_each_gpu_are_posted_under_that_gpus_context(fake_brokers: Callable[..., FakeBroker]) -> None:
    """Two prefill ranks on GPUs 0 and 1 of one broker: every packed write is posted on the
    data-plane thread with its source buffer's GPU's context current (UCX's CUDA transports take
    the current context), not with whichever GPU registered last."""
    fake = _PerThreadCuda(devices=2, granularity=4096)
    p, d = fake_brokers("p", cuda=fake), fake_brokers("d", cuda=fake)
    posted: list[tuple[int, int | None]] = []
    post = p.agent.post_write_descs

    def checked(local: Any, local_kind: int, remote: Any, remote_kind: int, agent: str, notif: bytes) -> Any:
        if local_kind == VRAM:
            device = int(local[0][2])
            posted.append((device, fake.thread_context.get(threading.get_ident())))
        return post(local, local_kind, remote, remote_kind, agent, notif)

    p.agent.post_write_descs = checked  # type: ignore[method-assign]

    def prepare(memory: EngineMemory, spec: RankSpec) -> None:
        as_fake_vram(memory, fake, device=spec.tp_rank % 2)

    result = run_scenario(p.address, d.address, Scenario(prefill_tp=2, decode_tp=1), timeout_seconds=30, prepare=prepare)
    assert result.ok, "\n".join(result.problems[:20])
    assert {device for device, _ in posted} == {0, 1}
    primary = {0: 0xC7000, 1: 0xC7001}  # the fake's primary context of each device
    wrong = [(device, context) for device, context in posted if context != primary[device]]
    assert not wrong, f"{len(wrong)} of {len(posted)} writes posted under another GPU's context: {wrong[:4]}"


def test_a_lane_asked_for_before_registration_made_it_is_made_once_off_the_loop() -> None:
    """``Lanes.run`` for a GPU whose lane is not open yet makes it (once, on the memory thread)."""
    import asyncio

    from kvbroker.broker.dataplane import DataPlane, Workers
    from kvbroker.broker.device import Lanes
    from kvbroker.testing.fake_nixl import FakeAgent

    streams = _RecordingStreams()
    workers = Workers()
    views = ArrayViews()

    async def run() -> list[int]:
        dataplane = DataPlane(FakeAgent("lanes-test"), on_events=lambda events: None, take_notice=None, transfer_timeout_seconds=10)
        dataplane.start()
        lanes = Lanes(workers, views, dataplane, streams)
        slot = Extent(0, 0, VRAM, 3)
        got = await asyncio.gather(*(lanes.run(slot, lambda i=i: (lambda: i)) for i in range(4)))
        lanes.close()
        await dataplane.stop()
        return list(got)

    try:
        assert asyncio.run(run()) == [0, 1, 2, 3]
        assert streams.made == [(3, streams.made[0][1])] and streams.made[0][1].startswith("kvbroker-memory")
    finally:
        workers.shutdown()

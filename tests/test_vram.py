"""VRAM buffers through the broker, on CPU: the fake CUDA driver and the fake NIXL agent.

The fake driver's "device memory" is a memfd that its ``cuMemMap`` maps
into the broker, so the broker runs its real VRAM path (UUID lookup,
import, NIXL registration as VRAM, VRAM descriptors, the staging decision,
release on session end) and the fake NIXL agent moves real bytes, which the
decode ranks check against the reference. What this cannot show is that
the CUDA driver and NIXL accept it on a GPU: that is tests/test_gpu.py.
"""

from __future__ import annotations

import grpc
import pytest

from kvbroker import cudavmm
from kvbroker.client import BrokerClient, EngineMemory, RankSpec
from kvbroker.errors import FailedPrecondition, InvalidArgument
from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
from kvbroker.testing.scenario import Scenario, run_scenario
from kvbroker.v1 import common_pb2

from .conftest import SMALL_MODEL


def _vram_brokers(fake_brokers, fake: FakeCudaLib):  # type: ignore[no-untyped-def]
    driver = cudavmm.Driver(fake)
    p, d = fake_brokers("p"), fake_brokers("d")
    for broker in (p, d):
        broker.broker.engines.cuda_driver = driver
        # The fake driver's "device memory" is host memory: staging copies view it with numpy.
        broker.broker.views.device_as_host = True
    return p, d


@pytest.mark.parametrize(
    ("scenario", "vram_roles"),
    [
        (Scenario(), ("prefill", "decode")),
        (Scenario(prefill_tp=1, decode_tp=2), ("prefill",)),
        (Scenario(prefill_tp=2, decode_tp=1), ("decode",)),
        (Scenario(prefill_tp=2, decode_tp=2, state=("mamba", "swa")), ("prefill", "decode")),
        (Scenario(prefill_tp=2, decode_tp=1, mla=True, head_dim=40), ("decode",)),
    ],
    ids=["tp1-tp1-both", "tp1-tp2-prefill-vram", "tp2-tp1-decode-vram", "tp2-tp2-both-state", "mla-tp2-tp1-decode-vram"],
)
def test_vram_buffers_move_byte_exact_and_are_released(fake_brokers, scenario: Scenario, vram_roles: tuple[str, ...]) -> None:
    """VRAM regions go GPU-direct; VRAM head slices are packed in staging buffers on their GPU (never in
    host memory); nothing is left behind, the GPU staging buffers included once their engines are gone."""
    fake = FakeCudaLib(devices=2, granularity=4096)
    p, d = _vram_brokers(fake_brokers, fake)

    def prepare(memory: EngineMemory, spec: RankSpec) -> None:
        if spec.role in vram_roles:
            as_fake_vram(memory, fake, device=spec.tp_rank % 2)

    result = run_scenario(p.address, d.address, scenario, timeout_seconds=30, prepare=prepare)
    assert result.ok, "\n".join(result.problems[:20])
    counters = p.broker.counters
    if scenario.prefill_tp != scenario.decode_tp and not scenario.mla:
        assert counters.transfers_staged > 0 and counters.transfers_per_token == 0
        # The brokers allocated staging buffers on the GPUs (cuMemCreate: the engines' memory is adopted).
        assert "cuMemCreate" in fake.calls
    else:
        assert counters.transfers_staged == 0
    for broker in (p, d):
        broker.evict_now()
        assert not any(broker.tables().values()), broker.tables()
        assert broker.agent.registrations == 1 + 1, "only the two staging buffers stay registered"
    assert fake.leaks() == []
    assert set(fake.calls) >= {"cuMemImportFromShareableHandle", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"}


def test_vram_buffer_is_registered_with_nixl_as_vram_on_the_uuid_device(fake_brokers, make_engine) -> None:
    fake = FakeCudaLib(devices=2, granularity=4096)
    p, _ = _vram_brokers(fake_brokers, fake)
    rank = RankSpec(group="g", role="prefill")
    memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8)
    as_fake_vram(memory, fake, device=1)
    with BrokerClient(p.address) as client:
        engine = client.register_engine(rank, memory)
        [registered] = p.loop.call(lambda: list(p.broker.engines.by_id.values()))
        assert [(b.kind, b.device_id) for b in registered.buffers] == [(common_pb2.MEMORY_KIND_VRAM, 1)]
        # The engine's buffer, and the send and receive staging buffers the broker made on that GPU.
        assert [r[2:] for r in p.agent._regs.values()].count((common_pb2.MEMORY_KIND_VRAM, 1)) == 1 + 2
        engine.close()
    assert [r[2:] for r in p.agent._regs.values()].count((common_pb2.MEMORY_KIND_VRAM, 1)) == 0, "freed with the engine"
    memory.close()
    assert fake.leaks() == []


@pytest.mark.skipif(cudavmm.driver_present(), reason="this host has a CUDA driver")
def test_broker_without_cuda_refuses_vram_and_keeps_nothing(fake_brokers) -> None:
    """FAILED_PRECONDITION naming the missing driver; no engine, no registration, no fd left."""
    p = fake_brokers("p")
    rank = RankSpec(group="g", role="prefill")
    memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8)
    fake = FakeCudaLib(granularity=4096)
    as_fake_vram(memory, fake)
    with BrokerClient(p.address) as client:
        with pytest.raises(FailedPrecondition, match="libcuda.so.1") as info:
            client.register_engine(rank, memory)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert p.loop.call(lambda: len(p.broker.engines.by_id)) == 0
    assert p.agent.registrations == 2, "only the staging buffers"
    memory.close()


@pytest.mark.skipif(cudavmm.driver_present(), reason="this host has a CUDA driver")
def test_engine_memory_on_a_cuda_device_needs_cuda() -> None:
    rank = RankSpec(group="g", role="prefill")
    with pytest.raises(FailedPrecondition, match="no CUDA device"):
        EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8, device="cuda:0")


def test_engine_memory_lives_on_the_host_or_a_cuda_device() -> None:
    rank = RankSpec(group="g", role="prefill")
    with pytest.raises(InvalidArgument, match="host"):
        EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8, device="meta")

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


# -- VRAM the engine allocated itself (EngineMemory.adopt of CUDA tensors) ----------------------
def _device_bytes(fake: FakeCudaLib, driver: cudavmm.Driver, allocator: str, size: int, device: int = 1):  # type: ignore[no-untyped-def]
    """``size`` bytes of the fake device's memory, allocated as an engine's allocator would, as a
    uint8 tensor (the fake's device memory is host memory), and how to free it."""
    import ctypes

    import torch

    ctx = driver.retain_context(driver.device(device))
    if allocator == "cudaMalloc":
        ptr = ctypes.c_ulonglong()
        driver.call("cuMemAlloc_v2", ctypes.byref(ptr), size)
        address = ptr.value

        def free() -> None:
            driver.call("cuMemFree_v2", address)
            driver.call("cuDevicePrimaryCtxRelease_v2", device)
    else:  # a VMM allocation with a POSIX-fd handle type, as kvbroker's allocator (and PyTorch's, asked) make
        mapping, fd = cudavmm.export_buffer(device, size, driver)
        import os

        os.close(fd)
        address = mapping.address

        def free() -> None:
            mapping.release()
            driver.call("cuDevicePrimaryCtxRelease_v2", device)

    del ctx
    raw = torch.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=torch.uint8)
    return raw, free


@pytest.mark.parametrize("allocator", ["cudaMalloc", "vmm"])
def test_kv_the_engine_allocated_on_its_gpu_moves_from_where_it_lies(fake_brokers, make_engine, allocator: str) -> None:
    """The prefill engine's own device allocation (cudaMalloc: a CUDA IPC handle; VMM: an fd) holds its
    K and V at offsets the broker learns from the pointers; nothing is copied at registration, the
    pages move byte-exact, the aux row (host memory) with them, and the broker lets go of the
    allocation when the engine goes."""
    import torch

    from kvbroker.client import SenderRef

    fake = FakeCudaLib(devices=2, granularity=4096)
    p, d = _vram_brokers(fake_brokers, fake)
    driver = cudavmm.Driver(fake)
    raw, free = _device_bytes(fake, driver, allocator, 8192)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    pages, page = 8, 4 * 2 * 8 * 2  # SMALL_MODEL: 4 tokens x 2 heads x 8 dims x fp16
    kv = {layer: [raw[(2 * layer + i) * pages * page : (2 * layer + i + 1) * pages * page].view(torch.float16).view(pages, 4, 2, 8) for i in range(2)] for layer in range(2)}
    aux = torch.arange(4 * 16, dtype=torch.uint8).view(4, 16)
    rank = RankSpec(group="prefill-group", role="prefill")
    memory = EngineMemory.adopt(rank, SMALL_MODEL, kv=kv, aux=[aux], cuda_driver=driver)
    assert kv[1][1].data_ptr() == raw.data_ptr() + 3 * pages * page, "not moved"
    (vram, vram_spec), (_, dram_spec) = memory.buffers
    assert vram_spec.kind == common_pb2.MEMORY_KIND_VRAM and vram_spec.device_uuid == fake.uuid_of(1)
    assert dram_spec.kind == common_pb2.MEMORY_KIND_DRAM
    assert (len(vram_spec.cuda_ipc_handle) == 64 and vram == -1) if allocator == "cudaMalloc" else (not vram_spec.cuda_ipc_handle and vram >= 0)
    de = make_engine(d.address, "decode")
    with BrokerClient(p.address) as client:
        engine = client.register_engine(rank, memory)
        [registered] = p.loop.call(lambda: list(p.broker.engines.by_id.values()))
        assert [(b.kind, b.device_id) for b in registered.buffers] == [(common_pb2.MEMORY_KIND_VRAM, 1), (common_pb2.MEMORY_KIND_DRAM, 0)]
        de.handle.receiver(70, SenderRef(p.address, "prefill-group")).init([5, 6, 7], aux_row=2)
        sender = engine.sender(70)
        sender.init(3, aux_row=1)
        sender.send([0, 3, 7])
        assert de.handle.wait([70], timeout_seconds=10)[70].state == common_pb2.ROOM_STATE_SUCCESS
        for layer in range(2):
            for got, sent in zip(de.memory.kv_tensors(layer), kv[layer]):
                assert torch.equal(got[[5, 6, 7]].view(torch.uint8), sent[[0, 3, 7]].view(torch.uint8))
        assert bytes(de.memory.aux[0][2]) == bytes(aux[1])
        engine.close()
    assert "cuIpcOpenMemHandle_v2" in fake.calls if allocator == "cudaMalloc" else "cuMemImportFromShareableHandle" in fake.calls
    memory.close()
    free()
    assert fake.leaks() == [], "the broker let go of the engine's allocation"


def test_device_memory_that_cannot_be_exported_is_refused_by_name(fake_brokers) -> None:
    """A VMM allocation made without the POSIX-fd handle type, and a pointer in no device allocation."""
    import ctypes

    import torch

    fake = FakeCudaLib(devices=1, granularity=4096)
    driver = cudavmm.Driver(fake)
    dev = driver.device(0)
    driver.retain_context(dev)
    prop = driver.allocation_prop(dev, rdma=False)
    prop.requestedHandleTypes = 0
    handle = ctypes.c_ulonglong()
    driver.call("cuMemCreate", ctypes.byref(handle), 4096, ctypes.byref(prop), 0)
    address = cudavmm._map(driver, dev, handle.value, 4096, 4096)
    raw = torch.frombuffer((ctypes.c_uint8 * 4096).from_address(address), dtype=torch.uint8)
    kv = {layer: [raw[i * 1024 : (i + 1) * 1024].view(torch.float16).view(8, 4, 2, 8) for i in (2 * layer, 2 * layer + 1)] for layer in range(2)}
    rank = RankSpec(group="g", role="prefill")
    with pytest.raises(FailedPrecondition, match="POSIX_FILE_DESCRIPTOR"):
        EngineMemory.adopt(rank, SMALL_MODEL, kv=kv, cuda_driver=driver)
    host = {layer: [torch.zeros(8, 4, 2, 8, dtype=torch.float16) for _ in range(2)] for layer in range(2)}
    with pytest.raises(InvalidArgument, match="not in a CUDA device allocation"):
        EngineMemory.adopt(rank, SMALL_MODEL, kv=host, cuda_driver=driver)
    driver.call("cuMemUnmap", address, 4096)
    driver.call("cuMemAddressFree", address, 4096)
    driver.call("cuMemRelease", handle.value)
    driver.call("cuDevicePrimaryCtxRelease_v2", dev)
    assert fake.leaks() == []


def test_a_cuda_ipc_buffer_larger_than_its_allocation_is_refused(fake_brokers) -> None:
    """The broker checks the opened allocation's size against the buffer's claim, and closes it."""
    import torch

    fake = FakeCudaLib(devices=2, granularity=4096)
    p, _ = _vram_brokers(fake_brokers, fake)
    driver = cudavmm.Driver(fake)
    raw, free = _device_bytes(fake, driver, "cudaMalloc", 4096)
    kv = {layer: [raw[i * 1024 : (i + 1) * 1024].view(torch.float16).view(8, 4, 2, 8) for i in (2 * layer, 2 * layer + 1)] for layer in range(2)}
    rank = RankSpec(group="g", role="prefill")
    memory = EngineMemory.adopt(rank, SMALL_MODEL, kv=kv, cuda_driver=driver)
    memory.buffers[0][1].size_bytes = 8192
    memory.layout.regions[0].length_bytes = 1024  # the layout still fits the claimed size
    with BrokerClient(p.address) as client:
        with pytest.raises(InvalidArgument, match="holds 4096"):
            client.register_engine(rank, memory)
    assert p.loop.call(lambda: len(p.broker.engines.by_id)) == 0
    memory.close()
    free()
    assert fake.leaks() == []

"""The device path on CPU: the fake CUDA driver and the fake NIXL agent, with what a GPU showed.

The fake driver's "device memory" is host memory (memfds its ``cuMemMap``
maps), viewed by the broker as torch CPU tensors, so the broker runs its
real device path: it imports and maps engine VRAM without registering it
with NIXL, allocates cudaMalloc transfer buffers per GPU and registers only
those, gathers whatever of a chunk lies in VRAM into a slot with torch index
ops, writes it in one descriptor, and scatters it at the receiver. The fake
agent follows what an H100 showed (../shared/gpu/README.md): a pointer
opened from a CUDA IPC handle cannot be registered, and a write into a VMM
allocation moves at host speed; ``assert_device_rules`` fails a test whose
broker registered engine VRAM or wrote VRAM anywhere but a transfer buffer.
What this cannot show is CUDA itself: that is tests/test_gpu.py.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
import torch

from kvbroker import cudavmm
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.errors import FailedPrecondition, InvalidArgument
from kvbroker.testing import FakeBroker, eventually
from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
from kvbroker.testing.fake_nixl import HOST_SPEED_BPS, FakeAgent, FakeFabric, XferScript
from kvbroker.testing.scenario import Scenario, run_scenario
from kvbroker.v1 import common_pb2

from .conftest import SMALL_MODEL, assert_device_rules, page_bytes

VRAM, DRAM = common_pb2.MEMORY_KIND_VRAM, common_pb2.MEMORY_KIND_DRAM


def _vram_brokers(fake_brokers: Callable[..., FakeBroker], fake: FakeCudaLib, **config: object) -> tuple[FakeBroker, FakeBroker]:
    return fake_brokers("p", cuda=fake, **config), fake_brokers("d", cuda=fake, **config)


def _leaks_once_stopped(fake: FakeCudaLib, *brokers: FakeBroker) -> list[str]:
    """What the fake driver still holds once ``brokers`` stopped (a broker keeps its GPUs'
    transfer buffers, and so their primary contexts, until it stops)."""
    for broker in brokers:
        broker.stop()
    return fake.leaks()


@pytest.mark.parametrize(
    ("scenario", "vram_roles", "part_kib"),
    [
        (Scenario(), ("prefill", "decode"), 0),
        (Scenario(pages=12, chunks=2), ("prefill", "decode"), 16),
        (Scenario(prefill_tp=1, decode_tp=2), ("prefill",), 0),
        (Scenario(prefill_tp=2, decode_tp=1), ("decode",), 0),
        (Scenario(prefill_tp=2, decode_tp=1), ("prefill", "decode"), 4),
        (Scenario(prefill_tp=2, decode_tp=2, state=("mamba", "swa")), ("prefill", "decode"), 0),
        (Scenario(prefill_tp=2, decode_tp=1, mla=True, head_dim=40), ("decode",), 0),
        (Scenario(prefill_pp=2, decode_pp=1, state=("mamba",)), ("prefill", "decode"), 0),
        (Scenario(prefill_tp=4, decode_tp=2, kv_heads=2), ("prefill", "decode"), 0),
        (Scenario(prefill_tp=2, decode_tp=1, kv_layout="hnd_fused"), ("prefill", "decode"), 0),
    ],
    ids=[
        "tp1-tp1-both",
        "tp1-tp1-split-into-parts",
        "tp1-tp2-prefill-vram",
        "tp2-tp1-decode-vram",
        "tp2-tp1-both-split",
        "tp2-tp2-both-state",
        "mla-tp2-tp1-decode-vram",
        "pp2-pp1-state",
        "tp4-tp2-gqa-replicated",
        "fused-tp2-tp1",
    ],
)
def test_vram_moves_packed_byte_exact_and_nothing_is_left(
    fake_brokers: Callable[..., FakeBroker], scenario: Scenario, vram_roles: tuple[str, ...], part_kib: int
) -> None:
    """Every layout moves byte-exact when either side's memory is VRAM: only packed parts touch it
    (one write each, slot to slot; ``part_kib`` cuts chunks into several), engine VRAM is never
    registered with NIXL, no write targets anything but a transfer buffer, and once the engines
    are gone nothing is held: no per-room record, no reservation, no mapping, no GPU buffer."""
    fake = FakeCudaLib(devices=2, granularity=4096)
    config = {"device_part_bytes": part_kib << 10} if part_kib else {}
    p, d = _vram_brokers(fake_brokers, fake, **config)

    def prepare(memory: EngineMemory, spec: RankSpec) -> None:
        if spec.role in vram_roles:
            as_fake_vram(memory, fake, device=spec.tp_rank % 2)

    result = run_scenario(p.address, d.address, scenario, timeout_seconds=30, prepare=prepare)
    assert result.ok, "\n".join(result.problems[:20])
    counters = p.broker.queries.counters
    assert counters.transfers_packed > 0
    assert counters.transfers_staged == counters.transfers_per_token == counters.transfers_token_runs == 0
    if part_kib:
        assert counters.transfers_packed > scenario.rooms * scenario.chunks * scenario.prefill_tp, "chunks were cut"
    for broker in (p, d):
        assert_device_rules(broker)
        broker.evict_now()
        assert not any(broker.tables().values()), broker.tables()
    for broker in (p, d):
        # Idle receive credits go back to their receiver within a second; the GPUs' buffers stay.
        eventually(lambda b=broker: b.loop.call(lambda: (b.broker.queries.traffic.staging_in_use("send"), b.broker.queries.traffic.staging_in_use("receive"))) == (0, 0), 5)
        assert broker.agent.vram_registrations().keys() <= {"cudaMalloc"}
    assert _leaks_once_stopped(fake, p, d) == []
    assert {"cuMemImportFromShareableHandle", "cuMemMap", "cuMemAlloc_v2", "cuMemFree_v2"} <= set(fake.calls)
    assert "cuMemCreate" not in fake.calls, "the brokers made no VMM memory"


def test_engine_vram_is_mapped_not_registered_and_its_gpu_gets_transfer_buffers(fake_brokers, make_engine) -> None:  # type: ignore[no-untyped-def]
    """An engine's VRAM buffer is imported on the device its UUID names and mapped for the broker's
    copies, never registered with NIXL; the broker registers a cudaMalloc send and receive buffer on
    that GPU instead (once, whatever the number of engines), and keeps them after the last engine."""
    fake = FakeCudaLib(devices=2, granularity=4096)
    p, d = _vram_brokers(fake_brokers, fake, device_send_bytes=1 << 20, device_receive_bytes=2 << 20)
    memories, engines = [], []
    with BrokerClient(p.address) as client:
        for tp_rank in (0, 1):
            rank = RankSpec(group="g", role="prefill", tp_size=2, tp_rank=tp_rank)
            memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8)
            as_fake_vram(memory, fake, device=1)
            memories.append(memory)
            engines.append(client.register_engine(rank, memory))
        registered = p.loop.call(lambda: p.broker.queries.engines())
        assert {(b.kind, b.device_id) for e in registered for b in e.buffers} == {(VRAM, 1)}
        assert all(e.registrations == [] and e.dlists == {} for e in registered), "engine VRAM is not NIXL's"
        vram = [r for r in p.agent._regs.values() if r[2] == VRAM]
        assert sorted((size, dev) for _, size, _, dev in vram) == [(1 << 20, 1), (2 << 20, 1)]
        assert p.agent.vram_registrations() == {"cudaMalloc": 2}
        for engine in engines:
            engine.close()
    assert p.agent.vram_registrations() == {"cudaMalloc": 2}, "kept after the last engine"
    for memory in memories:
        memory.close()
    assert _leaks_once_stopped(fake, p, d) == []


def test_two_engines_leaving_one_gpu_at_once_leave_cleanly(fake_brokers) -> None:  # type: ignore[no-untyped-def]
    """Regression (seen on an H100 at tp2 -> tp1): both prefill engines of a GPU unregistering at once
    made UnregisterEngine fail with KeyError ('receive', 2, 0) when they freed the GPU's buffers;
    now both leave cleanly and the buffers stay."""
    import threading

    fake = FakeCudaLib(devices=1, granularity=4096)
    p, d = _vram_brokers(fake_brokers, fake)
    clients, engines, memories = [], [], []
    for tp_rank in (0, 1):
        rank = RankSpec(group="g", role="prefill", tp_size=2, tp_rank=tp_rank)
        memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8)
        as_fake_vram(memory, fake, device=0)
        client = BrokerClient(p.address)
        clients.append(client)
        memories.append(memory)
        engines.append(client.register_engine(rank, memory))
    errors: list[BaseException] = []

    def close(engine) -> None:  # type: ignore[no-untyped-def]
        try:
            engine.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=close, args=(e,)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert p.agent.vram_registrations() == {"cudaMalloc": 2} and p.loop.call(lambda: len(p.broker.queries.engines())) == 0
    for client in clients:
        client.close()
    for memory in memories:
        memory.close()
    assert _leaks_once_stopped(fake, p, d) == []


def test_engines_that_come_again_move_through_the_buffers_their_gpu_kept(fake_brokers) -> None:  # type: ignore[no-untyped-def]
    """Regression (seen on an H200, bench/gpu_bench.py): when a GPU's last engine left, its broker
    freed the transfer buffers, and the next engine's were made at the same address with new NIXL
    keys; the peer, which had loaded the old ones, refused the broker's metadata
    (NIXL_ERR_NOT_ALLOWED) and every room between them failed. The buffers now stay: engines that
    come again on both sides move byte-exact through the same ones."""
    fake = FakeCudaLib(devices=1, granularity=4096)
    p, d = _vram_brokers(fake_brokers, fake)

    def prepare(memory: EngineMemory, spec: RankSpec) -> None:
        as_fake_vram(memory, fake, device=0)

    for _ in range(2):
        result = run_scenario(p.address, d.address, Scenario(rooms=2), timeout_seconds=30, prepare=prepare)
        assert result.ok, "\n".join(result.problems[:20])
    assert fake.calls.count("cuMemAlloc_v2") == 4, "each broker made its two buffers once"
    assert _leaks_once_stopped(fake, p, d) == []


# -- the rules a GPU showed, as the fake agent keeps them ------------------------------


def _device_bytes(driver: cudavmm.Driver, allocator: str, size: int, device: int = 1):  # type: ignore[no-untyped-def]
    """``size`` bytes of the fake device's memory, allocated as an engine's allocator would, as a
    uint8 tensor (the fake's device memory is host memory), and how to free it."""
    ctx = driver.retain_context(driver.device(device))
    if allocator == "cudaMalloc":
        ptr = ctypes.c_ulonglong()
        driver.call("cuMemAlloc_v2", ctypes.byref(ptr), size)
        address = ptr.value

        def free() -> None:
            driver.call("cuMemFree_v2", address)
            driver.call("cuDevicePrimaryCtxRelease_v2", device)
    else:  # a VMM allocation with a POSIX-fd handle type, as kvbroker's allocator (and PyTorch's, asked) make
        import os

        mapping, fd = cudavmm.export_buffer(device, size, driver)
        os.close(fd)
        address = mapping.address

        def free() -> None:
            mapping.release()
            driver.call("cuDevicePrimaryCtxRelease_v2", device)

    del ctx
    raw = torch.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=torch.uint8)
    return raw, free


def test_the_fake_agent_keeps_what_a_gpu_showed() -> None:
    """An IPC-opened pointer cannot be registered (NIXL_ERR_BACKEND); a write into a VMM allocation
    takes as long as its bytes take over TCP on the host; into cudaMalloc memory it does not. The
    agent remembers every VRAM registration and write source and target over its life, and
    ``assert_device_rules`` catches a broker that wrote VRAM anywhere but a transfer buffer, or
    that registered VRAM other than a transfer buffer, also once that registration is gone."""
    fake = FakeCudaLib(devices=1, granularity=4096)
    driver = cudavmm.Driver(fake)
    fabric = FakeFabric()
    a, b = FakeAgent("a", fabric, cuda=fake), FakeAgent("b", fabric, cuda=fake)
    size = 2 << 20
    source, free_source = _device_bytes(driver, "cudaMalloc", size, device=0)
    vmm, free_vmm = _device_bytes(driver, "vmm", size, device=0)
    legacy, free_legacy = _device_bytes(driver, "cudaMalloc", size, device=0)
    handle = cudavmm.export_allocation(legacy.data_ptr(), driver).ipc_handle
    assert handle is not None
    opened = cudavmm.open_ipc(handle, size, 0, driver)
    with pytest.raises(Exception, match="NIXL_ERR_BACKEND"):
        b.register(opened.address, size, VRAM, 0)
    a.register(source.data_ptr(), size, VRAM, 0)
    vmm_registration = b.register(vmm.data_ptr(), size, VRAM, 0)
    b.register(legacy.data_ptr(), size, VRAM, 0)
    assert a.vram_registered == a.vram_registrations() == {"cudaMalloc": 1}
    assert b.vram_registered == b.vram_registrations() == {"vmm": 1, "cudaMalloc": 1}
    a.add_remote(b.metadata())
    source.fill_(7)
    timings: dict[str, float] = {}
    for name, target in (("vmm", vmm), ("cudaMalloc", legacy)):
        row = np.array([[source.data_ptr(), size, 0]], dtype=np.uint64)
        far = np.array([[target.data_ptr(), size, 0]], dtype=np.uint64)
        start = time.monotonic()
        xfer = a.post_write_descs(row, VRAM, far, VRAM, "b", b"")
        while a.check(xfer).value == "PROC":
            time.sleep(0.0005)
        timings[name] = time.monotonic() - start
        assert torch.equal(target, source)
    assert timings["vmm"] >= size / HOST_SPEED_BPS
    assert a.host_speed_writes == 1 and a.vram_targets == {"vmm": 1, "cudaMalloc": 1}, "only the VMM target is slow"
    assert a.vram_sources == {"cudaMalloc": 2} and b.vram_sources == {}

    class _Broker:
        def __init__(self, agent: FakeAgent) -> None:
            self.agent = agent

    with pytest.raises(AssertionError, match="VRAM written to"):
        assert_device_rules(_Broker(a))  # type: ignore[arg-type]
    b.deregister(vmm_registration)  # as a broker would when its engine goes, before the teardown check
    assert b.vram_registrations() == {"cudaMalloc": 1} and b.vram_registered == {"vmm": 1, "cudaMalloc": 1}
    with pytest.raises(AssertionError, match="VRAM registered with NIXL"):
        assert_device_rules(_Broker(b))  # type: ignore[arg-type]
    opened.release()
    for free in (free_source, free_vmm, free_legacy):
        free()
    a.close()
    b.close()
    assert fake.leaks() == []


@pytest.mark.parametrize("allocator", ["cudaMalloc", "vmm"])
def test_kv_the_engine_allocated_on_its_gpu_moves_from_where_it_lies(fake_brokers, make_engine, allocator: str) -> None:  # type: ignore[no-untyped-def]
    """Regression (on an H100: NIXL_ERR_BACKEND registering the IPC-opened pointer): the prefill
    engine's own device allocation (cudaMalloc: a CUDA IPC handle; VMM: an fd) holds its K and V at
    offsets the broker learns from the pointers; nothing is copied at registration and nothing of it
    is registered with NIXL; the pages move byte-exact, the aux row (host memory) with them, and the
    broker lets go of the allocation when the engine goes."""
    fake = FakeCudaLib(devices=2, granularity=4096)
    p, d = _vram_brokers(fake_brokers, fake)
    driver = cudavmm.Driver(fake)
    raw, free = _device_bytes(driver, allocator, 8192)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
    pages, page = 8, 4 * 2 * 8 * 2  # SMALL_MODEL: 4 tokens x 2 heads x 8 dims x fp16
    kv = {layer: [raw[(2 * layer + i) * pages * page : (2 * layer + i + 1) * pages * page].view(torch.float16).view(pages, 4, 2, 8) for i in range(2)] for layer in range(2)}
    aux = torch.arange(4 * 16, dtype=torch.uint8).view(4, 16)
    rank = RankSpec(group="prefill-group", role="prefill")
    memory = EngineMemory.adopt(rank, SMALL_MODEL, kv=kv, aux=[aux], cuda_driver=driver)
    assert kv[1][1].data_ptr() == raw.data_ptr() + 3 * pages * page, "not moved"
    (vram, vram_spec), (_, dram_spec) = memory.buffers
    assert vram_spec.kind == VRAM and vram_spec.device_uuid == fake.uuid_of(1)
    assert dram_spec.kind == DRAM
    assert (len(vram_spec.cuda_ipc_handle) == 64 and vram == -1) if allocator == "cudaMalloc" else (not vram_spec.cuda_ipc_handle and vram >= 0)
    de = make_engine(d.address, "decode")
    with BrokerClient(p.address) as client:
        engine = client.register_engine(rank, memory)
        [registered] = p.loop.call(lambda: p.broker.queries.engines())
        assert [(b.kind, b.device_id) for b in registered.buffers] == [(VRAM, 1), (DRAM, 0)]
        de.handle.receiver(70, SenderRef(p.address, "prefill-group")).init([5, 6, 7], aux_row=2)
        sender = engine.sender(70)
        sender.init(3, aux_row=1)
        sender.send([0, 3, 7])
        assert de.handle.wait([70], timeout_seconds=10)[70].state == common_pb2.ROOM_STATE_SUCCESS
        for layer in range(2):
            for got, sent in zip(de.memory.kv_tensors(layer), kv[layer]):
                assert torch.equal(got[[5, 6, 7]].view(torch.uint8), sent[[0, 3, 7]].view(torch.uint8))
        assert bytes(de.memory.aux[0][2]) == bytes(aux[1])
        assert p.broker.queries.counters.transfers_packed == 1, "the KV packed, the aux row (host memory) directly"
        assert_device_rules(p)
        engine.close()
    assert "cuIpcOpenMemHandle_v2" in fake.calls if allocator == "cudaMalloc" else "cuMemImportFromShareableHandle" in fake.calls
    memory.close()
    free()
    assert _leaks_once_stopped(fake, p) == [], "the broker let go of the engine's allocation"


# -- failures ---------------------------------------------------------------------------


def test_an_abort_while_packed_parts_are_in_flight_gives_every_slot_back(fake_brokers) -> None:  # type: ignore[no-untyped-def]
    """The write of a packed part hangs; the decode engine aborts: both sides fail, the receiver's
    pages settle only once the write is cancelled (the transfer timeout), and every reservation in
    both brokers' transfer buffers comes back; the per-page outcome lists nothing that did not land."""
    fake = FakeCudaLib(devices=2, granularity=4096)
    p, d = _vram_brokers(fake_brokers, fake, transfer_timeout_seconds=1.0)
    pe_rank, de_rank = RankSpec(group="prefill-group", role="prefill"), RankSpec(group="decode-group", role="decode")
    memories = {}
    handles = {}
    clients = []
    for broker, rank in ((p, pe_rank), (d, de_rank)):
        memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=16, aux_rows=4, aux_row_bytes=[16])
        if rank.role == "prefill":
            for layer in range(SMALL_MODEL.num_layers):
                for tensor in memory.kv_tensors(layer):
                    tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape, dtype=torch.uint8))
        as_fake_vram(memory, fake, device=0)
        client = BrokerClient(broker.address)
        clients.append(client)
        memories[rank.role] = memory
        handles[rank.role] = client.register_engine(rank, memory)
    receiver = handles["decode"].receiver(80, SenderRef(p.address, "prefill-group"))
    receiver.init([1, 2, 3, 4], aux_row=0)
    sender = handles["prefill"].sender(80)
    sender.init(4, aux_row=1)
    sender.send([4, 5])

    def chunks_landed() -> list[int]:
        return [r.chunks for r in d.broker.queries.rooms.receivers_of(80)]

    eventually(lambda: d.loop.call(chunks_landed) == [1], 10)
    p.agent.script(XferScript(outcome="HANG"))
    sender.send([6, 7])
    eventually(lambda: p.loop.call(lambda: p.broker.queries.traffic.inflight()) == 1, 10)
    receiver.abort("decode preempted")
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED
    eventually(lambda: receiver.status().pages_settled, 10)
    assert receiver.landed_pages().tolist() == [1, 2], "the first chunk landed whole, the second never"
    for layer in range(SMALL_MODEL.num_layers):
        for a, b in zip(page_bytes(memories["prefill"], layer, [4, 5]), page_bytes(memories["decode"], layer, [1, 2])):
            assert torch.equal(a, b)
    assert sender.wait(10).state == RoomState.FAILED
    for broker in (p, d):
        eventually(lambda b=broker: b.loop.call(lambda: (b.broker.queries.traffic.staging_in_use("send"), b.broker.queries.traffic.staging_in_use("receive"))) == (0, 0), 10)
        assert_device_rules(broker)
    for handle in handles.values():
        handle.close()
    for client in clients:
        client.close()
    for memory in memories.values():
        memory.close()
    assert _leaks_once_stopped(fake, p, d) == []


def test_a_page_larger_than_a_transfer_slot_fails_the_room_by_name(fake_brokers, make_engine) -> None:  # type: ignore[no-untyped-def]
    """One page of every layer must fit a packed part: otherwise the room fails (MISMATCH) naming
    the flag to raise, and nothing is posted."""
    fake = FakeCudaLib(devices=2, granularity=4096)
    p, d = _vram_brokers(fake_brokers, fake, device_part_bytes=64)
    rank = RankSpec(group="prefill-group", role="prefill")
    memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8, aux_rows=4, aux_row_bytes=[16])
    as_fake_vram(memory, fake)
    de = make_engine(d.address, "decode")
    with BrokerClient(p.address) as client:
        engine = client.register_engine(rank, memory)
        receiver = de.handle.receiver(90, SenderRef(p.address, "prefill-group"))
        receiver.init([0, 1], aux_row=0)
        sender = engine.sender(90)
        sender.init(2, aux_row=0)
        sender.send([2, 3])
        status = sender.wait(10)
        assert status.state == RoomState.FAILED and "--device-part-mib" in status.cause.message
        assert receiver.wait(10).state == RoomState.FAILED
        assert p.broker.queries.counters.transfers_packed == 0
        engine.close()
    memory.close()


@pytest.mark.parametrize(
    ("why", "message"),
    [
        pytest.param(
            "no driver",
            "libcuda.so.1",
            marks=pytest.mark.skipif(cudavmm.driver_present(), reason="this host has a CUDA driver"),
        ),
        ("no room for the transfer buffers", "transfer buffers on GPU 0.*OUT_OF_MEMORY"),
    ],
)
def test_a_broker_that_cannot_serve_vram_refuses_the_engine_and_keeps_nothing(fake_brokers, why: str, message: str) -> None:  # type: ignore[no-untyped-def]
    """A broker without the CUDA driver, or that cannot make transfer buffers on the engine's GPU
    (without them nothing of the engine's VRAM could move), refuses the registration by name
    (FAILED_PRECONDITION): no engine, no registration but the host staging buffers, no fd left."""
    fake = FakeCudaLib(devices=1, granularity=4096)
    p = fake_brokers("p", cuda=None if why == "no driver" else fake)
    if why != "no driver":
        fake.fail["cuMemAlloc_v2"] = 2  # CUDA_ERROR_OUT_OF_MEMORY
    rank = RankSpec(group="g", role="prefill")
    memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8)
    as_fake_vram(memory, fake)
    with BrokerClient(p.address) as client:
        with pytest.raises(FailedPrecondition, match=message) as info:
            client.register_engine(rank, memory)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert p.loop.call(lambda: len(p.broker.queries.engines())) == 0
    assert p.agent.registrations == 2, "only the host staging buffers"
    memory.close()
    assert fake.leaks() == []


@pytest.mark.skipif(cudavmm.driver_present(), reason="this host has a CUDA driver")
def test_engine_memory_on_a_cuda_device_needs_cuda() -> None:
    """Engine memory on a CUDA device, on a host without a CUDA driver, is FAILED_PRECONDITION: no CUDA device."""
    rank = RankSpec(group="g", role="prefill")
    with pytest.raises(FailedPrecondition, match="no CUDA device"):
        EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8, device="cuda:0")


def test_engine_memory_lives_on_the_host_or_a_cuda_device() -> None:
    """Engine memory on a device that is neither the host nor CUDA (meta) is INVALID_ARGUMENT."""
    rank = RankSpec(group="g", role="prefill")
    with pytest.raises(InvalidArgument, match="host"):
        EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8, device="meta")


def test_device_memory_that_cannot_be_exported_is_refused_by_name() -> None:
    """A VMM allocation made without the POSIX-fd handle type, and a pointer in no device allocation."""
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


def test_a_cuda_ipc_buffer_larger_than_its_allocation_is_refused(fake_brokers) -> None:  # type: ignore[no-untyped-def]
    """The broker checks the opened allocation's size against the buffer's claim, and closes it."""
    fake = FakeCudaLib(devices=2, granularity=4096)
    p, _ = _vram_brokers(fake_brokers, fake)
    driver = cudavmm.Driver(fake)
    raw, free = _device_bytes(driver, "cudaMalloc", 4096)
    kv = {layer: [raw[i * 1024 : (i + 1) * 1024].view(torch.float16).view(8, 4, 2, 8) for i in (2 * layer, 2 * layer + 1)] for layer in range(2)}
    rank = RankSpec(group="g", role="prefill")
    memory = EngineMemory.adopt(rank, SMALL_MODEL, kv=kv, cuda_driver=driver)
    memory.buffers[0][1].size_bytes = 8192
    memory.layout.regions[0].length_bytes = 1024  # the layout still fits the claimed size
    with BrokerClient(p.address) as client:
        with pytest.raises(InvalidArgument, match="holds 4096"):
            client.register_engine(rank, memory)
    assert p.loop.call(lambda: len(p.broker.queries.engines())) == 0
    memory.close()
    free()
    assert fake.leaks() == []


def test_many_parts_in_flight_through_small_transfer_buffers_never_deadlock(fake_brokers) -> None:  # type: ignore[no-untyped-def]
    """Regression: 64 packed parts at once through buffers of 8 slots each side. When a part asked for
    its receive slot and its send slot at the same time, parts holding receive slots waited for send
    slots held by parts waiting for receive slots, and every room failed after the staging wait."""
    fake = FakeCudaLib(devices=2, granularity=4096)
    p, d = _vram_brokers(
        fake_brokers,
        fake,
        device_send_bytes=512 << 10,
        device_receive_bytes=512 << 10,
        device_part_bytes=64 << 10,
        staging_wait_seconds=3.0,
    )

    def prepare(memory: EngineMemory, spec: RankSpec) -> None:
        as_fake_vram(memory, fake, device=0)

    scenario = Scenario(rooms=32, pages=8, chunks=2, layers=4, kv_heads=8, head_dim=64, page_size=8)
    result = run_scenario(p.address, d.address, scenario, timeout_seconds=60, prepare=prepare)
    assert result.ok, "\n".join(result.problems[:5])
    assert p.broker.queries.counters.transfers_packed >= 64
    for broker in (p, d):
        assert_device_rules(broker)

"""Memory the engine already has: its own CPU KV tensors, moved into shareable memory in place,
registered, and moved byte-exact between two brokers."""

from __future__ import annotations

import fcntl

import numpy as np
import pytest
import torch

from kvbroker import errors
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef, StateTensors

from .conftest import SMALL_MODEL

HEADS, PAGES = SMALL_MODEL.total_kv_heads, 16


def _engine_kv(seed: int) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:
    """KV as an engine might allocate it: one flat allocation, a K and a V view per layer
    (SGLang's token-major [tokens, heads, head_dim] buffers), filled with values."""
    per = PAGES * SMALL_MODEL.page_size * HEADS * SMALL_MODEL.head_dim
    flat = torch.randn(SMALL_MODEL.num_layers * 2 * per, generator=torch.Generator().manual_seed(seed)).to(SMALL_MODEL.dtype)
    views = flat.view(SMALL_MODEL.num_layers, 2, PAGES * SMALL_MODEL.page_size, HEADS, SMALL_MODEL.head_dim)
    kv = {layer: [views[layer, 0], views[layer, 1]] for layer in range(SMALL_MODEL.num_layers)}
    return flat, kv


def test_the_engines_tensors_move_into_a_sealed_memfd_in_place() -> None:
    """Each tensor object keeps its identity, shape and contents and now lives in a sealed memfd the
    broker can map; writes through the tensor land in that memory."""
    flat, kv = _engine_kv(1)
    before = {layer: [t.clone() for t in ts] for layer, ts in kv.items()}
    objects = [id(t) for ts in kv.values() for t in ts]
    aux = torch.arange(4 * 16, dtype=torch.uint8).view(4, 16)
    memory = EngineMemory.adopt(RankSpec("g", "decode"), SMALL_MODEL, kv=kv, aux=[aux])
    try:
        assert [id(t) for ts in kv.values() for t in ts] == objects
        for layer, ts in kv.items():
            for now, then in zip(ts, before[layer]):
                assert torch.equal(now, then) and now.untyped_storage().is_shared()
        assert flat.untyped_storage().is_shared()  # the views' base moved with them
        assert len(memory.buffers) == 2  # the KV allocation and the aux tensor
        fd, spec = memory.buffers[0]
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK and spec.size_bytes % 4096 == 0
        kv[1][0][5, 1, 3] = 7.0  # the engine computes into its tensor...
        k1 = memory.layout.regions[2]
        assert (k1.layer_id, k1.kind) == (1, 1) and k1.item_bytes == SMALL_MODEL.page_size * HEADS * SMALL_MODEL.head_dim * 2
        mirror = np.memmap(f"/proc/self/fd/{fd}", dtype=np.float16, mode="r")  # ...and the shared memory has it
        index = k1.offset_bytes // 2 + (5 * HEADS + 1) * SMALL_MODEL.head_dim + 3
        assert mirror[index] == 7.0
        assert torch.equal(memory.aux[0], aux)
    finally:
        memory.close()


def test_other_views_of_the_memory_are_refused_before_anything_moves() -> None:
    """A tensor the engine keeps but did not pass would stay behind on the old memory: refused, naming it."""
    flat, kv = _engine_kv(2)
    kept = flat[:100]  # e.g. a scratch view the engine keeps of its KV allocation
    with pytest.raises(errors.InvalidArgument, match="1 more tensor"):
        EngineMemory.adopt(RankSpec("g", "decode"), SMALL_MODEL, kv=kv)
    assert not flat.untyped_storage().is_shared() and kept.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ({0: [torch.zeros(64, 2, 8, dtype=torch.float16)]}, "give"),
        ({0: [torch.zeros(64, 2, 8, dtype=torch.float32)] * 2, 1: [torch.zeros(64, 2, 8, dtype=torch.float32)] * 2}, "dtype"),
        ({layer: [torch.zeros(8, 64, 2, dtype=torch.float16).transpose(0, 1)] * 2 for layer in (0, 1)}, "not contiguous"),
        ({layer: [torch.zeros(63, 2, 8, dtype=torch.float16)] * 2 for layer in (0, 1)}, "whole pages"),
    ],
    ids=["one-tensor", "dtype", "strided", "partial-page"],
)
def test_tensors_the_broker_cannot_address_are_refused(kv: dict[int, list[torch.Tensor]], message: str) -> None:
    """KV tensors the broker cannot address are INVALID_ARGUMENT, by what is wrong: too few tensors for the layers,
    a dtype other than the model's, a strided view, part of a page."""
    with pytest.raises(errors.InvalidArgument, match=message):
        EngineMemory.adopt(RankSpec("g", "decode"), SMALL_MODEL, kv=kv)


def _vllm_cpu_kv(seed: int) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:
    """KV as vLLM's CPU worker allocates it: one flat int8 allocation, one view per layer of
    [num_blocks, heads, block_size, 2 * head_dim] (per head, the block's keys, then its values)."""
    shape = (PAGES, HEADS, SMALL_MODEL.page_size, 2 * SMALL_MODEL.head_dim)
    per = int(np.prod(shape)) * 2
    flat = torch.randint(-128, 128, (SMALL_MODEL.num_layers * per,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    kv = {layer: [flat[layer * per : (layer + 1) * per].view(SMALL_MODEL.dtype).view(shape)] for layer in range(SMALL_MODEL.num_layers)}
    return flat, kv


def _block(tensor: torch.Tensor, layout: str, page: int) -> torch.Tensor:
    """The bytes of one page of one KV tensor, whatever its layout (random bytes hold NaNs:
    compare bytes, not values)."""
    ps = SMALL_MODEL.page_size
    return (tensor[page] if layout == "hnd_fused" else tensor[page * ps : (page + 1) * ps]).contiguous().view(torch.uint8)


@pytest.mark.nixl
@pytest.mark.parametrize("layout", ["nhd", "hnd_fused"])
def test_adopted_memory_moves_byte_exact_between_two_broker_processes(tmp_path, layout: str) -> None:
    """Real NIXL between two `kvbroker serve` processes: both engines' own KV tensors, adopted:
    SGLang-shaped K and V buffers, or vLLM's CPU cache (one fused tensor per layer)."""
    from dataclasses import replace

    from kvbroker.testing import BrokerProcess

    model = replace(SMALL_MODEL, kv_layout=layout)
    brokers = BrokerProcess.start_many(["prefill", "decode"], tmp_path, ["--log-level", "warning"])
    memories, clients = [], []
    try:
        engines = []
        for broker, role, seed in ((brokers[0], "prefill", 3), (brokers[1], "decode", 4)):
            flat, kv = _vllm_cpu_kv(seed) if layout == "hnd_fused" else _engine_kv(seed)
            del flat
            aux = torch.full((4, 16), seed, dtype=torch.uint8)
            memory = EngineMemory.adopt(RankSpec(f"{role}-adopted", role), model, kv=kv, aux=[aux])  # type: ignore[arg-type]
            client = BrokerClient(broker.address)
            memories.append((memory, kv, aux))
            clients.append(client)
            engines.append(client.register_engine(RankSpec(f"{role}-adopted", role), memory))  # type: ignore[arg-type]
        pe, de = engines
        src, dst = np.array([1, 2, 9], dtype=np.int32), np.array([7, 0, 12], dtype=np.int32)
        receiver = de.receiver(1, SenderRef(brokers[0].address, "prefill-adopted"))
        receiver.init(dst, aux_row=3)
        sender = pe.sender(1)
        sender.init(3, aux_row=0)
        sender.send(src)
        assert receiver.wait(20).state == RoomState.SUCCESS
        (pm, pkv, paux), (dm, dkv, daux) = memories
        for layer in range(SMALL_MODEL.num_layers):
            for a, b in zip(pkv[layer], dkv[layer]):
                for s, d in zip(src, dst):
                    assert torch.equal(_block(a, layout, s), _block(b, layout, d)), f"layer {layer}"
        assert torch.equal(daux[3], paux[0])
        for engine in engines:
            engine.close()
    finally:
        for client in clients:
            client.close()
        for memory, _, _ in memories:
            memory.close()
        for broker in brokers:
            broker.stop()


def _engine_state(seed: int) -> dict[str, StateTensors]:
    """Mamba-like state as an engine holds it: per layer a conv and an SSM tensor of different item
    sizes, one item per request slot (8 slots)."""
    gen = torch.Generator().manual_seed(seed)
    layers = {layer: [torch.randn(8, 3, 16, generator=gen), torch.randn(8, 2, 4, 8, generator=gen).to(torch.bfloat16)] for layer in range(2)}
    return {"mamba": StateTensors("mamba", layers)}


def test_adopted_state_moves_by_slot_with_the_kv(fake_brokers) -> None:
    """Hybrid-model state the engine allocated itself: adopted in place beside its KV, and the
    slots a room names move with its last chunk, byte-exact."""
    p, d = fake_brokers("p"), fake_brokers("d")
    memories, clients, engines, states = [], [], [], []
    try:
        for broker, role, seed in ((p, "prefill", 5), (d, "decode", 6)):
            _, kv = _engine_kv(seed)
            state = _engine_state(seed)
            objects = [id(t) for ts in state["mamba"].layers.values() for t in ts]
            memory = EngineMemory.adopt(RankSpec(f"{role}-s", role), SMALL_MODEL, kv=kv, aux=[torch.zeros(4, 16, dtype=torch.uint8)], state=state)  # type: ignore[arg-type]
            assert [id(t) for ts in state["mamba"].layers.values() for t in ts] == objects
            assert all(t.untyped_storage().is_shared() for ts in state["mamba"].layers.values() for t in ts)
            regions = [r for r in memory.layout.regions if r.kind == 8 or r.component]
            assert [(r.layer_id, r.item_bytes) for r in regions] == [(0, 3 * 16 * 4), (0, 2 * 4 * 8 * 2), (1, 192), (1, 128)]
            client = BrokerClient(broker.address)
            memories.append(memory)
            clients.append(client)
            states.append(state)
            engines.append(client.register_engine(RankSpec(f"{role}-s", role), memory))  # type: ignore[arg-type]
        pe, de = engines
        receiver = de.receiver(3, SenderRef(p.address, "prefill-s"))
        receiver.init([4, 5], aux_row=1, state={"mamba": [6]})
        sender = pe.sender(3)
        sender.init(2, aux_row=0)
        sender.send([0, 1], state={"mamba": [2]})
        assert receiver.wait(10).state == RoomState.SUCCESS
        sent, got = states[0]["mamba"].layers, states[1]["mamba"].layers
        for layer in range(2):
            for a, b in zip(sent[layer], got[layer]):
                assert torch.equal(a[2].view(torch.uint8), b[6].view(torch.uint8))
                assert not torch.equal(a[3].view(torch.uint8), b[3].view(torch.uint8)), "only the named slot"
        for engine in engines:
            engine.close()
    finally:
        for client in clients:
            client.close()
        for memory in memories:
            memory.close()


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"m": StateTensors("mamba", {})}, "at least one layer"),
        ({"m": StateTensors("mamba", {7: [torch.zeros(4, 2)]})}, "outside this rank's layers"),
        ({"m": StateTensors("mamba", {0: [torch.zeros(4, 2)], 1: []})}, "same number of tensors"),
        ({"m": StateTensors("mamba", {0: [torch.zeros(4, 2), torch.zeros(5, 2)]})}, "5 items, other tensors have 4"),
        ({"m": StateTensors("rnn", {0: [torch.zeros(4, 2)]})}, "type must be"),
    ],
    ids=["no-layers", "outside", "uneven", "items", "type"],
)
def test_state_the_broker_cannot_address_is_refused(state: dict[str, StateTensors], message: str) -> None:
    """State tensors adopt refuses by name: no layers, a layer outside the rank's, uneven tensor counts or item
    counts, an unknown type."""
    _, kv = _engine_kv(9)
    with pytest.raises(errors.InvalidArgument, match=message):
        EngineMemory.adopt(RankSpec("g", "prefill"), SMALL_MODEL, kv=kv, state=state)

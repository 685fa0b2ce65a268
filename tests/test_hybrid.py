"""A hybrid model (Mamba-like layers between attention layers): KV only on the attention layers
(``ModelSpec.kv_layers``, ``EngineLayout.kv_layers``), state on the others, moved byte-exact
between equal and different tp sizes; two sides that disagree on which layers hold KV fail by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kvbroker import errors
from kvbroker.client import EngineMemory, RankSpec, RoomState, SenderRef, StateSpec
from kvbroker.plan import Layout, rank_key

from .conftest import SMALL_MODEL, page_bytes
from .test_service import _wait_tables_empty

# Every test with engines runs on host memory and on the device path (fake VRAM).
MEMORY_KINDS = ("dram", "vram")

HYBRID = dataclasses.replace(SMALL_MODEL, num_layers=4, kv_layers=(1, 3))
MAMBA = (StateSpec("mamba", "mamba", item_bytes=96, num_items=6, num_regions=2, layers=(0, 2)),)
SRC, DST = np.array([0, 2, 5], dtype=np.int32), np.array([1, 3, 4], dtype=np.int32)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_kv_on_attention_layers_and_state_on_the_others_move_byte_exact(fake_brokers, make_engine, tp: int) -> None:
    """Equal tp (hybrid state moves between equal tp sizes only): each decode rank gets its
    prefill rank's pages of the attention layers and its state slot of the others."""
    p, d = fake_brokers("p"), fake_brokers("d")
    pes = [make_engine(p.address, "prefill", model=HYBRID, state=MAMBA, tp_size=tp, tp_rank=r, seed=r + 1) for r in range(tp)]
    des = [make_engine(d.address, "decode", model=HYBRID, state=MAMBA, tp_size=tp, tp_rank=r) for r in range(tp)]
    assert sorted({r.layer_id for r in des[0].memory.layout.regions if r.kind in (1, 2)}) == [1, 3]
    assert list(des[0].memory.layout.kv_layers) == [1, 3]
    receivers = [de.handle.receiver(11, SenderRef(p.address, "prefill-group")) for de in des]
    for receiver in receivers:
        receiver.init(DST, aux_row=2, state={"mamba": [4]})
    for pe in pes:
        sender = pe.handle.sender(11)
        sender.init(len(SRC), aux_row=1)
        sender.send(SRC, state={"mamba": [3]})
    for receiver in receivers:
        assert receiver.wait(10).state == RoomState.SUCCESS
    for pe, de in zip(pes, des):
        for layer in (1, 3):
            for a, b in zip(page_bytes(pe.memory, layer, SRC), page_bytes(de.memory, layer, DST)):
                assert torch.equal(a, b), f"layer {layer}"
        for a, b in zip(pe.memory.state["mamba"], de.memory.state["mamba"]):
            assert torch.equal(a[3], b[4])
    _wait_tables_empty(p, d)


def test_head_slices_of_the_attention_layers_between_tp_sizes(fake_brokers, make_engine) -> None:
    """KV only (no state) of a hybrid model, prefill tp 2 -> decode tp 1: each prefill rank's
    heads of each attention layer land in the decode's pages."""
    p, d = fake_brokers("p"), fake_brokers("d")
    pes = [make_engine(p.address, "prefill", model=HYBRID, tp_size=2, tp_rank=r, seed=r + 1) for r in range(2)]
    de = make_engine(d.address, "decode", model=HYBRID)
    receiver = de.handle.receiver(13, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    for pe in pes:
        sender = pe.handle.sender(13)
        sender.init(len(SRC), aux_row=1)
        sender.send(SRC)
    assert receiver.wait(10).state == RoomState.SUCCESS
    heads = SMALL_MODEL.total_kv_heads // 2
    for layer in (1, 3):
        for kind, got in enumerate(page_bytes(de.memory, layer, DST)):
            tokens = got.view(len(DST), SMALL_MODEL.page_size, SMALL_MODEL.total_kv_heads, -1)
            for r, pe in enumerate(pes):
                sent = page_bytes(pe.memory, layer, SRC)[kind].view(len(SRC), SMALL_MODEL.page_size, heads, -1)
                assert torch.equal(tokens[:, :, r * heads : (r + 1) * heads], sent), f"layer {layer} rank {r}"
    _wait_tables_empty(p, d)


def test_sides_that_hold_kv_on_different_layers_fail_by_name(fake_brokers, make_engine) -> None:
    """A hybrid room whose two sides hold KV on different layers fails on the decode side, naming both sets of
    layers."""
    p, d = fake_brokers("p"), fake_brokers("d")
    pe = make_engine(p.address, "prefill", model=HYBRID, state=MAMBA)
    de = make_engine(d.address, "decode", model=dataclasses.replace(HYBRID, kv_layers=(0, 1, 2, 3)), state=MAMBA)
    receiver = de.handle.receiver(12, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2, state={"mamba": [4]})
    sender = pe.handle.sender(12)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC, state={"mamba": [3]})
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED
    assert "KV on layers [1, 3]" in status.cause.message and "[0, 1, 2, 3]" in status.cause.message, status.cause.message
    _wait_tables_empty(p, d)


def test_layouts_with_kv_where_kv_layers_says_none_are_refused() -> None:
    """A layout whose kv_layers miss a KV region, name a layer without KV, or do not increase is INVALID_ARGUMENT, by
    name."""
    rank = RankSpec("g", "prefill")
    memory = EngineMemory.allocate(rank, HYBRID, num_pages=4, state=MAMBA)
    try:
        key, sizes = rank_key(rank.to_proto()), memory.buffer_sizes()
        Layout.from_proto(memory.layout, rank=key, buffer_sizes=sizes)  # as allocated: fine
        for kv_layers, message in (([0, 1, 3], "KV regions missing"), ([3], "holds no KV"), ([3, 1], "must increase"), ([1, 7], "must increase")):
            layout = type(memory.layout)()
            layout.CopyFrom(memory.layout)
            del layout.kv_layers[:]
            layout.kv_layers.extend(kv_layers)
            with pytest.raises(errors.InvalidArgument, match=message):
                Layout.from_proto(layout, rank=key, buffer_sizes=sizes)
    finally:
        memory.close()

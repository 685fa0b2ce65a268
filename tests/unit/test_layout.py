"""Layout validation: ``kvbroker.plan.Layout.from_proto``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvbroker.errors import InvalidArgument
from kvbroker.plan import Layout, RankKey, rank_key
from kvbroker.v1 import common_pb2

K = common_pb2.REGION_KIND_KEY
V = common_pb2.REGION_KIND_VALUE
MLA = common_pb2.REGION_KIND_MLA
AUX = common_pb2.REGION_KIND_AUX
STATE = common_pb2.REGION_KIND_STATE

Builder = Callable[..., Any]


def _reject(built: Any, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        built.build()


def _first(proto: common_pb2.EngineLayout, kind: int) -> common_pb2.Region:
    return next(r for r in proto.regions if r.kind == kind)


# -- valid layouts -----------------------------------------------------------


def test_valid_mha_layout(layout_proto: Builder) -> None:
    """A valid MHA layout reports pages, aux rows, KV region map and page bytes."""
    built = layout_proto(
        num_layers=4, num_pages=16, aux_rows=4, aux_row_bytes=(16, 32), page_size=4, head_dim=8
    )
    layout = built.build()
    assert layout.num_pages == 16
    assert layout.aux_rows == 4
    # 8 heads on tp 1, page 4 tokens, head_dim 8, float16.
    assert layout.kv_page_bytes == 4 * 8 * 8 * 2 == built.page_bytes
    assert layout.kv_kinds() == (K, V)
    assert layout.kv_regions == {
        (K, 0): 0,
        (V, 0): 1,
        (K, 1): 2,
        (V, 1): 3,
        (K, 2): 4,
        (V, 2): 5,
        (K, 3): 6,
        (V, 3): 7,
    }
    assert layout.aux_regions == (8, 9)
    assert [layout.regions[i].items for i in layout.aux_regions] == [4, 4]
    assert layout.state_components == {}
    assert layout.pp_layer_begins == (0,)
    assert layout.layer_range_of_pp_rank(0) == (0, 4)
    for (kind, layer), index in layout.kv_regions.items():
        region = layout.regions[index]
        assert (region.kind, region.layer_id, region.index) == (kind, layer, index)
        assert region.items == 16


def test_valid_mla_layout(layout_proto: Builder) -> None:
    """A valid MLA layout has one MLA region per layer and one latent head."""
    built = layout_proto(
        mla=True, num_layers=3, num_pages=10, head_dim=576, dtype="bfloat16", page_size=2
    )
    layout = built.build()
    assert layout.mla
    assert layout.kv_kinds() == (MLA,)
    assert layout.kv_regions == {(MLA, 0): 0, (MLA, 1): 1, (MLA, 2): 2}
    assert layout.num_pages == 10
    assert layout.kv_page_bytes == 2 * 1 * 576 * 2
    assert layout.aux_rows == 4


def test_valid_gqa_tp_layout(layout_proto: Builder) -> None:
    """GQA with fewer heads than ranks: each rank holds one (replicated) head."""
    layout = layout_proto(total_kv_heads=2, tp_size=4, tp_rank=3).build()
    assert layout.kv_heads_per_rank == 1
    assert layout.kv_page_bytes == 4 * 1 * 8 * 2


def test_valid_pp_layout(layout_proto: Builder) -> None:
    """A pp rank's layout holds only its layers and knows every pp rank's range."""
    layout = layout_proto(num_layers=5, pp_size=3, pp_rank=1, pp_layer_begins=(0, 2, 4)).build()
    assert (layout.layer_begin, layout.layer_end) == (2, 4)
    assert set(layout.kv_regions) == {(K, 2), (V, 2), (K, 3), (V, 3)}
    assert [layout.layer_range_of_pp_rank(p) for p in range(3)] == [(0, 2), (2, 4), (4, 5)]


def test_layout_without_kv_or_aux(layout_proto: Builder) -> None:
    """A layout with no KV and no aux regions reports zero pages and rows."""
    built = layout_proto(aux_row_bytes=())
    del built.proto.regions[:]
    layout = built.build()
    assert (layout.num_pages, layout.aux_rows, layout.kv_regions, layout.aux_regions) == (
        0,
        0,
        {},
        (),
    )


def test_valid_state_components(layout_proto: Builder, state_spec: Any) -> None:
    """State regions are grouped by component in listed order with their item count."""
    built = layout_proto(
        state=(
            state_spec("mamba", common_pb2.STATE_TYPE_MAMBA, items=3, item_bytes=128, regions=2),
            state_spec("swa", common_pb2.STATE_TYPE_SWA, items=7, item_bytes=32, regions=1),
        )
    )
    layout = built.build()
    first_state = 2 * 4 + 2
    assert layout.state_components == {
        "mamba": (common_pb2.STATE_TYPE_MAMBA, (first_state, first_state + 1)),
        "swa": (common_pb2.STATE_TYPE_SWA, (first_state + 2,)),
    }
    assert layout.state_items == {"mamba": 3, "swa": 7}


@pytest.mark.parametrize(
    "dtype,size", [("float32", 4), ("bfloat16", 2), ("float8_e4m3fn", 1), ("uint8", 1)]
)
def test_dtype_bytes(layout_proto: Builder, dtype: str, size: int) -> None:
    """kv_page_bytes uses the declared dtype's element size."""
    layout = layout_proto(dtype=dtype).build()
    assert layout.dtype_bytes == size
    assert layout.kv_page_bytes == 4 * 8 * 8 * size


# -- regions -----------------------------------------------------------------


def test_region_outside_buffer(layout_proto: Builder) -> None:
    """A region that ends past its buffer's size is rejected."""
    built = layout_proto()
    built.proto.regions[7].offset_bytes += 1  # the last KV region ends at the buffer's end
    _reject(built, rf"region 7: .* lies outside buffer 0 of {built.buffer_sizes[0]} bytes")


def test_region_exactly_fills_buffer_ok(layout_proto: Builder) -> None:
    """A region ending exactly at its buffer's end is accepted."""
    built = layout_proto()
    last_kv = built.proto.regions[7]
    assert last_kv.offset_bytes + last_kv.length_bytes == built.buffer_sizes[0]
    built.build()


def test_buffer_index_out_of_range(layout_proto: Builder) -> None:
    """A region naming a buffer the engine did not upload is rejected."""
    built = layout_proto()
    built.proto.regions[0].buffer = len(built.buffer_sizes)
    _reject(built, rf"region 0: buffer {len(built.buffer_sizes)} does not exist")


def test_length_not_multiple_of_item_bytes(layout_proto: Builder) -> None:
    """A region whose length is not a whole number of items is rejected."""
    built = layout_proto()
    aux = built.proto.regions[8]
    aux.length_bytes = aux.item_bytes * 2 + 1
    _reject(built, r"region 8: length_bytes \d+ is not a multiple of item_bytes")


@pytest.mark.parametrize("field", ["item_bytes", "length_bytes"])
def test_zero_sized_region(layout_proto: Builder, field: str) -> None:
    """Regions with zero item or length bytes are rejected."""
    built = layout_proto()
    setattr(built.proto.regions[0], field, 0)
    _reject(built, "must be positive")


def test_unspecified_region_kind(layout_proto: Builder) -> None:
    """A region without a kind is rejected."""
    built = layout_proto()
    built.proto.regions[2].kind = common_pb2.REGION_KIND_UNSPECIFIED
    _reject(built, "region 2: kind 0 is unspecified")


def test_unknown_region_kind(layout_proto: Builder) -> None:
    """A region whose kind is not a known RegionKind value is rejected."""
    built = layout_proto()
    built.proto.regions[8].kind = 9  # type: ignore[assignment]
    _reject(built, "region 8")


# -- KV regions ---------------------------------------------------------------


@pytest.mark.parametrize("kind,name", [(K, "REGION_KIND_KEY"), (V, "REGION_KIND_VALUE")])
def test_missing_kv_region(layout_proto: Builder, kind: int, name: str) -> None:
    """A layer without its K (or V) region is rejected, naming kind and layer."""
    built = layout_proto()
    index = next(i for i, r in enumerate(built.proto.regions) if r.kind == kind and r.layer_id == 2)
    del built.proto.regions[index]
    _reject(built, rf"KV regions missing: {name}/layer 2")


def test_duplicate_kv_region(layout_proto: Builder) -> None:
    """A second region for the same kind and layer is rejected."""
    built = layout_proto()
    built.proto.regions[2].layer_id = 0  # K of layer 1 now claims layer 0
    _reject(built, "region 2: a second REGION_KIND_KEY region for layer 0")


def test_kv_region_outside_rank_layers(layout_proto: Builder) -> None:
    """A KV region for a layer this pp rank does not hold is rejected."""
    built = layout_proto(num_layers=4, pp_size=2, pp_rank=1, pp_layer_begins=(0, 2))
    built.proto.regions[0].layer_id = 1
    _reject(built, r"region 0: layer 1 is outside this rank's layers \[2, 4\)")


def test_kv_region_past_num_layers(layout_proto: Builder) -> None:
    """A KV region for a layer beyond the model is rejected."""
    built = layout_proto(num_layers=4)
    built.proto.regions[7].layer_id = 4
    _reject(built, r"layer 4 is outside this rank's layers \[0, 4\)")


def test_item_bytes_not_one_page(layout_proto: Builder) -> None:
    """KV item_bytes must equal page_size * heads per rank * head_dim * dtype bytes."""
    built = layout_proto(num_pages=16)
    region = built.proto.regions[1]
    region.item_bytes = built.page_bytes * 2
    region.length_bytes = built.page_bytes * 16
    _reject(
        built,
        rf"region 1: item_bytes {built.page_bytes * 2} is not one page .*= {built.page_bytes}\)",
    )


def test_item_bytes_uses_heads_per_rank(layout_proto: Builder) -> None:
    """Pages sized with the model's total heads (not per rank) are rejected (lesson 3)."""
    built = layout_proto(total_kv_heads=8, tp_size=2)
    wrong = 4 * 8 * 8 * 2  # all 8 heads instead of 4
    kv = [region for region in built.proto.regions if region.kind in (K, V)]
    for i, region in enumerate(kv):
        region.item_bytes = wrong
        region.length_bytes = wrong * 16
        region.offset_bytes = i * wrong * 16
    built.buffer_sizes[0] = wrong * 16 * 8
    _reject(built, "is not one page")


def test_kv_regions_with_different_page_counts(layout_proto: Builder) -> None:
    """Every KV region must hold the same number of pages."""
    built = layout_proto(num_pages=16)
    built.proto.regions[5].length_bytes = built.page_bytes * 15
    _reject(built, r"same number of pages, got \[15, 16\]")


def test_aux_regions_with_different_row_counts(layout_proto: Builder) -> None:
    """Every aux region must hold the same number of rows."""
    built = layout_proto(aux_rows=4, aux_row_bytes=(16, 32))
    built.proto.regions[9].length_bytes = 32 * 3
    _reject(built, r"aux region must hold the same number of rows, got \[3, 4\]")


def test_mla_layout_with_key_regions(layout_proto: Builder) -> None:
    """An MLA layout holding KEY regions is rejected."""
    built = layout_proto(mla=True)
    built.proto.regions[0].kind = K
    _reject(built, "region 0: REGION_KIND_KEY does not belong in an MLA layout")


def test_mha_layout_with_mla_regions(layout_proto: Builder) -> None:
    """An MHA layout holding MLA regions is rejected."""
    built = layout_proto()
    built.proto.regions[1].kind = MLA
    _reject(built, "region 1: REGION_KIND_MLA does not belong in an MHA/GQA layout")


# -- shape fields -------------------------------------------------------------


def test_unknown_dtype(layout_proto: Builder) -> None:
    """A dtype outside DTYPE_BYTES is rejected, naming it."""
    built = layout_proto()
    built.proto.dtype = "float4"
    _reject(built, "unknown dtype 'float4'")


@pytest.mark.parametrize(
    "total,tp,declared,expected",
    [(8, 2, 8, 4), (8, 2, 2, 4), (2, 4, 2, 1), (2, 4, 0, 1), (1, 8, 2, 1)],
    ids=[
        "total-8-tp-2-gave-total",
        "total-8-tp-2-gave-2",
        "gqa-2-tp-4-gave-2",
        "gqa-2-tp-4-gave-0",
        "1-head-tp-8",
    ],
)
def test_kv_heads_per_rank_inconsistent(
    layout_proto: Builder, total: int, tp: int, declared: int, expected: int
) -> None:
    """kv_heads_per_rank must be max(1, total_kv_heads // tp_size)."""
    built = layout_proto(total_kv_heads=total, tp_size=tp)
    built.proto.kv_heads_per_rank = declared
    _reject(
        built,
        rf"kv_heads_per_rank is {declared}, but total_kv_heads {total} over tp_size {tp} gives {expected}",
    )


@pytest.mark.parametrize(
    "total,tp,match",
    [
        (8, 3, "must divide evenly over tp_size 3"),
        (2, 3, "must be a multiple of total_kv_heads 2"),
        (0, 1, "at least 1"),
    ],
)
def test_heads_not_dividing_tp(layout_proto: Builder, total: int, tp: int, match: str) -> None:
    """Head counts that do not split or replicate evenly over tp are rejected."""
    built = layout_proto(tp_size=tp)
    built.proto.total_kv_heads = total
    _reject(built, match)


@pytest.mark.parametrize("total,per_rank", [(2, 1), (1, 2), (8, 8)])
def test_mla_needs_one_head(layout_proto: Builder, total: int, per_rank: int) -> None:
    """An MLA layout must declare total_kv_heads = kv_heads_per_rank = 1."""
    built = layout_proto(mla=True)
    built.proto.total_kv_heads = total
    built.proto.kv_heads_per_rank = per_rank
    _reject(built, "MLA layout has one latent KV head")


@pytest.mark.parametrize("tp_rank,pp_rank", [(2, 0), (5, 0), (0, 1)])
def test_rank_outside_group(layout_proto: Builder, tp_rank: int, pp_rank: int) -> None:
    """tp_rank >= tp_size (or pp_rank >= pp_size) is rejected."""
    built = layout_proto(tp_size=2, total_kv_heads=8)
    built.rank = RankKey("g", tp_rank, pp_rank)
    _reject(built, rf"rank tp{tp_rank}/pp{pp_rank} is outside tp_size 2, pp_size 1")


def test_empty_group(layout_proto: Builder) -> None:
    """A rank with an empty group name is rejected."""
    built = layout_proto()
    built.rank = RankKey("", 0, 0)
    _reject(built, "group must not be empty")


@pytest.mark.parametrize("role", [common_pb2.ROLE_UNSPECIFIED, 7])
def test_bad_role(layout_proto: Builder, role: int) -> None:
    """Only ROLE_PREFILL, ROLE_DECODE and ROLE_BOTH layouts are accepted."""
    built = layout_proto()
    built.proto.role = role  # type: ignore[assignment]
    _reject(built, "role must be ROLE_PREFILL, ROLE_DECODE or ROLE_BOTH")


def test_a_compatibility_longer_than_the_limit_is_refused(layout_proto: Builder) -> None:
    """EngineLayout.compatibility is a digest: 256 characters at most."""
    built = layout_proto()
    built.proto.compatibility = "x" * 257
    _reject(built, "compatibility is 257 characters")


@pytest.mark.parametrize("field", ["tp_size", "pp_size"])
def test_zero_group_size(layout_proto: Builder, field: str) -> None:
    """tp_size or pp_size of 0 is rejected."""
    built = layout_proto()
    setattr(built.proto, field, 0)
    _reject(built, "must be at least 1")


@pytest.mark.parametrize("field", ["page_size_tokens", "head_dim"])
def test_zero_page_or_head_dim(layout_proto: Builder, field: str) -> None:
    """page_size_tokens or head_dim of 0 is rejected."""
    built = layout_proto()
    setattr(built.proto, field, 0)
    _reject(built, "page_size_tokens and head_dim must be at least 1")


@pytest.mark.parametrize("begin,end", [(2, 2), (3, 2), (0, 5)])
def test_bad_layer_range(layout_proto: Builder, begin: int, end: int) -> None:
    """An empty layer range, or one past num_layers, is rejected."""
    built = layout_proto(num_layers=4)
    built.proto.layer_begin, built.proto.layer_end = begin, end
    _reject(built, r"must be non-empty and inside num_layers 4")


# -- pp_layer_begins ----------------------------------------------------------


@pytest.mark.parametrize(
    "begins,match",
    [
        ((1, 2), "must start at 0"),
        ((0, 0), "must start at 0 and increase"),
        ((0, 4), "increase below num_layers"),
        ((0,), "first layer of each of the 2 pp ranks"),
        ((0, 1, 2), "first layer of each of the 2 pp ranks"),
        ((), "first layer of each of the 2 pp ranks"),
    ],
    ids=["not-at-0", "not-increasing", "past-end", "too-short", "too-long", "empty-with-pp-2"],
)
def test_bad_pp_layer_begins(layout_proto: Builder, begins: tuple[int, ...], match: str) -> None:
    """pp_layer_begins must list pp_size increasing starts from 0 below num_layers."""
    built = layout_proto(num_layers=4, pp_size=2, pp_rank=0, pp_layer_begins=(0, 2))
    built.proto.pp_layer_begins[:] = list(begins)
    _reject(built, match)


def test_decreasing_pp_layer_begins(layout_proto: Builder) -> None:
    """pp_layer_begins that go back down are rejected."""
    built = layout_proto(num_layers=6, pp_size=3, pp_rank=0, pp_layer_begins=(0, 2, 4))
    built.proto.pp_layer_begins[:] = [0, 4, 2]
    _reject(built, r"pp_layer_begins \[0, 4, 2\] must start at 0 and increase")


def test_pp_layer_begins_disagree_with_rank_range(layout_proto: Builder) -> None:
    """layer_begin/layer_end must be this pp rank's range in pp_layer_begins."""
    built = layout_proto(num_layers=4, pp_size=2, pp_rank=1, pp_layer_begins=(0, 2))
    built.proto.pp_layer_begins[:] = [0, 1]
    _reject(built, r"layer range \[2, 4\) disagrees with pp_layer_begins for pp rank 1")


def test_pp_layer_begins_for_other_rank(layout_proto: Builder) -> None:
    """A valid pp rank 0 layout used for pp rank 1 disagrees with pp_layer_begins."""
    built = layout_proto(num_layers=4, pp_size=2, pp_rank=0, pp_layer_begins=(0, 2))
    built.rank = RankKey("g", 0, 1)
    _reject(built, "disagrees with pp_layer_begins for pp rank 1")


def test_pp_size_1_needs_whole_model(layout_proto: Builder) -> None:
    """With pp_size 1 and no pp_layer_begins, the rank must hold every layer."""
    built = layout_proto(num_layers=4)
    built.proto.layer_end = 3
    _reject(built, "disagrees with pp_layer_begins")


# -- state components ---------------------------------------------------------


def test_state_region_with_undeclared_component(layout_proto: Builder, state_spec: Any) -> None:
    """A state region naming a component that is not declared is rejected."""
    built = layout_proto(state=(state_spec("mamba", common_pb2.STATE_TYPE_MAMBA),))
    _first(built.proto, STATE).component = "ssm"
    _reject(built, r"state component 'ssm' is not declared")


def test_state_component_declared_twice(layout_proto: Builder, state_spec: Any) -> None:
    """A component declared twice is rejected."""
    built = layout_proto(state=(state_spec("swa", common_pb2.STATE_TYPE_SWA),))
    built.proto.state_components.add(name="swa", type=common_pb2.STATE_TYPE_NSA)
    _reject(built, "state component 'swa' is declared twice")


def test_state_component_without_regions(layout_proto: Builder) -> None:
    """A declared component with no regions is rejected."""
    built = layout_proto()
    built.proto.state_components.add(name="nsa", type=common_pb2.STATE_TYPE_NSA)
    _reject(built, "state component 'nsa' has no regions")


def test_state_component_without_type(layout_proto: Builder) -> None:
    """A component with an unspecified type is rejected."""
    built = layout_proto()
    built.proto.state_components.add(name="x")
    _reject(built, "state component 'x' has no type")


def test_state_component_without_name(layout_proto: Builder) -> None:
    """A component with an empty name is rejected."""
    built = layout_proto()
    built.proto.state_components.add(type=common_pb2.STATE_TYPE_MAMBA)
    _reject(built, "names must not be empty")


def test_state_component_uneven_items(layout_proto: Builder, state_spec: Any) -> None:
    """Regions of one component must hold the same number of items."""
    built = layout_proto(
        state=(state_spec("mamba", common_pb2.STATE_TYPE_MAMBA, items=4, item_bytes=16),)
    )
    _first(built.proto, STATE).length_bytes = 16 * 3
    _reject(built, "state component 'mamba': every region must hold the same number of items")


# -- rank keys ----------------------------------------------------------------


def test_rank_key_str() -> None:
    """RankKey renders as group/tpN/ppM."""
    assert str(RankKey("prefill-a", 3, 1)) == "prefill-a/tp3/pp1"


def test_rank_key_from_and_to_proto() -> None:
    """rank_key() reads an EngineRankId; to_proto() writes the same one back."""
    msg = common_pb2.EngineRankId(group="decode", tp_rank=2, pp_rank=5)
    key = rank_key(msg)
    assert key == RankKey("decode", 2, 5)
    assert (key.group, key.tp_rank, key.pp_rank) == ("decode", 2, 5)
    assert key.to_proto() == msg


def test_rank_keys_distinguish_tp_ranks() -> None:
    """Keys of ranks that differ only in tp rank are distinct (lesson 2)."""
    keys = {RankKey("g", tp, 0) for tp in range(4)}
    assert len(keys) == 4


def test_layout_is_frozen(make_layout: Builder) -> None:
    """A Layout cannot be modified after validation."""
    layout: Layout = make_layout()
    with pytest.raises(AttributeError):
        layout.num_pages = 3  # type: ignore[misc]


def test_overlapping_regions_are_rejected(layout_proto: Builder) -> None:
    """Two regions sharing bytes of one buffer are rejected (a write to one would corrupt the other)."""
    built = layout_proto()
    built.proto.regions[1].offset_bytes = built.proto.regions[0].offset_bytes
    _reject(built, "overlap")


# -- the fused layout (vLLM's CPU KV cache) -------------------------------------


def test_a_fused_layout_has_one_region_of_keys_and_values_per_layer() -> None:
    """KV_LAYOUT_HND_FUSED: one KV region per layer whose pages hold keys and values
    (per head, the page's keys then its values); KEY/VALUE regions, or MLA with it, are refused."""
    import torch

    from kvbroker.client import EngineMemory, ModelSpec, RankSpec

    model = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4, kv_layout="hnd_fused")
    memory = EngineMemory.allocate(RankSpec("g", "decode"), model, num_pages=8, guard_bytes=0)
    try:
        layout = Layout.from_proto(memory.layout, rank=RankKey("g", 0, 0), buffer_sizes=memory.buffer_sizes())
        assert layout.kv_kinds() == (common_pb2.REGION_KIND_KV,) and layout.num_pages == 8
        assert layout.kv_page_bytes == 2 * 4 * 2 * 8 * 2  # heads x tokens x (keys + values) x head_dim x fp16
        assert memory.kv[1].shape == (8, 2, 4, 16) and memory.kv_tensors(1) == [memory.kv[1]]
        keyed = common_pb2.EngineLayout()
        keyed.CopyFrom(memory.layout)
        keyed.regions[0].kind = common_pb2.REGION_KIND_KEY
        with pytest.raises(InvalidArgument, match="REGION_KIND_KEY does not belong in a fused"):
            Layout.from_proto(keyed, rank=RankKey("g", 0, 0), buffer_sizes=memory.buffer_sizes())
        mla = common_pb2.EngineLayout()
        mla.CopyFrom(memory.layout)
        mla.mla, mla.total_kv_heads, mla.kv_heads_per_rank = True, 1, 1
        with pytest.raises(InvalidArgument, match="kv_layout must be KV_LAYOUT_NHD"):
            Layout.from_proto(mla, rank=RankKey("g", 0, 0), buffer_sizes=memory.buffer_sizes())
    finally:
        memory.close()

"""A value for every byte of the full model's KV, aux rows and state.

Every element of the whole model's KV cache is identified by (layer, kind,
page, token, global head, dim); :func:`kv_bytes` turns those coordinates into
the element's bytes through a mixing function. A prefill rank fills its
tensors with the heads it holds (:func:`fill_rank`); a decode rank checks
every page it received against what the coordinates alone say it must hold
(:func:`verify_room`). Neither uses the broker's slicing code, so a wrong
head, layer, page or state item shows up as a mismatch.

The reference of ``kvbroker demo``, the parallel-layout scenarios
(``scenario``) and the soak benchmark. It imports nothing of the broker nor
of the plan package: keep it that way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvbroker.client import EngineMemory, ModelSpec, RankSpec
from kvbroker.v1 import common_pb2

__all__ = [
    "aux_bytes",
    "fill_rank",
    "kv_bytes",
    "rank_heads",
    "state_bytes",
    "state_items",
    "verify_room",
    "write_aux",
]

_MIX1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
_KIND = {"k": 0, "v": 1, "mla": 2, "kv": 3}


def _mix(codes: torch.Tensor, nbytes: int) -> torch.Tensor:
    x = codes * _MIX1
    x = x ^ (x >> 31)
    x = x * _MIX2
    x = x ^ (x >> 29)
    shifts = torch.arange(nbytes, dtype=torch.int64) * 8
    return ((x.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)


def rank_heads(total_heads: int, tp_size: int, tp_rank: int, mla: bool) -> torch.Tensor:
    """Global head ids a tp rank holds (replicated when heads < tp size).

    Written from the model's definition, independently of the broker's
    ``mapping.rank_heads``.
    """
    if mla:
        return torch.zeros(1, dtype=torch.int64)
    if total_heads >= tp_size:
        per = total_heads // tp_size
        return torch.arange(tp_rank * per, (tp_rank + 1) * per, dtype=torch.int64)
    return torch.tensor([tp_rank // (tp_size // total_heads)], dtype=torch.int64)


def kv_bytes(
    *,
    layer: int,
    kind: int,
    pages: torch.Tensor,
    page_size: int,
    heads: torch.Tensor,
    head_dim: int,
    dtype_bytes: int,
) -> torch.Tensor:
    """uint8 ``[len(pages), page_size, len(heads), head_dim * dtype_bytes]``:
    the bytes of those pages of one layer's K (kind 0), V (1) or MLA (2)
    for the given global heads."""
    p = pages.to(torch.int64).view(-1, 1, 1, 1)
    t = torch.arange(page_size, dtype=torch.int64).view(1, -1, 1, 1)
    h = heads.to(torch.int64).view(1, 1, -1, 1)
    d = torch.arange(head_dim, dtype=torch.int64).view(1, 1, 1, -1)
    # 10 + 20 + 10 + 8 + 12 bits: unique for layers*3 < 1024, pages < 2^20,
    # page_size <= 1024, heads < 256, head_dim <= 4096.
    code = ((((layer * 3 + kind) * (1 << 20) + p) * 1024 + t) * 256 + h) * 4096 + d
    return _mix(code, dtype_bytes).reshape(len(pages), page_size, len(heads), head_dim * dtype_bytes)


def aux_bytes(*, room: int, region: int, row_bytes: int) -> torch.Tensor:
    """uint8 ``[row_bytes]``: the aux row of ``room`` in aux region ``region``."""
    code = (torch.tensor(room % (1 << 40), dtype=torch.int64) * 16 + region) * 65536 + torch.arange(row_bytes, dtype=torch.int64)
    return _mix(code + (1 << 60), 1).view(row_bytes)


def state_bytes(*, component: str, layer: int, ordinal: int, shard: int, items: torch.Tensor, item_bytes: int) -> torch.Tensor:
    """uint8 ``[len(items), item_bytes]``: state items of one region of a component.

    ``shard`` is the tp rank for state sharded over tp (non-MLA), 0 for
    replicated state (MLA).
    """
    name = sum((i + 1) * ord(c) for i, c in enumerate(component)) % 4096
    base = ((((name * 256 + layer) * 16 + ordinal) * 256 + shard) * (1 << 16)) + 1
    code = (base + items.to(torch.int64).view(-1, 1)) * 65536 + torch.arange(item_bytes, dtype=torch.int64).view(1, -1)
    return _mix(code + (1 << 61), 1).view(len(items), item_bytes)


def _kv_tensors(memory: EngineMemory, model: ModelSpec, layer: int) -> list[tuple[int, torch.Tensor]]:
    if model.mla:
        return [(_KIND["mla"], memory.mla[layer].view(torch.uint8))]
    if model.fused:
        return [(_KIND["kv"], memory.kv[layer].view(torch.uint8))]
    return [(_KIND["k"], memory.k[layer].view(torch.uint8)), (_KIND["v"], memory.v[layer].view(torch.uint8))]


def _reference(kind: int, *, layer: int, pages: torch.Tensor, model: ModelSpec, heads: torch.Tensor, dtype_bytes: int) -> torch.Tensor:
    """The reference bytes of ``pages`` of one KV tensor of ``layer``. A fused page holds, for
    each head, the keys of its tokens, then their values (vLLM's CPU order with its vec kernel;
    the broker moves a head's part of a page whole, whatever the order inside)."""
    args = dict(layer=layer, pages=pages, page_size=model.page_size, heads=heads, head_dim=model.head_dim, dtype_bytes=dtype_bytes)
    if kind != _KIND["kv"]:
        return kv_bytes(kind=kind, **args)  # type: ignore[arg-type]
    k, v = (kv_bytes(kind=_KIND[x], **args).permute(0, 2, 1, 3) for x in ("k", "v"))  # type: ignore[arg-type]
    return torch.cat((k, v), dim=2).reshape(len(pages), len(heads), model.page_size, -1)


def state_items(memory: EngineMemory) -> dict[str, list[tuple[int, int, torch.Tensor]]]:
    """component -> (layer, ordinal within that layer, tensor) of every state region."""
    out: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
    state = [r for r in memory.layout.regions if r.kind == common_pb2.REGION_KIND_STATE]
    layer_of = [r.layer_id for r in state]
    names = [r.component for r in state]
    tensors = {name: iter(memory.state[name]) for name in memory.state}
    counts: dict[tuple[str, int], int] = {}
    for name, layer in zip(names, layer_of):
        ordinal = counts.get((name, layer), 0)
        counts[(name, layer)] = ordinal + 1
        out.setdefault(name, []).append((layer, ordinal, next(tensors[name])))
    return out


def _shard(model: ModelSpec, rank: RankSpec) -> int:
    return 0 if model.mla else rank.tp_rank


def fill_rank(memory: EngineMemory, model: ModelSpec, rank: RankSpec) -> None:
    """Fill every KV page and state item of a prefill rank with the reference pattern."""
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    heads = rank_heads(model.total_kv_heads, rank.tp_size, rank.tp_rank, model.mla)
    begin, end = rank.layer_range(model)
    for layer in range(begin, end):
        for kind, tensor in _kv_tensors(memory, model, layer):
            pool = torch.arange(tensor.shape[0])
            tensor.copy_(_reference(kind, layer=layer, pages=pool, model=model, heads=heads, dtype_bytes=itemsize))
    for name, regions in state_items(memory).items():
        for layer, ordinal, tensor in regions:
            items = torch.arange(tensor.shape[0])
            tensor.copy_(
                state_bytes(component=name, layer=layer, ordinal=ordinal, shard=_shard(model, rank), items=items, item_bytes=tensor.shape[1])
            )


def verify_room(
    memory: EngineMemory,
    model: ModelSpec,
    rank: RankSpec,
    *,
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    room: int,
    aux_row: int | None,
    state: Mapping[str, tuple[Sequence[int], Sequence[int]]] = {},
) -> list[str]:
    """Every byte a decode rank received for one room against the reference; the problems found.

    ``state`` maps each component to (source indices, destination indices);
    the reference of destination item i is source item i of the same layer
    and tp shard (trimmed to the shorter list, as paged components are).
    """
    problems: list[str] = []
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    heads = rank_heads(model.total_kv_heads, rank.tp_size, rank.tp_rank, model.mla)
    src = torch.from_numpy(np.asarray(src_pages, dtype=np.int64))
    dst = torch.from_numpy(np.asarray(dst_pages, dtype=np.int64))
    begin, end = rank.layer_range(model)
    for layer in range(begin, end):
        for kind, tensor in _kv_tensors(memory, model, layer):
            want = _reference(kind, layer=layer, pages=src, model=model, heads=heads, dtype_bytes=itemsize)
            got = tensor[dst].cpu()
            if not torch.equal(got, want):
                problems.append(f"layer {layer} kind {kind}: {int((got != want).sum())} bytes differ")
    if aux_row is not None:
        for i, aux in enumerate(memory.aux):
            if not torch.equal(aux[aux_row].cpu(), aux_bytes(room=room, region=i, row_bytes=aux.shape[1])):
                problems.append(f"aux region {i} differs")
    regions = state_items(memory)
    for name, (src_idx, dst_idx) in state.items():
        n = min(len(src_idx), len(dst_idx))
        for layer, ordinal, tensor in regions.get(name, []):
            want = state_bytes(
                component=name,
                layer=layer,
                ordinal=ordinal,
                shard=_shard(model, rank),
                items=torch.as_tensor(list(src_idx)[:n]),
                item_bytes=tensor.shape[1],
            )
            if not torch.equal(tensor[torch.as_tensor(list(dst_idx)[:n], dtype=torch.int64)].cpu(), want):
                problems.append(f"state {name} layer {layer} region {ordinal} differs")
    return problems


def write_aux(memory: EngineMemory, room: int, row: int) -> None:
    """Write ``room``'s aux row (what the prefill engine produced) into row ``row``."""
    for i, aux in enumerate(memory.aux):
        aux[row].copy_(aux_bytes(room=room, region=i, row_bytes=aux.shape[1]))

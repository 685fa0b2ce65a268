"""A value for every byte of the full model's KV, aux rows and state.

Every element of the whole model's KV cache is identified by (layer, kind,
page, token, global head, dim); :func:`kv_bytes` turns those coordinates into
the element's bytes through a mixing function. A prefill rank fills its
tensors with the slice it owns; the decode rank computes what each of its
pages must hold from the coordinates alone. Neither uses the broker's slicing
code, so a wrong head, layer or page shows up as a mismatch.
"""

from __future__ import annotations

import torch

__all__ = ["aux_bytes", "kv_bytes", "rank_heads"]

_MIX1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64


def _mix(codes: torch.Tensor, nbytes: int) -> torch.Tensor:
    x = codes * _MIX1
    x = x ^ (x >> 31)
    x = x * _MIX2
    x = x ^ (x >> 29)
    shifts = torch.arange(nbytes, dtype=torch.int64) * 8
    return ((x.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)


def rank_heads(total_heads: int, tp_size: int, tp_rank: int, mla: bool) -> torch.Tensor:
    """Global head ids a tp rank holds (replicated when heads < tp size)."""
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

"""Which sender ranks owe a receiver rank data, and what: pure functions.

The receiver's broker computes the plan from both groups' shapes (it learned
the sender's in the handshake) and sends it with the room registration; the
sender's broker executes it. One place computes it, so the two sides cannot
disagree.

Let T be the model's total KV heads, Ps and Pd the sender and receiver tp
sizes. A tp rank r of a group of tp size P holds heads
``[r * T/P, (r + 1) * T/P)`` when T >= P, else the single head
``r // (P / T)`` (heads replicated over P / T ranks). Head counts always come
from T, never from per-rank counts (lesson 3 of docs/design.md).

- Equal tp sizes (MHA, GQA, MLA): tp rank r sends whole pages to tp rank r.
- MLA with different tp sizes: the KV is identical on every rank, so exactly
  one sender rank writes each receiver rank; the others only report
  completion (``SOURCE_MODE_COMPLETION_ONLY``) so nobody waits forever.
- Non-MLA with different tp sizes: every sender rank holding some of the
  receiver's heads is a source. Among ranks holding the same heads
  (replicas) the lowest writes (``SOURCE_MODE_HEAD_SLICE``: ``num_heads``
  heads from ``src_head_start`` of its pages to ``dst_head_start`` of the
  receiver's; ``SOURCE_MODE_FULL_PAGES`` when that is the whole page on both
  sides) and the others only report completion.
- Pipeline parallel on either side: a sender pp rank is a source of a
  receiver rank when their layer ranges overlap; layers pair by layer id.
- Page sizes may differ where whole tokens move (equal tp sizes, or MLA)
  in token-major pages: the sender moves token runs
  (``kvbroker.plan``); head slices between different page sizes,
  and fused pages (whose inside is the attention kernel's), are refused.

Aux rows come from one writing source per receiver rank: the lowest writing
tp rank at the sender's last pp rank (which produced the output). State
regions travel with the KV of their layer, from writing sources; they cannot
be head-sliced, so state between different tp sizes of a non-MLA model is
refused (:func:`check_state_supported`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from kvbroker.errors import FailedPrecondition, Unimplemented
from kvbroker.plan._layout import Layout, RankKey, rank_key
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["GroupShape", "SourcePlan", "check_compatible", "check_state_supported", "rank_heads", "plan_sources"]

FULL_PAGES = peer_pb2.SOURCE_MODE_FULL_PAGES
HEAD_SLICE = peer_pb2.SOURCE_MODE_HEAD_SLICE
COMPLETION_ONLY = peer_pb2.SOURCE_MODE_COMPLETION_ONLY
_FUSED = common_pb2.KV_LAYOUT_HND_FUSED


@dataclass(frozen=True)
class GroupShape:
    """What the mapping needs to know of an engine group (from any of its ranks)."""

    tp_size: int
    pp_size: int
    num_layers: int
    pp_layer_begins: tuple[int, ...]
    mla: bool
    total_kv_heads: int
    head_dim: int
    dtype: str
    page_size_tokens: int
    kv_layout: int = 0
    #: What must match beyond shapes, as the engines declare it ("": not declared).
    compatibility: str = ""

    @classmethod
    def of(cls, layout: Layout) -> GroupShape:
        return cls(
            tp_size=layout.tp_size,
            pp_size=layout.pp_size,
            num_layers=layout.num_layers,
            pp_layer_begins=layout.pp_layer_begins,
            mla=layout.mla,
            total_kv_heads=layout.total_kv_heads,
            head_dim=layout.head_dim,
            dtype=layout.dtype,
            page_size_tokens=layout.page_size_tokens,
            compatibility=layout.compatibility,
            kv_layout=layout.kv_layout,
        )

    def layer_range(self, pp_rank: int) -> tuple[int, int]:
        begins = self.pp_layer_begins
        end = begins[pp_rank + 1] if pp_rank + 1 < len(begins) else self.num_layers
        return begins[pp_rank], end


@dataclass(frozen=True, slots=True)
class SourcePlan:
    """One sender rank a receiver rank waits for, and what it owes."""

    rank: RankKey
    mode: int
    num_destinations: int
    layer_begin: int
    layer_end: int
    sends_aux: bool
    sends_state: bool
    src_head_start: int = 0
    dst_head_start: int = 0
    num_heads: int = 0

    @property
    def writes_data(self) -> bool:
        return self.mode in (FULL_PAGES, HEAD_SLICE)

    @property
    def head_sliced(self) -> bool:
        return self.mode == HEAD_SLICE

    def to_proto(self) -> peer_pb2.SourcePlan:
        return peer_pb2.SourcePlan(
            rank=self.rank.to_proto(),
            mode=self.mode,  # type: ignore[arg-type]
            num_destinations=self.num_destinations,
            layer_begin=self.layer_begin,
            layer_end=self.layer_end,
            sends_aux=self.sends_aux,
            sends_state=self.sends_state,
            src_head_start=self.src_head_start,
            dst_head_start=self.dst_head_start,
            num_heads=self.num_heads,
        )

    @classmethod
    def from_proto(cls, msg: peer_pb2.SourcePlan) -> SourcePlan:
        """The plan a registration carries; equal plans are one shared object
        (every room of a group pair carries the same few)."""
        return _shared_plan(
            rank_key(msg.rank),
            msg.mode,
            msg.num_destinations,
            msg.layer_begin,
            msg.layer_end,
            msg.sends_aux,
            msg.sends_state,
            msg.src_head_start,
            msg.dst_head_start,
            msg.num_heads,
        )


@functools.lru_cache(maxsize=4096)
def _shared_plan(*fields: Any) -> SourcePlan:
    return SourcePlan(*fields)


def rank_heads(total_heads: int, tp_size: int, tp_rank: int) -> range:
    """Global KV heads tp rank ``tp_rank`` of a group of ``tp_size`` holds."""
    if total_heads >= tp_size:
        per = total_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    head = tp_rank // (tp_size // total_heads)
    return range(head, head + 1)


def check_compatible(sender: GroupShape, receiver: GroupShape) -> None:
    """Raise ``FailedPrecondition`` when the two groups cannot exchange KV at all."""
    problems = []
    if sender.mla != receiver.mla:
        problems.append(f"mla {sender.mla} vs {receiver.mla}")
    for field in ("num_layers", "dtype", "head_dim", "total_kv_heads", "kv_layout"):
        a, b = getattr(sender, field), getattr(receiver, field)
        if a != b:
            problems.append(f"{field} {a} vs {b}")
    if sender.compatibility and receiver.compatibility and sender.compatibility != receiver.compatibility:
        # Declared by the engines (EngineLayout.compatibility): equal shapes
        # from different models, dtypes or attention backends must not mix.
        problems.append(
            f"compatibility {sender.compatibility!r} vs {receiver.compatibility!r} (the engines differ in model, "
            "version, dtype, cache dtype or attention backend; an adapter's enforce_compatibility "
            "off skips this check)"
        )
    if problems:
        raise FailedPrecondition(f"sender and receiver layouts differ: {'; '.join(problems)}")


def check_state_supported(sender: GroupShape, receiver: GroupShape) -> None:
    """Refuse state between different tp sizes of a non-MLA model.

    Hybrid-model state (Mamba conv/ssm, SWA KV, NSA indexer KV) is sharded
    over tp ranks in ways this broker cannot slice; MLA models replicate it
    like their latent KV, so whole items move.
    """
    if sender.tp_size != receiver.tp_size and not sender.mla:
        raise Unimplemented(
            f"hybrid-model state cannot be moved between tp {sender.tp_size} and tp {receiver.tp_size} "
            "(non-MLA state is sharded by heads); use equal tp sizes for hybrid models"
        )


@dataclass(frozen=True)
class _TpSource:
    tp_rank: int
    mode: int
    src_head_start: int = 0
    dst_head_start: int = 0
    num_heads: int = 0


def _tp_sources(sender: GroupShape, receiver: GroupShape, receiver_tp: int) -> list[_TpSource]:
    """Every sender tp rank the receiver tp rank hears from, and what it owes."""
    ps, pd = sender.tp_size, receiver.tp_size
    if ps == pd:
        return [_TpSource(receiver_tp, FULL_PAGES)]
    if sender.mla:
        if ps > pd:
            if ps % pd:
                raise Unimplemented(f"MLA tp {ps} -> {pd}: the larger tp size must be a multiple of the smaller")
            ratio = ps // pd
            first = receiver_tp * ratio
            return [_TpSource(first + i, FULL_PAGES if i == 0 else COMPLETION_ONLY) for i in range(ratio)]
        if pd % ps:
            raise Unimplemented(f"MLA tp {ps} -> {pd}: the larger tp size must be a multiple of the smaller")
        return [_TpSource(receiver_tp // (pd // ps), FULL_PAGES)]
    total = sender.total_kv_heads
    for p in (ps, pd):
        if (total >= p and total % p) or (total < p and p % total):
            raise Unimplemented(f"{total} KV heads do not divide evenly over tp {p}")
    need = rank_heads(total, pd, receiver_tp)
    sources = []
    for rp in range(ps):
        have = rank_heads(total, ps, rp)
        start, stop = max(need.start, have.start), min(need.stop, have.stop)
        if start >= stop:
            continue
        # Replicas hold identical heads: the lowest rank writes them.
        if rp != min(r for r in range(ps) if rank_heads(total, ps, r) == have):
            sources.append(_TpSource(rp, COMPLETION_ONLY))
            continue
        n = stop - start
        if n == len(have) == len(need):
            sources.append(_TpSource(rp, FULL_PAGES))
        else:
            sources.append(_TpSource(rp, HEAD_SLICE, start - have.start, start - need.start, n))
    return sources


def _sources_without_counts(
    sender: GroupShape, sender_group: str, receiver: GroupShape, receiver_tp: int, receiver_pp: int
) -> list[SourcePlan]:
    r_begin, r_end = receiver.layer_range(receiver_pp)
    last_pp = sender.pp_size - 1
    tp_sources = _tp_sources(sender, receiver, receiver_tp)
    aux_tp = min((s.tp_rank for s in tp_sources if s.mode != COMPLETION_ONLY), default=None)
    plans = []
    for src in tp_sources:
        for pp in range(sender.pp_size):
            s_begin, s_end = sender.layer_range(pp)
            begin, end = max(r_begin, s_begin), min(r_end, s_end)
            has_layers = begin < end
            sends_aux = src.tp_rank == aux_tp and pp == last_pp
            if not has_layers and not sends_aux:
                continue
            writes = src.mode != COMPLETION_ONLY
            plans.append(
                SourcePlan(
                    rank=RankKey(sender_group, src.tp_rank, pp),
                    mode=src.mode,
                    num_destinations=0,
                    layer_begin=begin if (writes and has_layers) else 0,
                    layer_end=end if (writes and has_layers) else 0,
                    sends_aux=sends_aux,
                    sends_state=writes and has_layers,
                    src_head_start=src.src_head_start,
                    dst_head_start=src.dst_head_start,
                    num_heads=src.num_heads,
                )
            )
    return plans


@functools.lru_cache(maxsize=1024)
def plan_sources(
    sender: GroupShape,
    sender_group: str,
    receiver: GroupShape,
    receiver_tp: int,
    receiver_pp: int,
) -> tuple[SourcePlan, ...]:
    """Every source receiver rank (tp ``receiver_tp``, pp ``receiver_pp``) waits for.

    Sources are unique by (group, tp rank, pp rank) (lesson 2 of docs/design.md).
    ``num_destinations`` of each plan counts the receiver ranks of the whole
    receiver group that the source serves, so the sender knows when it is
    done. Raises ``FailedPrecondition`` for incompatible groups and
    ``Unimplemented`` for mappings this broker cannot do. Cached: the plans
    depend on the two groups' shapes only, so a group's rooms share them.
    """
    check_compatible(sender, receiver)
    plans = _sources_without_counts(sender, sender_group, receiver, receiver_tp, receiver_pp)
    if sender.page_size_tokens != receiver.page_size_tokens and sender.kv_layout == _FUSED:
        raise Unimplemented(
            f"KV_LAYOUT_HND_FUSED pages of {sender.page_size_tokens} and {receiver.page_size_tokens} tokens: the order "
            "of tokens inside a fused page is the attention kernel's (vLLM's CPU kernel stores keys transposed, and "
            "packs tiles with AMX), so fused pages move whole only; use equal block sizes"
        )
    if sender.page_size_tokens != receiver.page_size_tokens and any(p.head_sliced for p in plans):
        raise Unimplemented(
            f"page sizes {sender.page_size_tokens} and {receiver.page_size_tokens} tokens with tp {sender.tp_size} -> "
            f"{receiver.tp_size}: head slices between different page sizes are not implemented; use equal page sizes "
            "or equal tp sizes"
        )
    served: dict[RankKey, int] = {}
    for tp in range(receiver.tp_size):
        for pp in range(receiver.pp_size):
            for plan in _sources_without_counts(sender, sender_group, receiver, tp, pp):
                served[plan.rank] = served.get(plan.rank, 0) + 1
    return tuple(
        SourcePlan(
            rank=p.rank,
            mode=p.mode,
            num_destinations=served[p.rank],
            layer_begin=p.layer_begin,
            layer_end=p.layer_end,
            sends_aux=p.sends_aux,
            sends_state=p.sends_state,
            src_head_start=p.src_head_start,
            dst_head_start=p.dst_head_start,
            num_heads=p.num_heads,
        )
        for p in plans
    )

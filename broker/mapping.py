"""Which sender ranks owe a receiver rank data, and what: pure functions.

The receiver's broker computes the plan from both groups' shapes (it learned
the sender's in the handshake) and sends it with the room registration; the
sender's broker executes it. One place computes it, so the two sides cannot
disagree.

Supported here:

- equal tensor-parallel sizes (MHA, GQA and MLA): tp rank r sends whole pages
  to tp rank r;
- MLA with different tp sizes: the KV is identical on every rank, so exactly
  one sender rank writes each receiver rank and the others only report
  completion (``SOURCE_MODE_COMPLETION_ONLY``) so nobody waits forever;
- pipeline parallel on either side: layers pair by layer id; a sender pp rank
  is a source of a receiver rank when their layer ranges overlap.

Aux rows and state come from the sender's last pp rank (the one that produced
the output), in the tp position that serves the receiver.

Head-sliced transfers (non-MLA with different tp sizes) are not built yet and
raise ``Unimplemented``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbroker.broker.layout import Layout, RankKey
from kvbroker.errors import FailedPrecondition, Unimplemented
from kvbroker.v1 import peer_pb2

__all__ = ["GroupShape", "SourcePlan", "plan_sources"]


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
        )

    def layer_range(self, pp_rank: int) -> tuple[int, int]:
        begins = self.pp_layer_begins
        end = begins[pp_rank + 1] if pp_rank + 1 < len(begins) else self.num_layers
        return begins[pp_rank], end


@dataclass(frozen=True)
class SourcePlan:
    """One sender rank a receiver rank waits for, and what it owes."""

    rank: RankKey
    mode: int
    num_destinations: int
    layer_begin: int
    layer_end: int
    sends_aux: bool
    sends_state: bool

    @property
    def writes_data(self) -> bool:
        return self.mode == peer_pb2.SOURCE_MODE_FULL_PAGES

    def to_proto(self) -> peer_pb2.SourcePlan:
        return peer_pb2.SourcePlan(
            rank=self.rank.to_proto(),
            mode=self.mode,  # type: ignore[arg-type]
            num_destinations=self.num_destinations,
            layer_begin=self.layer_begin,
            layer_end=self.layer_end,
            sends_aux=self.sends_aux,
            sends_state=self.sends_state,
        )

    @classmethod
    def from_proto(cls, msg: peer_pb2.SourcePlan) -> SourcePlan:
        return cls(
            rank=RankKey(msg.rank.group, msg.rank.tp_rank, msg.rank.pp_rank),
            mode=msg.mode,
            num_destinations=msg.num_destinations,
            layer_begin=msg.layer_begin,
            layer_end=msg.layer_end,
            sends_aux=msg.sends_aux,
            sends_state=msg.sends_state,
        )


def check_compatible(sender: GroupShape, receiver: GroupShape) -> None:
    """Raise ``FailedPrecondition`` when the two groups cannot exchange KV at all."""
    problems = []
    if sender.mla != receiver.mla:
        problems.append(f"mla {sender.mla} vs {receiver.mla}")
    for field in ("num_layers", "page_size_tokens", "dtype", "head_dim", "total_kv_heads"):
        a, b = getattr(sender, field), getattr(receiver, field)
        if a != b:
            problems.append(f"{field} {a} vs {b}")
    if problems:
        raise FailedPrecondition(f"sender and receiver layouts differ: {'; '.join(problems)}")


def _tp_sources(sender: GroupShape, receiver: GroupShape, receiver_tp: int) -> list[tuple[int, bool]]:
    """(sender tp rank, writes data) for every sender tp rank the receiver tp rank hears from."""
    ps, pd = sender.tp_size, receiver.tp_size
    if ps == pd:
        return [(receiver_tp, True)]
    if not sender.mla:
        raise Unimplemented(
            f"head-sliced transfer between tp {ps} and tp {pd} (non-MLA) is not supported by this broker yet"
        )
    if ps > pd:
        # Several sender ranks hold the same latent KV; the first writes, the
        # others only complete.
        ratio = ps // pd if ps % pd == 0 else 0
        if not ratio:
            raise Unimplemented(f"MLA tp {ps} -> {pd}: the larger tp size must be a multiple of the smaller")
        first = receiver_tp * ratio
        return [(first + i, i == 0) for i in range(ratio)]
    ratio = pd // ps if pd % ps == 0 else 0
    if not ratio:
        raise Unimplemented(f"MLA tp {ps} -> {pd}: the larger tp size must be a multiple of the smaller")
    return [(receiver_tp // ratio, True)]


def _sources_without_counts(
    sender: GroupShape, sender_group: str, receiver: GroupShape, receiver_tp: int, receiver_pp: int
) -> list[SourcePlan]:
    r_begin, r_end = receiver.layer_range(receiver_pp)
    last_pp = sender.pp_size - 1
    plans = []
    for tp, writes in _tp_sources(sender, receiver, receiver_tp):
        for pp in range(sender.pp_size):
            s_begin, s_end = sender.layer_range(pp)
            begin, end = max(r_begin, s_begin), min(r_end, s_end)
            has_layers = begin < end
            extras = pp == last_pp
            if not has_layers and not extras:
                continue
            if not writes:
                # Holds the same latent KV as a rank that writes it: owes only
                # its completion, so it finishes and nobody waits for it.
                plans.append(
                    SourcePlan(
                        rank=RankKey(sender_group, tp, pp),
                        mode=peer_pb2.SOURCE_MODE_COMPLETION_ONLY,
                        num_destinations=0,
                        layer_begin=0,
                        layer_end=0,
                        sends_aux=False,
                        sends_state=False,
                    )
                )
                continue
            plans.append(
                SourcePlan(
                    rank=RankKey(sender_group, tp, pp),
                    mode=peer_pb2.SOURCE_MODE_FULL_PAGES,
                    num_destinations=0,
                    layer_begin=begin if has_layers else 0,
                    layer_end=end if has_layers else 0,
                    sends_aux=extras,
                    sends_state=extras,
                )
            )
    return plans


def plan_sources(
    sender: GroupShape,
    sender_group: str,
    receiver: GroupShape,
    receiver_tp: int,
    receiver_pp: int,
) -> list[SourcePlan]:
    """Every source receiver rank (tp ``receiver_tp``, pp ``receiver_pp``) waits for.

    ``num_destinations`` of each plan counts the receiver ranks of the whole
    receiver group that the source serves, so the sender knows when it is done.
    Raises ``FailedPrecondition`` for incompatible groups and
    ``Unimplemented`` for mappings this broker cannot do.
    """
    check_compatible(sender, receiver)
    plans = _sources_without_counts(sender, sender_group, receiver, receiver_tp, receiver_pp)
    served: dict[RankKey, int] = {}
    for tp in range(receiver.tp_size):
        for pp in range(receiver.pp_size):
            for plan in _sources_without_counts(sender, sender_group, receiver, tp, pp):
                served[plan.rank] = served.get(plan.rank, 0) + 1
    return [
        SourcePlan(
            rank=p.rank,
            mode=p.mode,
            num_destinations=served[p.rank],
            layer_begin=p.layer_begin,
            layer_end=p.layer_end,
            sends_aux=p.sends_aux,
            sends_state=p.sends_state,
        )
        for p in plans
    ]

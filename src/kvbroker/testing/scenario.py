"""Parallel-layout scenarios: engine ranks in this process, brokers anywhere.

``run_scenario`` registers every prefill and decode rank of a layout (tp x pp
on each side, one client and one memfd per rank) with the given brokers,
moves a few chunked rooms with aux rows and state, and checks every byte each
decode rank received against the reference of ``kvbroker.testing.pattern``,
computed from the model's coordinates, not from the broker's slicing code.
Used by the service tests (fake NIXL) and the real-NIXL matrix.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from kvbroker.client import (
    BrokerClient,
    EngineHandle,
    EngineMemory,
    ModelSpec,
    RankSpec,
    RoomState,
    SenderRef,
)
from kvbroker.client.rooms import KVSender
from kvbroker.errors import KvBrokerError
from kvbroker.testing.pattern import fill_rank, verify_room, write_aux
from kvbroker.testing.room_plan import (
    STATE_KINDS,
    RoomPlan,
    plan_room,
    pool_pages,
    state_indices,
    state_specs,
)

__all__ = [
    "STATE_KINDS",
    "Prepare",
    "Scenario",
    "ScenarioResult",
    "close_ranks",
    "collect_rooms",
    "move_rooms",
    "register_group",
    "room_plans",
    "run_scenario",
    "send_room",
    "state_indices",
    "state_specs",
    "verify_rooms",
]

#: Called with each rank's memory after allocation, before registration.
Prepare = Callable[[EngineMemory, RankSpec], None]

@dataclass(frozen=True)
class Scenario:
    """A prefill/decode layout and a small workload."""

    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_pp: int = 1
    decode_pp: int = 1
    kv_heads: int = 8
    head_dim: int = 16
    layers: int = 4
    page_size: int = 4
    mla: bool = False
    #: "nhd" or "hnd_fused" (vLLM's CPU layout).
    kv_layout: str = "nhd"
    dtype: str = "bfloat16"
    state: tuple[str, ...] = ()
    rooms: int = 2
    pages: int = 6
    chunks: int = 2
    aux_bytes: int = 16
    seed: int = 0

    def model(self) -> ModelSpec:
        return ModelSpec(
            num_layers=self.layers,
            total_kv_heads=1 if self.mla else self.kv_heads,
            head_dim=self.head_dim,
            dtype=getattr(torch, self.dtype),
            page_size=self.page_size,
            mla=self.mla,
            kv_layout=self.kv_layout,  # type: ignore[arg-type]
        )

    @property
    def label(self) -> str:
        parts = [
            f"tp{self.prefill_tp}->{self.decode_tp}",
            f"pp{self.prefill_pp}->{self.decode_pp}",
            "mla" if self.mla else f"{self.kv_heads}h",
        ]
        if self.kv_layout != "nhd":
            parts.append(self.kv_layout)
        if self.state:
            parts.append("+".join(self.state))
        return "-".join(parts)


@dataclass
class _Rank:
    spec: RankSpec
    memory: EngineMemory
    client: BrokerClient
    engine: EngineHandle


@dataclass
class ScenarioResult:
    problems: list[str] = field(default_factory=list)
    #: Bytes the decode ranks received.
    bytes: int = 0
    #: From the first ExpectRoom to the last room SUCCESS on every rank.
    transfer_seconds: float = 0.0
    #: What ``run_scenario``'s ``probe`` returned as that window opened and as it closed.
    probes: tuple[Any, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def _register(
    address: str, spec: RankSpec, model: ModelSpec, scenario: Scenario, prepare: Prepare | None = None
) -> _Rank:
    memory = EngineMemory.allocate(
        spec,
        model,
        num_pages=pool_pages(scenario.pages, scenario.rooms),
        aux_rows=scenario.rooms,
        aux_row_bytes=[scenario.aux_bytes],
        state=state_specs(scenario.state, scenario.layers, scenario.rooms),
    )
    if prepare is not None:
        prepare(memory, spec)
    client = BrokerClient(address)
    return _Rank(spec, memory, client, client.register_engine(spec, memory))


def register_group(
    scenario: Scenario, role: Literal["prefill", "decode"], group: str, address: str | Sequence[str], prepare: Prepare | None = None
) -> list[_Rank]:
    """Register every rank of ``group`` (the scenario's prefill or decode
    side) with ``address`` (one broker, or one per rank in pp-major, tp-minor
    order); prefill ranks are filled with the reference pattern. Close them
    with :func:`close_ranks`."""
    model = scenario.model()
    tp_size, pp_size = (scenario.prefill_tp, scenario.prefill_pp) if role == "prefill" else (scenario.decode_tp, scenario.decode_pp)
    ranks: list[_Rank] = []
    try:
        for i, (pp, tp) in enumerate(itertools.product(range(pp_size), range(tp_size))):
            ranks.append(_register(_at(address, i), RankSpec(group, role, tp_size, tp, pp_size, pp), model, scenario, prepare))
            if role == "prefill":
                fill_rank(ranks[-1].memory, model, ranks[-1].spec)
    except BaseException:
        close_ranks(ranks)
        raise
    return ranks


def close_ranks(ranks: list[_Rank], *, broker_gone: bool = False) -> None:
    """Unregister and release ranks of :func:`register_group`. ``broker_gone``:
    their broker was killed, so unregistering there fails; that is expected."""
    for rank in ranks:
        try:
            rank.engine.close()
        except KvBrokerError:
            if not broker_gone:
                raise
        finally:
            rank.client.close()
            rank.memory.close()


def room_plans(scenario: Scenario) -> list[RoomPlan]:
    """The scenario's rooms (room ids random, so rooms of several runs never clash)."""
    room_base = secrets.randbits(40) << 16
    return [
        plan_room(seed=scenario.seed, index=i, room_base=room_base, pages=scenario.pages, chunks=scenario.chunks, window=scenario.rooms)
        for i in range(scenario.rooms)
    ]


def move_rooms(
    prefill: list[_Rank],
    decode: list[_Rank],
    plans: list[RoomPlan],
    ref: SenderRef,
    into: ScenarioResult,
    timeout_seconds: float = 60.0,
) -> None:
    """Open ``plans`` on every decode rank (sender ``ref``), send them from
    every prefill rank, wait for all; failures go to ``into.problems``."""
    for plan in plans:
        for rank in decode:
            rank.engine.receiver(plan.room, ref).init(
                plan.dst_pages, aux_row=plan.slot, state={n: state_indices(n, plan.slot, 1) for n in _state_on(rank)}
            )
    for plan in plans:
        send_room(prefill, plan)
    collect_rooms(decode, prefill, plans, timeout_seconds, into)


def verify_rooms(scenario: Scenario, decode: list[_Rank], plans: list[RoomPlan], into: ScenarioResult) -> None:
    """Check every byte the decode ranks received against the reference."""
    model = scenario.model()
    for plan in plans:
        for rank in decode:
            problems = verify_room(
                rank.memory,
                model,
                rank.spec,
                src_pages=plan.src_pages,
                dst_pages=plan.dst_pages,
                room=plan.room,
                aux_row=plan.slot,
                state={n: (state_indices(n, plan.slot, 0), state_indices(n, plan.slot, 1)) for n in _state_on(rank)},
            )
            into.problems.extend(f"room {plan.room} {rank.spec.role} tp{rank.spec.tp_rank} pp{rank.spec.pp_rank}: {p}" for p in problems)


def run_scenario(
    prefill_address: str | Sequence[str],
    decode_address: str | Sequence[str],
    scenario: Scenario,
    *,
    sender_address: str | None = None,
    timeout_seconds: float = 60.0,
    prepare: Prepare | None = None,
    probe: Callable[[], Any] | None = None,
    warmup_rooms: int = 0,
) -> ScenarioResult:
    """Run ``scenario``; the result lists every problem (empty: byte-exact).

    ``prefill_address`` and ``decode_address`` are each one broker, or one
    per rank (in pp-major, tp-minor order: a group spread over hosts).
    ``sender_address`` is what decode ranks put in SenderRef (default
    ``prefill_address`` when it is one broker; "" for "my own broker", or
    "the one etcd names" on brokers started with ``--etcd``). ``prepare``
    sees each rank's memory after allocation, before it is registered.
    ``probe`` is called right before the first ExpectRoom and right after
    the last SUCCESS (``ScenarioResult.probes``): a benchmark reads CPU
    counters there. The first ``warmup_rooms`` of the scenario's rooms move
    before that window (the brokers handshake for the new engines then, as
    they would once in service) and are verified but neither timed nor
    counted in ``ScenarioResult.bytes``.
    """
    if sender_address is None and not isinstance(prefill_address, str):
        raise ValueError("name the sender_address when the prefill ranks are on several brokers")
    tag = secrets.token_hex(4)
    groups = (f"prefill-{tag}", f"decode-{tag}")
    ranks: list[_Rank] = []
    result = ScenarioResult()
    try:
        prefill = register_group(scenario, "prefill", groups[0], prefill_address, prepare)
        ranks.extend(prefill)
        decode = register_group(scenario, "decode", groups[1], decode_address, prepare)
        ranks.extend(decode)
        plans = room_plans(scenario)
        ref = SenderRef(prefill_address if sender_address is None else sender_address, groups[0])  # type: ignore[arg-type]
        if warmup_rooms:
            move_rooms(prefill, decode, plans[:warmup_rooms], ref, result, timeout_seconds)
            result.bytes = 0
        opened = probe() if probe is not None else None
        start = time.perf_counter()
        move_rooms(prefill, decode, plans[warmup_rooms:], ref, result, timeout_seconds)
        result.transfer_seconds = time.perf_counter() - start
        if probe is not None:
            result.probes = (opened, probe())
        verify_rooms(scenario, decode, plans, result)
        for rank in ranks:
            result.problems.extend(f"{rank.spec.role} tp{rank.spec.tp_rank} pp{rank.spec.pp_rank}: {p}" for p in rank.memory.check_guards())
    finally:
        close_ranks(ranks)
    return result


def _at(address: str | Sequence[str], index: int) -> str:
    """The broker of the ``index``-th rank: the one broker, or its own."""
    return address if isinstance(address, str) else address[index]


def _state_on(rank: _Rank) -> list[str]:
    return list(rank.memory.state)


def send_room(prefill: list[_Rank], plan: RoomPlan, begun: Sequence[KVSender] = ()) -> None:
    """Send ``plan`` from every prefill rank: BeginSend, then its chunks
    (``begun``: the ranks' senders, when the rooms were begun already)."""
    for i, rank in enumerate(prefill):
        write_aux(rank.memory, plan.room, plan.slot)
        if begun:
            sender = begun[i]
        else:
            sender = rank.engine.sender(plan.room)
            sender.init(num_pages=len(plan.src_pages), aux_row=plan.slot)
        for a, b in plan.chunks:
            last = b == len(plan.src_pages)
            state = {n: state_indices(n, plan.slot, 0) for n in _state_on(rank)} if last else None
            sender.send(np.asarray(plan.src_pages[a:b]), state=state, is_last=last)


def collect_rooms(decode: list[_Rank], prefill: list[_Rank], plans: list[RoomPlan], timeout: float, result: ScenarioResult) -> None:
    """Wait for ``plans`` on every rank; a room not SUCCESS is a problem in ``result``."""
    rooms = [p.room for p in plans]
    for side in (decode, prefill):
        for rank in side:
            for room, status in rank.engine.wait(rooms, timeout_seconds=timeout).items():
                if RoomState(status.state) is not RoomState.SUCCESS:
                    result.problems.append(
                        f"room {room} {rank.spec.role} tp{rank.spec.tp_rank} pp{rank.spec.pp_rank}: "
                        f"{RoomState(status.state).name} {status.cause.message}"
                    )
                elif side is decode:
                    result.bytes += status.bytes

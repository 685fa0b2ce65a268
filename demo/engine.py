"""One engine rank of the demo, in its own process.

A prefill rank fills its KV with the reference pattern once, then for each
batch of rooms opens them, writes each room's aux row and sends the room's
pages in chunks. A decode rank expects each room into fresh pages, waits for
the batch, checks every byte of every page, aux row and layer against the
reference computed from the coordinates alone, then zeroes the pages for the
next batch. Both report to the orchestrator over a queue.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

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
from kvbroker.demo.pattern import aux_bytes, kv_bytes, rank_heads
from kvbroker.demo.plan import RoomPlan, plan_room, pool_pages

__all__ = ["EngineConfig", "run_engine"]


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine process needs (picklable)."""

    role: str
    broker: str
    group: str
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    #: The prefill side (decode ranks only).
    sender_broker: str
    sender_group: str
    layers: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    mla: bool
    rooms: int
    pages: int
    chunks: int
    window: int
    aux_bytes: int
    seed: int
    room_base: int
    timeout_seconds: float


def _model(cfg: EngineConfig) -> ModelSpec:
    return ModelSpec(
        num_layers=cfg.layers,
        total_kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        dtype=getattr(torch, cfg.dtype),
        page_size=cfg.page_size,
        mla=cfg.mla,
    )


def _kinds(model: ModelSpec, memory: EngineMemory, layer: int) -> list[tuple[int, torch.Tensor]]:
    """(pattern kind, tensor viewed as bytes [pages, page_size, heads, head_dim*dtype_bytes])."""
    tensors = [(2, memory.mla[layer])] if model.mla else [(0, memory.k[layer]), (1, memory.v[layer])]
    return [(kind, t.view(torch.uint8)) for kind, t in tensors]


def run_engine(cfg: EngineConfig, events: Any, go: Any) -> None:
    """Process entry point. Reports ("ready", ...) once registered, then waits
    for ``go`` (an Event) so that no rank's start-up counts as transfer
    time; reports ("error", rank, text) instead of dying silently."""
    name = f"{cfg.role} tp{cfg.tp_rank} pp{cfg.pp_rank}"
    try:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        torch.set_num_threads(1)
        (_run_prefill if cfg.role == "prefill" else _run_decode)(cfg, events, go, name)
    except BaseException:
        events.put(("error", name, traceback.format_exc()))
        raise


def _register(cfg: EngineConfig) -> tuple[BrokerClient, EngineHandle, ModelSpec, EngineMemory]:
    model = _model(cfg)
    rank = RankSpec(
        group=cfg.group,
        role=cfg.role,  # type: ignore[arg-type]
        tp_size=cfg.tp_size,
        tp_rank=cfg.tp_rank,
        pp_size=cfg.pp_size,
        pp_rank=cfg.pp_rank,
    )
    memory = EngineMemory.allocate(
        rank,
        model,
        num_pages=pool_pages(cfg.pages, cfg.window),
        aux_rows=cfg.window if cfg.aux_bytes else 0,
        aux_row_bytes=[cfg.aux_bytes] if cfg.aux_bytes else [],
    )
    client = BrokerClient(cfg.broker)
    engine = client.register_engine(rank, memory)
    return client, engine, model, memory


def _plans(cfg: EngineConfig) -> list[RoomPlan]:
    return [
        plan_room(seed=cfg.seed, index=i, room_base=cfg.room_base, pages=cfg.pages, chunks=cfg.chunks, window=cfg.window)
        for i in range(cfg.rooms)
    ]


def _batches(plans: list[RoomPlan], window: int) -> list[list[RoomPlan]]:
    return [plans[i : i + window] for i in range(0, len(plans), window)]


def _run_prefill(cfg: EngineConfig, events: Any, go: Any, name: str) -> None:
    client, engine, model, memory = _register(cfg)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    heads = rank_heads(cfg.kv_heads, cfg.tp_size, cfg.tp_rank, cfg.mla)
    pool = torch.arange(pool_pages(cfg.pages, cfg.window))
    begin, end = engine.rank.layer_range(model)
    for layer in range(begin, end):
        for kind, tensor in _kinds(model, memory, layer):
            tensor.copy_(
                kv_bytes(layer=layer, kind=kind, pages=pool, page_size=cfg.page_size, heads=heads, head_dim=cfg.head_dim, dtype_bytes=itemsize)
            )
    events.put(("ready", name, None))
    go.wait()
    try:
        for batch in _batches(_plans(cfg), cfg.window):
            for plan in batch:
                if memory.aux:
                    memory.aux[0][plan.slot].copy_(aux_bytes(room=plan.room, region=0, row_bytes=cfg.aux_bytes))
                sender = engine.sender(plan.room)
                sender.init(num_pages=len(plan.src_pages), aux_row=plan.slot if memory.aux else None)
                for a, b in plan.chunks:
                    sender.send(plan.src_pages[a:b], is_last=b == len(plan.src_pages))
            statuses = engine.wait([p.room for p in batch], timeout_seconds=cfg.timeout_seconds)
            for plan in batch:
                status = statuses[plan.room]
                if RoomState(status.state) is not RoomState.SUCCESS:
                    events.put(("room_failed", name, (plan.room, status.cause.message)))
            events.put(("sent", name, len(batch)))
    finally:
        engine.close()
        client.close()
    events.put(("done", name, None))


def _run_decode(cfg: EngineConfig, events: Any, go: Any, name: str) -> None:
    client, engine, model, memory = _register(cfg)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    heads = rank_heads(cfg.kv_heads, cfg.tp_size, cfg.tp_rank, cfg.mla)
    begin, end = engine.rank.layer_range(model)
    sender = SenderRef(cfg.sender_broker, cfg.sender_group)
    events.put(("ready", name, None))
    go.wait()
    try:
        for batch in _batches(_plans(cfg), cfg.window):
            start = time.perf_counter()
            for plan in batch:
                engine.receiver(plan.room, sender).init(plan.dst_pages, aux_row=plan.slot if memory.aux else None)
            statuses = engine.wait([p.room for p in batch], timeout_seconds=cfg.timeout_seconds)
            elapsed = time.perf_counter() - start
            for plan in batch:
                status = statuses[plan.room]
                if RoomState(status.state) is not RoomState.SUCCESS:
                    events.put(("room_failed", name, (plan.room, status.cause.message)))
                    continue
                bad = _verify(cfg, model, memory, plan, heads, itemsize, begin, end)
                events.put(("verified", name, (plan.room, status.bytes, bad)))
            events.put(("batch_time", name, (elapsed, sum(statuses[p.room].bytes for p in batch))))
            for plan in batch:
                dst = torch.from_numpy(plan.dst_pages.astype(np.int64))
                for layer in range(begin, end):
                    for _kind, tensor in _kinds(model, memory, layer):
                        tensor[dst] = 0
                if memory.aux:
                    memory.aux[0][plan.slot].zero_()
    finally:
        engine.close()
        client.close()
    events.put(("done", name, None))


def _verify(
    cfg: EngineConfig,
    model: ModelSpec,
    memory: EngineMemory,
    plan: RoomPlan,
    heads: torch.Tensor,
    itemsize: int,
    begin: int,
    end: int,
) -> list[str]:
    """Every byte of the room's pages and aux row against the reference; the problems found."""
    problems = []
    src = torch.from_numpy(plan.src_pages.astype(np.int64))
    dst = torch.from_numpy(plan.dst_pages.astype(np.int64))
    for layer in range(begin, end):
        for kind, tensor in _kinds(model, memory, layer):
            want = kv_bytes(layer=layer, kind=kind, pages=src, page_size=cfg.page_size, heads=heads, head_dim=cfg.head_dim, dtype_bytes=itemsize)
            got = tensor[dst]
            if not torch.equal(got, want):
                wrong = int((got != want).sum())
                problems.append(f"layer {layer} kind {kind}: {wrong} bytes differ")
    if memory.aux:
        want_aux = aux_bytes(room=plan.room, region=0, row_bytes=cfg.aux_bytes)
        if not torch.equal(memory.aux[0][plan.slot], want_aux):
            problems.append("aux row differs")
    return problems

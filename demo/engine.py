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

import grpc
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
from kvbroker.testing.pattern import fill_rank, verify_room, write_aux
from kvbroker.testing.room_plan import RoomPlan, plan_room, pool_pages, state_indices, state_specs
from kvbroker.v1 import admin_pb2, admin_pb2_grpc

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
    #: State component types ("mamba", "swa", "nsa") the model carries.
    state: tuple[str, ...]
    #: Report each room's timeline from both brokers (decode tp0 pp0 only).
    trace: bool
    seed: int
    room_base: int
    timeout_seconds: float
    #: Where this rank's memory lives: "cpu" or "cuda:N".
    device: str = "cpu"


def _model(cfg: EngineConfig) -> ModelSpec:
    return ModelSpec(
        num_layers=cfg.layers,
        total_kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        dtype=getattr(torch, cfg.dtype),
        page_size=cfg.page_size,
        mla=cfg.mla,
    )


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


def _register(cfg: EngineConfig) -> tuple[BrokerClient, EngineHandle, ModelSpec, EngineMemory, RankSpec]:
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
        state=state_specs(cfg.state, cfg.layers, cfg.window),
        device=cfg.device,
    )
    client = BrokerClient(cfg.broker)
    try:
        engine = client.register_engine(rank, memory)
    except Exception as exc:
        client.close()
        # Whichever phase it fails in, the demo's report names the broker.
        raise RuntimeError(f"registering with the broker at {cfg.broker} failed: {exc}") from exc
    return client, engine, model, memory, rank


def _plans(cfg: EngineConfig) -> list[RoomPlan]:
    return [
        plan_room(seed=cfg.seed, index=i, room_base=cfg.room_base, pages=cfg.pages, chunks=cfg.chunks, window=cfg.window)
        for i in range(cfg.rooms)
    ]


def _batches(plans: list[RoomPlan], window: int) -> list[list[RoomPlan]]:
    return [plans[i : i + window] for i in range(0, len(plans), window)]


def _run_prefill(cfg: EngineConfig, events: Any, go: Any, name: str) -> None:
    client, engine, model, memory, rank = _register(cfg)
    fill_rank(memory, model, rank)
    _settle(memory)
    components = list(memory.state)
    events.put(("ready", name, None))
    go.wait()
    try:
        for batch in _batches(_plans(cfg), cfg.window):
            for plan in batch:
                if memory.aux:
                    write_aux(memory, plan.room, plan.slot)
                    _settle(memory)
                sender = engine.sender(plan.room)
                sender.init(num_pages=len(plan.src_pages), aux_row=plan.slot if memory.aux else None)
                for a, b in plan.chunks:
                    last = b == len(plan.src_pages)
                    state = {n: state_indices(n, plan.slot, 0) for n in components} if last else None
                    sender.send(plan.src_pages[a:b], state=state, is_last=last)
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
    client, engine, model, memory, rank = _register(cfg)
    components = list(memory.state)
    sender = SenderRef(cfg.sender_broker, cfg.sender_group)
    begin, end = rank.layer_range(model)
    events.put(("ready", name, None))
    go.wait()
    try:
        for batch in _batches(_plans(cfg), cfg.window):
            start = time.perf_counter()
            for plan in batch:
                engine.receiver(plan.room, sender).init(
                    plan.dst_pages,
                    aux_row=plan.slot if memory.aux else None,
                    state={n: state_indices(n, plan.slot, 1) for n in components},
                )
            statuses = engine.wait([p.room for p in batch], timeout_seconds=cfg.timeout_seconds)
            elapsed = time.perf_counter() - start
            for plan in batch:
                status = statuses[plan.room]
                if RoomState(status.state) is not RoomState.SUCCESS:
                    events.put(("room_failed", name, (plan.room, status.cause.message)))
                    continue
                problems = verify_room(
                    memory,
                    model,
                    rank,
                    src_pages=plan.src_pages,
                    dst_pages=plan.dst_pages,
                    room=plan.room,
                    aux_row=plan.slot if memory.aux else None,
                    state={n: (state_indices(n, plan.slot, 0), state_indices(n, plan.slot, 1)) for n in components},
                )
                events.put(("verified", name, (plan.room, status.bytes, problems)))
            events.put(("batch_time", name, (elapsed, sum(statuses[p.room].bytes for p in batch))))
            if cfg.trace and cfg.tp_rank == 0 and cfg.pp_rank == 0:
                for plan in batch:
                    events.put(("timeline", name, (plan.room, _timelines(cfg, plan.room))))
            for plan in batch:
                _clear(memory, model, plan, begin, end)
    finally:
        engine.close()
        client.close()
    events.put(("done", name, None))


def _settle(memory: EngineMemory) -> None:
    """Wait for the kernels that wrote VRAM pages: the broker reads them as soon as it has a chunk."""
    if memory.raw is not None and memory.raw.is_cuda:
        torch.cuda.synchronize(memory.raw.device)


def _clear(memory: EngineMemory, model: ModelSpec, plan: RoomPlan, begin: int, end: int) -> None:
    """Zero a verified room's pages, aux row and state, so the next batch proves itself."""
    dst = torch.from_numpy(plan.dst_pages.astype(np.int64))
    for layer in range(begin, end):
        for tensor in memory.kv_tensors(layer):
            tensor.view(torch.uint8)[dst] = 0
    for aux in memory.aux:
        aux[plan.slot].zero_()
    for name, tensors in memory.state.items():
        rows = torch.as_tensor(state_indices(name, plan.slot, 1), dtype=torch.int64)
        for tensor in tensors:
            tensor[rows] = 0
    _settle(memory)


def _timelines(cfg: EngineConfig, room: int) -> dict[str, dict[str, float]]:
    """side -> event -> wall-clock seconds, from Admin.GetRoom of both brokers."""
    out: dict[str, dict[str, float]] = {}
    for address in {cfg.broker, cfg.sender_broker}:
        with grpc.insecure_channel(address) as channel:
            try:
                response = admin_pb2_grpc.AdminStub(channel).GetRoom(admin_pb2.GetRoomRequest(room=room), timeout=10)
            except grpc.RpcError:
                continue
        for side in response.sides:
            key = f"{side.info.side} {side.info.engine.group}/tp{side.info.engine.tp_rank}/pp{side.info.engine.pp_rank}"
            out[key] = {e.event: e.at for e in side.timeline}
    return out

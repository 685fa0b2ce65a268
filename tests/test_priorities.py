"""Priority classes and fair shares through whole brokers (in-process, fake NIXL), and the copy
thread's order. Each queue's own order is tested with it (test_staging, test_dataplane,
unit/test_send_window, unit/test_scheduling); the figures are bench/priority_bench.py's."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import torch

from kvbroker.broker.dataplane import Workers
from kvbroker.broker.scheduling import Priority, Ticket
from kvbroker.client import ModelSpec
from kvbroker.testing import FakeBroker
from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
from kvbroker.testing.gpu_model import GpuModel, ModelledStreams, ModelSetting, Timelines
from kvbroker.testing.load import RoomLoad, Saturate, timed_rooms
from kvbroker.v1 import admin_pb2, admin_pb2_grpc, common_pb2

#: 4 layers of 2 heads x 64, 8-token pages: 16 KiB a page; rooms of 64 pages (1 MiB).
MODEL = ModelSpec(num_layers=4, total_kv_heads=2, head_dim=64, dtype=torch.bfloat16, page_size=8)
#: The prefill broker's writes cross one wire of this speed (a 256 KiB part: 13 ms), slow enough
#: to be what bounds the rooms (not the brokers' CPU, in this one process).
WIRE_BPS = 20e6
#: Parts of 256 KiB, at most four posted: every room queues in the send window.
SMALL_WINDOW = {"part_bytes": 256 << 10, "send_window_bytes": 1 << 20}


def _loads(
    fake_brokers: Callable[..., FakeBroker], *specs: tuple[str, str, int], cuda: FakeCudaLib | None = None, **config: Any
) -> list[RoomLoad]:
    """Two brokers (the prefill's writes on one ``WIRE_BPS`` wire) and an engine pair per spec
    (name, class, pages a room); with ``cuda`` the KV is that fake driver's VRAM (the device path)."""
    p, d = fake_brokers("p", cuda=cuda, **{**SMALL_WINDOW, **config}), fake_brokers("d", cuda=cuda, **config)
    p.agent.wire_bps = WIRE_BPS
    prepare = functools.partial(as_fake_vram, fake=cuda) if cuda is not None else None
    return [RoomLoad.register(p.address, d.address, name=name, model=MODEL, room_pages=pages, slots=6, priority=priority,
                              prepare=prepare) for name, priority, pages in specs]


def _median_behind_backlog(bulk: RoomLoad, chat: RoomLoad) -> float:
    """The median seconds of 20 rooms of ``chat``, one opened every 20 ms, while ``bulk`` keeps
    three rooms in flight."""
    busy = Saturate(bulk, 3).start()
    time.sleep(0.3)
    latencies = sorted(timed_rooms(chat, 20, 0.02))
    busy.stop()
    return latencies[len(latencies) // 2]


def test_two_saturating_bulk_engines_share_the_bytes_equally(fake_brokers) -> None:  # type: ignore[no-untyped-def]
    """Two bulk engines through one send window, one keeping six rooms in flight and the other two
    (first come first served would give the first three times the bytes): over the same seconds
    each moves half of the bytes, within 15%."""
    loads = _loads(fake_brokers, ("a", "bulk", 64), ("b", "bulk", 64))
    try:
        runs = [Saturate(load, inflight).start() for load, inflight in zip(loads, (6, 2), strict=True)]
        time.sleep(0.5)
        t0 = time.monotonic()
        time.sleep(2.5)
        moved = [run.bytes_between(t0, time.monotonic()) for run in runs]
        for run in runs:
            run.stop()
        assert min(moved) > 0, moved
        shares = [m / sum(moved) for m in moved]
        assert all(abs(s - 0.5) <= 0.075 for s in shares), f"shares {shares} (bytes {moved})"
    finally:
        for load in loads:
            load.close()


def test_a_low_class_completes_under_a_sustained_high_load(fake_brokers) -> None:  # type: ignore[no-untyped-def]
    """Interactive rooms keep the window full; bulk rooms opened meanwhile still finish, byte-exact
    (the floor share), while the interactive load goes on."""
    chat, bulk = _loads(fake_brokers, ("chat", "interactive", 64), ("bulk", "bulk", 64))
    try:
        busy = Saturate(chat, 3).start()
        time.sleep(0.3)
        latencies = timed_rooms(bulk, 4, 0.0, timeout_seconds=20)
        assert len(latencies) == 4
        before = len(busy.done)
        time.sleep(0.2)
        assert len(busy.done) > before, "the interactive load stopped"
        busy.stop()
    finally:
        chat.close()
        bulk.close()


def test_on_the_device_path_an_interactive_room_passes_a_bulk_backlog(fake_brokers) -> None:  # type: ignore[no-untyped-def]
    """KV in (fake) VRAM: packed parts wait for send slots, credits in the receiver's transfer buffer
    and the copy thread; behind a bulk backlog there, 1-page interactive rooms take a fraction of what
    they take with --no-priorities."""
    medians = {}
    for priorities in (True, False):
        cuda = FakeCudaLib(devices=1, granularity=4096)
        device = {"device_part_bytes": 256 << 10, "device_send_bytes": 1 << 20, "device_receive_bytes": 1 << 20}
        bulk, chat = _loads(fake_brokers, ("bulk", "bulk", 256), ("chat", "interactive", 1), cuda=cuda, priorities=priorities,
                            **device)
        try:
            medians[priorities] = _median_behind_backlog(bulk, chat)
        finally:
            bulk.close()
            chat.close()
    assert medians[True] * 2 < medians[False], medians


def test_an_interactive_part_takes_the_slot_and_credit_that_bulk_parts_leave_free(fake_brokers, finished_spans) -> None:  # type: ignore[no-untyped-def]
    """On a modelled GPU whose every copy takes 150 ms, bulk parts (a room each) hold every send slot
    and credit they may take for hundreds of milliseconds; an interactive room's part is still
    admitted as soon as it is handed on (under 50 ms: a third of one copy), because a part's slot and
    its credit are kept free of bulk. Without that it waits for a bulk part's gather and write to
    give a slot back (and fails this). Read from the parts' spans: from handed on to its credit."""
    cuda = FakeCudaLib(devices=1, granularity=4096)
    streams = ModelledStreams(ModelSetting(GpuModel(launch_us=150_000)), Timelines())
    device = {"device_part_bytes": 256 << 10, "device_send_bytes": 1 << 20, "device_receive_bytes": 1 << 20}  # 4 parts
    bulk, chat = _loads(fake_brokers, ("bulk", "bulk", 16), ("chat", "interactive", 1), cuda=cuda, streams=streams, **device)
    try:
        busy = Saturate(bulk, 6).start()
        time.sleep(0.8)
        finished_spans.clear()
        timed_rooms(chat, 5, 0.3)
        busy.stop()
    finally:
        bulk.close()
        chat.close()
    spans = [s.attributes or {} for s in finished_spans.get_finished_spans() if s.name == "kvbroker.transfer"]
    waits = sorted(a["kvbroker.t.credit"] - a["kvbroker.t.handed_on"] for a in spans if "kvbroker.t.credit" in a and a["kvbroker.bytes"] < 64 << 10)
    assert len(waits) >= 4, waits
    assert waits[len(waits) // 2] < 0.05, waits


def test_an_interactive_room_passes_a_bulk_backlog_and_fifo_brokers_do_not(fake_brokers) -> None:  # type: ignore[no-untyped-def]
    """Behind a bulk backlog in the send window, 1-page interactive rooms take a fraction of what
    they take with --no-priorities (the same load, first come first served). GetStats shows the
    send window's work by class and engine group: the interactive parts waited less each."""
    medians, rows = {}, {}
    for priorities in (True, False):
        bulk, chat = _loads(fake_brokers, ("bulk", "bulk", 256), ("chat", "interactive", 1), priorities=priorities)
        try:
            medians[priorities] = _median_behind_backlog(bulk, chat)
            with grpc.insecure_channel(bulk.clients[0].address) as channel:
                stats = admin_pb2_grpc.AdminStub(channel).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
            rows[priorities] = {(q.priority, q.engine): q for q in stats.queues if q.queue == "send_window"}
        finally:
            bulk.close()
            chat.close()
    assert medians[True] * 2 < medians[False], medians
    chat_row = rows[True][(common_pb2.ROOM_PRIORITY_INTERACTIVE, "chat-prefill")]
    bulk_row = rows[True][(common_pb2.ROOM_PRIORITY_BULK, "bulk-prefill")]
    assert chat_row.served and bulk_row.served and chat_row.waiting == bulk_row.waiting == 0
    assert bulk_row.bytes > chat_row.bytes > 0
    assert chat_row.waited_seconds / chat_row.served < bulk_row.waited_seconds / bulk_row.served
    assert set(rows[False]) == {(common_pb2.ROOM_PRIORITY_STANDARD, "")}, "--no-priorities: no classes, no engines"


def test_an_interactive_room_passes_a_bulk_backlog_of_its_own_engine(fake_brokers) -> None:  # type: ignore[no-untyped-def]
    """One engine pair's own interactive 1-page rooms behind its own bulk backlog: they take a
    fraction of what they take with --no-priorities. Fair shares between engines cannot give
    this (there is one engine): only the classes can."""
    medians = {}
    for priorities in (True, False):
        p, d = fake_brokers("p", **SMALL_WINDOW, priorities=priorities), fake_brokers("d", priorities=priorities)
        p.agent.wire_bps = WIRE_BPS
        bulk = RoomLoad.register(p.address, d.address, name="one", model=MODEL, room_pages=256, slots=3,
                                 priority="bulk", spare_pages=6)
        chat = bulk.alongside(priority="interactive", room_pages=1, slots=6)
        try:
            medians[priorities] = _median_behind_backlog(bulk, chat)
        finally:
            chat.close()
            bulk.close()
    assert medians[True] * 2 < medians[False], medians


def test_the_copy_thread_takes_a_scatter_of_a_higher_class_first() -> None:
    """Jobs waiting for the copy thread (gathers, scatters, GPU launches) go by ticket: an
    interactive room's scatter queued behind bulk ones runs first; jobs without a ticket keep
    their order."""

    async def run() -> list[str]:
        workers = Workers()
        order: list[str] = []
        gate = threading.Event()
        try:
            first = workers.copy_soon(lambda: gate.wait(5))
            await asyncio.sleep(0.05)  # the thread is in the first job
            jobs = [
                workers.copy_soon(lambda name=name: order.append(name), ticket)
                for name, ticket in (
                    ("bulk-1", Ticket(Priority.BULK, "a", 1 << 20)),
                    ("bulk-2", Ticket(Priority.BULK, "a", 1 << 20)),
                    ("chat", Ticket(Priority.INTERACTIVE, "b", 4096)),
                    ("plain-1", None),
                    ("plain-2", None),
                )
            ]
            await asyncio.sleep(0.05)
            gate.set()
            await asyncio.gather(first, *jobs)
        finally:
            workers.shutdown()
        return order

    order = asyncio.run(run())
    assert order[0] == "chat" and order.index("plain-1") < order.index("plain-2") and order.index("bulk-1") < order.index("bulk-2")

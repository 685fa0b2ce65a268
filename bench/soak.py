"""Soak test: many rooms through two brokers for a set time, with faults injected.

    python bench/soak.py --minutes 10 [--fault-rate 0.1] [--kill-every 45] [--restart-every 120] [--json]
    python bench/soak.py --fake-vram --minutes 5     # the device path on fake GPUs (CPU only)
    python bench/soak.py --device cuda --minutes 3   # the device path on cuda:0

The run, its faults and what fails it: docs/benchmarks.md. The decode rank lives in this process (``Soak``)
and checks every byte of every SUCCESS room; the prefill ranks are child processes (``PrefillEngine``). A
room in flight when a fault hits carries its tag; a failure its tags do not explain is listed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import heapq
import os
import random
import secrets
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import harness as h
import numpy as np
import torch

from kvbroker.brokerproc import BrokerProcess
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.errors import KvBrokerError, NotFound, Unavailable
from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
from kvbroker.testing.fake_gpu import FAKE_GPUS_ENV, GRANULARITY
from kvbroker.testing.gpu_model import MODEL_ENV
from kvbroker.testing.pattern import fill_rank, verify_room, write_aux
from kvbroker.testing.room_plan import plan_room, pool_pages
from kvbroker.v1 import common_pb2

MODEL = h.model_spec(4, kv_heads=4, head_dim=32)
AUX_ROW_BYTES = [32]
PREFILL_POOL_PAGES = 256
FINAL = (RoomState.SUCCESS, RoomState.FAILED)
STEADY, VICTIM, DECODE_GROUP = "soak-steady", "soak-victim", "soak-decode"
#: The failure causes a room carrying a fault's tag may end with.
EXPECTED_CAUSE = {"abort-decode": {"ABORTED"}, "abort-prefill": {"ABORTED"}, "engine-kill": {"ENGINE_LOST"},
                  "broker-restart": {"PEER"}, "sender-error": {"ABORTED"}, "stuck": {"ABORTED"}}


#: Where the ranks' KV lives (``--fake-vram``, ``--device``); in VRAM it moves as packed parts (the device path).
KV_PLACES = {"dram": "host memory (DRAM)", "fake-vram": f"fake VRAM (brokers with {FAKE_GPUS_ENV}=1)", "cuda": "VRAM of cuda:0"}


def allocate(spec: RankSpec, kv: str, num_pages: int, aux_rows: int) -> EngineMemory:
    """A rank's memory, its KV where ``kv`` says (:data:`KV_PLACES`). Fake VRAM is host memory that the broker takes
    for VRAM of a fake driver of this process (``as_fake_vram``): the rank's tensors stay views of it."""
    memory = EngineMemory.allocate(spec, MODEL, num_pages=num_pages, aux_rows=aux_rows, aux_row_bytes=AUX_ROW_BYTES,
                                   device="cuda:0" if kv == "cuda" else "cpu")
    if kv == "fake-vram":
        as_fake_vram(memory, FakeCudaLib(devices=1, granularity=GRANULARITY))
    return memory


def written(memory: EngineMemory) -> None:
    """Let what this process wrote into ``memory`` land before a broker reads or writes it (VRAM: the stream's work)."""
    if memory.raw is not None:
        h.sync(memory.raw.device)


def kind_name(kind: int) -> str:
    return common_pb2.FailureKind.Name(kind).removeprefix("FAILURE_KIND_")


def mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f} MiB"


def buffers_held(stats: Any) -> dict[str, int]:
    """What a broker's ``GetStats`` says it holds (nonzero only): bytes reserved in its send buffers (send slots, host
    staging and GPU transfer buffers), in its receive buffers (receive slots and the credits it granted), and work
    waiting in each queue (``send_slots``, ``receive_slots``, ``credits``, ...)."""
    held = collections.Counter({"send_bytes": stats.staging_send_bytes_in_use, "receive_bytes": stats.staging_receive_bytes_in_use})
    for row in stats.queues:
        held[f"{row.queue}_waiting"] += row.waiting
    return {k: v for k, v in held.items() if v}


def device_counters(stats: Any, side: str) -> dict[str, int]:
    """A broker's device-path counters (``GetStats``): the packed parts it sent, its device launches (gathers, scatters)."""
    return {f"{side}_packed_parts": stats.transfers_packed, f"{side}_device_launches": stats.device_launches}


class BrokerGone(Exception):
    pass


@dataclass
class SendingRoom:
    sender: Any
    src: list[int]
    bounds: list[tuple[int, int]]
    abort_after: int | None
    gap: float
    next_chunk: int = 0


class PrefillEngine:
    """One prefill rank that sends the rooms the soak orders, and survives its broker. Messages to the soak: ("ready",
    reason, attempts, last refusal), ("final", room, state, cause, message), ("error", room,
    message), ("lost", rooms, reason), ("note", room, text), ("crash", traceback), ("stopped", unfinished rooms)."""

    def __init__(self, address: str, group: str, slots: int, kv: str, conn: Any) -> None:
        self.address, self.spec, self.slots, self.conn = address, RankSpec(group=group, role="prefill"), slots, conn
        self.client: BrokerClient | None = None
        self.engine: Any = None
        # Filled once; registered again with each broker incarnation, as an engine keeps its KV cache.
        self.memory = allocate(self.spec, kv, PREFILL_POOL_PAGES, slots)
        fill_rank(self.memory, MODEL, self.spec)
        written(self.memory)
        self.open: dict[int, SendingRoom] = {}
        self.actions: list[tuple[float, int, int, str]] = []  # (when, seq, room, "chunk" or "abort"), a heap
        self.seq, self.stopping_since = 0, None

    def connect(self, reason: str) -> None:
        attempts, last = 0, ""
        while True:
            attempts += 1
            client = None
            try:
                client = BrokerClient(self.address, timeout_seconds=5)
                engine = client.register_engine(self.spec, self.memory)
            except (KvBrokerError, OSError) as exc:
                last = str(exc)
                h.release(None, client)
                time.sleep(0.2)
                continue
            self.client, self.engine = client, engine
            self.conn.send(("ready", reason, attempts, last[:300]))
            return

    def disconnect(self) -> None:
        h.release(self.engine, self.client)
        self.engine = self.client = None

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a broker call; BrokerGone when the broker (or our registration) went away."""
        try:
            return fn(*args, **kwargs)
        except Unavailable as exc:
            raise BrokerGone(str(exc)) from None
        except NotFound as exc:
            if "is not registered with this broker" in exc.message:
                raise BrokerGone(str(exc)) from None
            raise

    def schedule(self, delay: float, room: int, what: str) -> None:
        self.seq += 1
        heapq.heappush(self.actions, (time.monotonic() + delay, self.seq, room, what))

    def fail(self, room: int, what: str, exc: Exception) -> None:
        self.open.pop(room, None)
        self.conn.send(("error", room, f"{what}: {exc}"[:400]))

    def begin(self, room: int, src: list[int], bounds: list[tuple[int, int]], slot: int, abort_after: int | None, gap: float) -> None:
        write_aux(self.memory, room, slot)
        written(self.memory)
        sender = self.engine.sender(room)
        # Open before the call: a BrokerGone from it reports the room as lost.
        self.open[room] = SendingRoom(sender, src, bounds, abort_after, gap)
        try:
            self.call(sender.init, num_pages=len(src), aux_row=slot)
        except KvBrokerError as exc:
            return self.fail(room, "BeginSend", exc)
        if abort_after == -1:
            self.schedule(gap, room, "abort")
        else:
            self.chunk(room)

    def chunk(self, room: int) -> None:
        state = self.open.get(room)
        if state is None:
            return
        i = state.next_chunk
        a, b = state.bounds[i]
        last = i == len(state.bounds) - 1
        try:
            self.call(state.sender.send, np.asarray(state.src[a:b], dtype=np.int32), is_last=last)
        except KvBrokerError as exc:
            return self.fail(room, f"SendChunk {i}", exc)
        state.next_chunk += 1
        if state.abort_after == i:
            self.schedule(state.gap, room, "abort")
        elif not last:
            self.schedule(state.gap, room, "chunk")

    def abort(self, room: int, reason: str) -> None:
        state = self.open.get(room)
        try:
            if state is not None:
                self.call(state.sender.abort, reason)
        except KvBrokerError as exc:
            self.conn.send(("note", room, f"sender abort: {exc}"[:400]))

    def poll_open(self) -> None:
        for room, status in (self.call(self.engine.poll, list(self.open)) if self.open else {}).items():
            if status.state in FINAL and room in self.open:
                del self.open[room]
                cause = kind_name(status.cause.kind) if status.state == RoomState.FAILED else ""
                self.conn.send(("final", room, RoomState(status.state).name, cause, status.cause.message[:400]))

    def handle(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "room":
            self.begin(*msg[1:])
        elif msg[0] == "abort":
            self.abort(msg[1], "soak: the decode side could not open the room")
        elif msg[0] == "stop":
            self.stopping_since = time.monotonic()

    def run(self) -> None:
        self.connect("start")
        next_poll = next_session_check = 0.0
        while True:
            try:
                now = time.monotonic()
                wait = min(0.02, max(0.0, next_poll - now))
                if self.actions:
                    wait = min(wait, max(0.0, self.actions[0][0] - now))
                if self.conn.poll(wait):
                    for _ in range(64):
                        self.handle(self.conn.recv())
                        if not self.conn.poll(0):
                            break
                now = time.monotonic()
                while self.actions and self.actions[0][0] <= now:
                    _, _, room, what = heapq.heappop(self.actions)
                    if what == "chunk":
                        self.chunk(room)
                    else:
                        self.abort(room, "soak: prefill abort")
                if now >= next_poll:
                    next_poll = now + 0.02
                    self.poll_open()
                if now >= next_session_check:
                    next_session_check = now + 0.2
                    if self.engine is None or self.engine.broker_gone():  # the broker closed our fd-socket session
                        raise BrokerGone("the broker closed the engine session (fd socket EOF)")
                if self.stopping_since is not None and (not self.open or now - self.stopping_since > 30):
                    unfinished = list(self.open)
                    self.disconnect()
                    self.memory.close()
                    self.conn.send(("stopped", unfinished))
                    return
            except KvBrokerError as exc:
                # A call that failed for another reason (a deadline on a loaded machine): go on.
                self.conn.send(("note", 0, f"{exc}"[:400]))
                time.sleep(0.05)
            except BrokerGone as exc:
                lost = list(self.open)
                self.open.clear()
                self.actions.clear()
                self.conn.send(("lost", lost, str(exc)[:400]))
                self.disconnect()
                if self.stopping_since is not None:
                    self.memory.close()
                    self.conn.send(("stopped", lost))
                    return
                self.connect(str(exc)[:200])


def prefill_engine_main(conn: Any, address: str, group: str, slots: int, kv: str, log_path: str) -> None:
    torch.set_num_threads(1)
    try:
        PrefillEngine(address, group, slots, kv, conn).run()
    except BaseException:
        with open(log_path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} pid {os.getpid()} crashed:\n{traceback.format_exc()}\n")
        with contextlib.suppress(Exception):
            conn.send(("crash", traceback.format_exc()[-2000:]))
        raise


@dataclass
class Room:
    id: int
    child: Any  # the Child (prefill engine) that sends it
    slot: int
    src: list[int]
    dst: list[int]
    started: float
    fault: str | None
    #: The faults that hit this room, and when (monotonic).
    tags: dict[str, float] = field(default_factory=dict)
    abort_at: float | None = None
    decode_state: str | None = None
    decode_cause: str = ""
    decode_final_at: float | None = None
    settled: bool = False
    sender_state: str | None = None

    def tag(self, what: str) -> None:
        self.tags.setdefault(what, time.monotonic())

    def tag_list(self) -> str:
        return ",".join(sorted(self.tags)) or "no fault"

    def timing(self) -> str:
        now = time.monotonic()
        return ", ".join([f"{now - self.started:.1f} s after it opened"] + [
            f"{now - at:.1f} s after {what}" for what, at in self.tags.items()
            if what in ("engine-kill", "broker-restart", "broker-died")])


class Tally:
    """The outcomes of the rooms: counts, failures by cause and by fault, the sender side's outcomes, where the two
    sides disagree, and examples of each (``examples``: "cause X", "unexpected", "sender X", "mismatch")."""

    def __init__(self) -> None:
        Counter, defaultdict = collections.Counter, collections.defaultdict
        self.counts: collections.Counter[str] = Counter()
        self.failed_by_cause: collections.Counter[str] = Counter()
        self.by_fault: dict[str, collections.Counter[str]] = defaultdict(Counter)
        self.sender_outcomes: collections.Counter[str] = Counter()
        self.disagree: collections.Counter[str] = Counter()
        self.examples: dict[str, list[str]] = defaultdict(list)
        self.fault_latency: dict[str, list[float]] = defaultdict(list)
        self.reregister: dict[str, list[float]] = defaultdict(list)

    def example(self, key: str, limit: int, text: str) -> None:
        if len(self.examples[key]) < limit:
            self.examples[key].append(text)

    def failure(self, room: Room, cause: str, message: str) -> None:
        """The decode side of ``room`` failed with ``cause``."""
        self.counts["rooms_failed"] += 1
        self.failed_by_cause[cause] += 1
        self.example(f"cause {cause}", 3, f"room {room.id} [{room.tag_list()}] ({room.timing()}): {message[:300]}")
        expected = set().union(*(EXPECTED_CAUSE.get(t, set()) for t in room.tags))
        bare = cause.removeprefix("FAILED ")
        for tag in ("engine-kill", "broker-restart"):
            if tag in room.tags:
                self.fault_latency[tag].append(time.monotonic() - room.tags[tag])
        if bare not in expected:
            self.counts["rooms_failed_unexpectedly"] += 1
            self.example("unexpected", 10, f"room {room.id} [{room.tag_list()}] {cause} ({room.timing()}): {message[:300]}")
        for tag in room.tags or {"none"}:
            self.by_fault[tag][bare] += 1

    def checked(self, room: Room, problems: list[str]) -> None:
        """The decode side of ``room`` succeeded; ``problems``: how its bytes differ (none: verified)."""
        if problems:
            self.counts["byte_mismatches"] += 1
            return self.example("mismatch", 10, f"room {room.id} [{room.tag_list()}]: {'; '.join(problems[:3])}")
        self.counts["rooms_verified"] += 1
        self.counts["aborted_rooms_that_succeeded"] += bool(room.fault)
        for tag in room.tags or {"none"}:
            self.by_fault[tag]["SUCCESS"] += 1

    def sender(self, room: Room | None, outcome: str, message: str) -> None:
        """The sender side of ``room`` ended with ``outcome`` (only its first counts)."""
        if room is None or room.sender_state is not None:
            return
        room.sender_state = outcome
        self.sender_outcomes[outcome] += 1
        if outcome != "SUCCESS" and message:
            self.example(f"sender {outcome}", 3, f"room {room.id}: {message}")

    def released(self, room: Room) -> None:
        """``room`` is done with: note it if its two sides ended differently."""
        if room.sender_state == "SUCCESS" and room.decode_state == "FAILED":
            # The sender's broker moved every chunk, yet the receiver failed (an abort racing the
            # end is fine; with no abort tag it is worth a look).
            self.disagree[f"sender SUCCESS, decode FAILED {room.decode_cause} [{'aborted' if room.fault else room.tag_list()}]"] += 1
        elif room.decode_state == "SUCCESS" and room.sender_state not in (None, "SUCCESS"):
            self.disagree[f"decode SUCCESS, sender {room.sender_state} [{room.tag_list()}]"] += 1
        elif room.sender_state == "FAILED TIMEOUT":
            # The sender waited out its transfer-info timeout: say what the decode side did.
            self.disagree[f"sender FAILED TIMEOUT, decode {room.decode_state} {room.decode_cause or ''} [{room.tag_list()}]"] += 1


@dataclass
class Child:
    name: str
    group: str
    killable: bool
    process: Any = None
    conn: Any = None
    ready: bool = False
    incarnation: int = 0
    since: float = 0.0
    rooms: set[int] = field(default_factory=set)


@dataclass
class Incarnation:
    n: int
    broker: BrokerProcess
    started_at: float
    rss_warm_kib: int | None = None
    rss_last_kib: int | None = None
    ended: str = "running"


class Soak:
    """The brokers, the prefill children, the decode rank and its rooms, and the faults."""

    def __init__(self, args: argparse.Namespace, held: h.Held) -> None:
        self.args, self.held, self.workdir = args, held, held.workdir
        self.rng = random.Random(args.seed)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.prefill_address = f"127.0.0.1:{s.getsockname()[1]}"
        self.broker_args = [
            "--peer-heartbeat", str(args.peer_heartbeat), "--peer-dead-after", str(args.peer_dead_after), "--finished-room-ttl",
            str(args.finished_room_ttl), "--tombstone-ttl", str(args.tombstone_ttl), "--orphan-timeout", "15", "--bootstrap-timeout",
            "15", "--sender-info-timeout", "30", "--receiver-data-timeout", "60", "--transfer-timeout", "30",
            "--unregister-settle-timeout", "5", "--device-buffer-mib", str(args.device_buffer_mib), "--device-part-mib",
            str(args.device_part_mib), "--log-level", args.broker_log_level]
        # --fake-vram: the brokers' device path runs on a fake CUDA driver (kvbroker.testing.fake_gpu), its GPU
        # lanes (copies launched and checked on kvb-nixl) on a modelled GPU unless --gpu-model none.
        self.broker_env = {**os.environ, FAKE_GPUS_ENV: "1"} if args.kv == "fake-vram" else None
        if self.broker_env is not None and args.gpu_model != "none":
            self.broker_env[MODEL_ENV] = args.gpu_model
        self.t0, self.duration = time.monotonic(), args.minutes * 60.0
        self.prefill: BrokerProcess | None = None
        self.decode_broker: BrokerProcess | None = None
        self.incarnations: list[Incarnation] = []
        self.children: list[Child] = []
        self.tally = Tally()
        self.counts = self.tally.counts
        self.events: list[str] = []  # what happened, with when; then what no injected fault explains
        self.broker_deaths: list[str] = []
        self.engine_crashes: list[str] = []
        self.rss_decode: dict[str, int | None] = {}
        #: The device path's counters of the prefill incarnations killed (read just before the kill).
        self.device_counts: collections.Counter[str] = collections.Counter()
        self.last_stats: dict[str, Any] = {}  # each broker's last GetStats (buffers_free)
        self.last_fault_at = self.next_kill = self.next_restart = 0.0
        self.last_progress = (0.0, 0)
        self.stopping_children = False
        # The decode side: its rank, the rooms in flight by id, the destination slots free.
        self.spec = RankSpec(group=DECODE_GROUP, role="decode")
        self.memory: Any = None
        self.engine: Any = None
        self.rooms: dict[int, Room] = {}
        self.room_ids = secrets.randbits(30) << 24
        self.free_slots = list(range(args.slots))

    def event(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {text}"
        self.events.append(line)
        if self.args.verbose:
            self.held.say(line)

    def start_prefill_broker(self) -> None:
        n = len(self.incarnations) + 1
        for attempt in range(10):
            broker = BrokerProcess.launch(f"prefill-{n}", self.workdir, [*self.broker_args, "--listen", self.prefill_address],
                                          env=self.broker_env)
            try:
                # Keep watching the decode rooms meanwhile: a room that ends
                # now is evicted after --finished-room-ttl, maybe before this returns.
                broker.wait_ready(60, while_waiting=self.poll)
            except RuntimeError as exc:
                self.event(f"prefill broker #{n} did not start (attempt {attempt + 1}): {str(exc)[-300:]}")
                time.sleep(0.5)
                continue
            self.check_fake_gpu(broker)
            self.prefill = broker
            self.incarnations.append(Incarnation(n, broker, time.monotonic()))
            return
        raise RuntimeError("the prefill broker could not be restarted on its port")

    def check_fake_gpu(self, broker: BrokerProcess) -> None:
        if self.args.kv == "fake-vram" and "FAKE GPU" not in broker.log_tail(100_000):
            raise h.BenchFailed(f"broker {broker.name} does not say it runs on a fake GPU ({FAKE_GPUS_ENV})")

    def prefill_gone(self, ended: str, what: str) -> None:
        """The prefill broker was killed or died: its children re-register, rooms not yet ended carry ``what``."""
        self.incarnations[-1].ended = ended
        for child in self.children:
            child.ready = False
        for room in self.rooms.values():
            if room.decode_state is None:
                room.tag(what)

    def restart_prefill_broker(self) -> None:
        assert self.prefill is not None
        inc = self.incarnations[-1]
        inc.rss_last_kib = h.rss(self.prefill.process.pid, 1024)
        try:
            self.device_counts.update(device_counters(self.prefill.stats(timeout_seconds=2), "prefill"))
        except Exception as exc:  # its parts go uncounted: only a figure of the summary
            self.event(f"GetStats of prefill broker #{inc.n} before its kill failed: {exc}")
        self.prefill_gone("killed", "broker-restart")
        self.prefill.kill()
        self.counts["broker_restarts"] += 1
        self.event(f"SIGKILL prefill broker #{inc.n} (pid {inc.broker.process.pid}, RSS {mib(inc.rss_last_kib)}), {len(self.rooms)} rooms in flight")
        restarted = time.monotonic()
        self.start_prefill_broker()
        for child in self.children:
            child.since = restarted
        self.event(f"prefill broker #{self.incarnations[-1].n} serves on the same port after {time.monotonic() - restarted:.1f} s")

    def check_brokers(self) -> bool:
        """False when the decode broker died (the soak cannot go on)."""
        assert self.prefill is not None and self.decode_broker is not None
        for name, broker in (("decode broker", self.decode_broker), (f"prefill broker #{self.incarnations[-1].n}", self.prefill)):
            if broker.process.poll() is None:
                continue
            msg = f"{name} died (exit {broker.process.returncode}); log tail:\n{broker.log_tail(3000)}"
            self.broker_deaths.append(msg)
            self.event(msg)
            if broker is self.decode_broker:
                return False
            self.prefill_gone(f"died (exit {broker.process.returncode})", "broker-died")
            self.start_prefill_broker()
        return True

    def start_child(self, child: Child) -> None:
        child.incarnation += 1
        started = h.spawn(f"soak-{child.name}-{child.incarnation}", prefill_engine_main, self.prefill_address, child.group,
                          self.args.slots, self.args.kv, str(self.workdir / f"engine-{child.name}.log"))
        child.process, child.conn, child.ready, child.since = started.proc, started.conn, False, time.monotonic()

    def child_gone(self, child: Child, tag: str, state: str) -> int:
        """``child``'s rooms not yet ended carry ``tag``, and end ``state`` on the sender side; how many were open."""
        lost = 0
        for rid in list(child.rooms):
            room = self.rooms[rid]
            if room.decode_state is None:
                room.tag(tag)
            if room.sender_state is None:
                room.sender_state = state
                lost += 1
        return lost

    def kill_child(self, child: Child) -> None:
        child.process.kill()
        child.process.join()
        child.conn.close()
        child.ready = False
        lost = self.child_gone(child, "engine-kill", "KILLED")
        self.tally.sender_outcomes["KILLED"] += lost
        self.counts["engine_kills"] += 1
        self.event(f"SIGKILL {child.name} #{child.incarnation} (pid {child.process.pid}), {lost} of its rooms open")
        self.start_child(child)

    def read_children(self) -> None:
        for child in self.children:
            while child.conn is not None:
                try:
                    if not child.conn.poll(0):
                        break
                    msg = child.conn.recv()
                except (EOFError, OSError):
                    break
                self.on_child(child, msg)
            if child.process is not None and child.process.exitcode is not None and not self.stopping_children:
                crash = (f"{child.name} #{child.incarnation} exited on its own (exit {child.process.exitcode}); "
                         f"see {self.workdir}/engine-{child.name}.log")
                self.engine_crashes.append(crash)
                self.event(crash)
                self.child_gone(child, "engine-crash", "CRASHED")
                child.conn.close()
                self.start_child(child)

    def on_child(self, child: Child, msg: tuple[Any, ...]) -> None:
        what = msg[0]
        if what == "ready":
            _, reason, attempts, last = msg
            child.ready = True
            waited = time.monotonic() - child.since
            key = "after broker restart" if reason != "start" else "after engine kill" if child.incarnation > 1 else "first start"
            self.tally.reregister[key].append(waited)
            self.event(f"{child.name} #{child.incarnation} registered ({key}; {attempts} attempts, {waited:.1f} s; last refusal: {last or '-'})")
        elif what == "final":
            _, rid, state, cause, message = msg
            self.tally.sender(self.rooms.get(rid), state if state == "SUCCESS" else f"FAILED {cause}", message)
        elif what == "error":
            _, rid, message = msg
            room = self.rooms.get(rid)
            self.tally.sender(room, "CALL_ERROR", message)
            if room is not None and room.decode_state is None:
                room.tag("sender-error")
                self.abort(room, "soak: the prefill side could not send")
        elif what == "lost":
            child.ready = False
            for rid in msg[1]:
                self.tally.sender(self.rooms.get(rid), "LOST", msg[2])
        elif what == "note":
            self.event(f"{child.name}: room {msg[1]}: {msg[2]}")
        elif what == "crash":
            self.engine_crashes.append(f"{child.name} #{child.incarnation}: {msg[1]}")
        elif what == "stopped":
            child.ready = False
            for rid in msg[1]:
                self.tally.sender(self.rooms.get(rid), "UNFINISHED_AT_STOP", "")

    def open_room(self, child: Child, faults: bool) -> None:
        """Open a room on a free slot, sent by ``child`` (``faults``: it may be aborted on purpose)."""
        args, rng = self.args, self.rng
        slot = self.free_slots.pop(0)
        n = rng.randint(args.min_pages, args.max_pages)
        # Each side's pages: runs in shuffled order, within pool_pages(n, 1) pages from a random base (src) or the slot's.
        plan = plan_room(seed=args.seed, index=self.counts["rooms_started"], room_base=0, pages=n, chunks=1, window=1)
        src = (plan.src_pages + rng.randrange(0, PREFILL_POOL_PAGES - pool_pages(n, 1) + 1)).tolist()
        dst = (plan.dst_pages + slot * pool_pages(args.max_pages, 1)).tolist()
        nchunks = rng.randint(1, min(4, n))
        edges = [0, *(sorted(rng.sample(range(1, n), nchunks - 1)) if nchunks > 1 else []), n]
        fault = rng.choice(["abort-decode", "abort-prefill"]) if faults and rng.random() < args.fault_rate else None
        abort_after = None
        if fault == "abort-prefill":
            abort_after = rng.randrange(-1, nchunks - 1) if nchunks > 1 else -1
        gap = rng.uniform(0, 0.02)
        self.room_ids += 1
        rid = self.room_ids
        room = Room(rid, child, slot, src, dst, time.monotonic(), fault)
        if fault:
            room.tag(fault)
            self.counts[f"aborts_{fault.removeprefix('abort-')}"] += 1
        if fault == "abort-decode":
            room.abort_at = time.monotonic() + rng.uniform(0, 0.06)
        # Zero the destination so a page the broker did not write cannot pass.
        idx = torch.as_tensor(dst, dtype=torch.int64, device=self.memory.raw.device)
        for layer in range(MODEL.num_layers):
            for t in self.memory.kv_tensors(layer):
                t[idx] = 0
        for aux in self.memory.aux:
            aux[slot].zero_()
        written(self.memory)
        self.rooms[rid] = room
        child.rooms.add(rid)
        self.counts["rooms_started"] += 1
        order = ("room", rid, src, list(zip(edges[:-1], edges[1:])), slot, abort_after, gap)
        receiver_first = rng.random() < 0.5
        if not receiver_first:
            child.conn.send(order)
        try:
            self.engine.receiver(rid, SenderRef(self.prefill_address, child.group)).init(dst, aux_row=slot)
        except KvBrokerError as exc:
            room.decode_state, room.decode_cause = "INIT_ERROR", type(exc).__name__
            room.decode_final_at, room.settled = time.monotonic(), True
            self.counts["decode_init_errors"] += 1
            self.tally.failure(room, f"INIT_ERROR {type(exc).__name__}", str(exc))
            if not receiver_first:
                child.conn.send(("abort", rid))
            else:
                room.sender_state = "NOT_SENT"
            return
        if receiver_first:
            child.conn.send(order)

    def abort(self, room: Room, reason: str) -> None:
        try:
            self.engine.receiver(room.id, SenderRef(self.prefill_address, room.child.group)).abort(reason)
        except KvBrokerError as exc:
            self.event(f"room {room.id}: decode abort failed: {exc}")

    def poll(self) -> None:
        """Watch the rooms: see them end (check the bytes of those that succeed) and settle."""
        ids = [r.id for r in self.rooms.values() if r.decode_state is None or not r.settled]
        now = time.monotonic()
        for rid, status in (self.engine.poll(ids) if ids else {}).items():
            room = self.rooms.get(rid)
            if room is None:
                continue
            if room.decode_state is None and status.state in FINAL:
                room.decode_final_at, room.abort_at = now, None
                if status.state == RoomState.SUCCESS:
                    room.decode_state = "SUCCESS"
                    self.tally.checked(room, verify_room(self.memory, MODEL, self.spec, src_pages=np.asarray(room.src),
                                                         dst_pages=np.asarray(room.dst), room=room.id, aux_row=room.slot))
                else:
                    cause = kind_name(status.cause.kind)
                    room.decode_state, room.decode_cause = "FAILED", cause
                    self.tally.failure(room, cause, status.cause.message)
            # Unknown to the broker (or evicted after we saw it end): nothing of it can still write.
            if room.decode_state is not None and (status.pages_settled or status.state == RoomState.FAILED
                                                  and status.cause.kind == common_pb2.FAILURE_KIND_UNKNOWN_ROOM):
                room.settled = True

    def retire_finished(self) -> None:
        """Let go of the rooms both sides are done with; abort those stuck open."""
        now, stuck_after = time.monotonic(), self.args.stuck_after
        for rid in list(self.rooms):
            room = self.rooms[rid]
            if room.decode_state is not None and room.settled and room.sender_state is not None:
                self.release(room, keep_slot=True)
                continue
            age = now - room.started
            if room.decode_state is None and age > stuck_after and "stuck" not in room.tags:
                room.tag("stuck")
                self.counts["stuck_rooms"] += 1
                self.event(f"room {rid} still open on the decode side after {age:.0f} s; aborting it")
                self.abort(room, "soak: stuck")
            elif room.decode_final_at is not None and now - room.decode_final_at > stuck_after:
                if not room.settled:
                    self.counts["rooms_never_settled"] += 1
                    self.event(f"room {rid}: decode pages not settled {stuck_after:.0f} s after {room.decode_state}; slot {room.slot} retired")
                    self.release(room, keep_slot=False)
                elif room.sender_state is None:
                    self.counts["sender_never_finished"] += 1
                    self.event(f"room {rid}: no sender-side outcome {stuck_after:.0f} s after the decode side ended")
                    self.release(room, keep_slot=True)

    def release(self, room: Room, keep_slot: bool) -> None:
        self.tally.released(room)
        del self.rooms[room.id]
        room.child.rooms.discard(room.id)
        if keep_slot:  # else the slot is retired: its pages may still be written
            self.free_slots.append(room.slot)

    def faults_on(self) -> bool:
        return self.args.warmup <= time.monotonic() - self.t0 <= self.duration - self.args.quiet_tail

    def maybe_fault(self) -> None:
        now = time.monotonic()
        if not self.faults_on() or now - self.last_fault_at < 10:
            return
        victim = next(c for c in self.children if c.killable)
        if self.args.kill_every > 0 and now >= self.next_kill and victim.ready:
            self.kill_child(victim)
            self.next_kill = now + self.args.kill_every * self.rng.uniform(0.7, 1.3)
            self.last_fault_at = now
        elif self.args.restart_every > 0 and now >= self.next_restart and all(c.ready for c in self.children):
            self.restart_prefill_broker()
            self.next_restart = now + self.args.restart_every * self.rng.uniform(0.7, 1.3)
            self.last_fault_at = now

    def progress(self) -> None:
        elapsed, c = time.monotonic() - self.t0, self.counts
        rate = c["rooms_verified"] / max(elapsed, 1e-9)
        recent = (c["rooms_verified"] - self.last_progress[1]) / max(elapsed - self.last_progress[0], 1e-9)
        self.last_progress = (elapsed, c["rooms_verified"])
        p_rss = h.rss(self.prefill.process.pid, 1024) if self.prefill else None
        d_rss = h.rss(self.decode_broker.process.pid, 1024) if self.decode_broker else None
        self.held.say(f"[{elapsed:6.0f}s] started {c['rooms_started']}, verified {c['rooms_verified']}, failed {c['rooms_failed']} "
                      f"({c['rooms_failed_unexpectedly']} unexpected), mismatches {c['byte_mismatches']}, in flight {len(self.rooms)} | "
                      f"kills {c['engine_kills']}, restarts {c['broker_restarts']} | RSS prefill#{len(self.incarnations)} {mib(p_rss)}, "
                      f"decode {mib(d_rss)} | {rate:.1f} verified rooms/s ({recent:.1f} in the last interval)")

    def run(self) -> dict[str, Any]:
        args = self.args
        self.held.say(f"soak: {args.minutes:g} min, fault rate {args.fault_rate:g}, engine kill every ~{args.kill_every:g} s, "
                      f"prefill broker restart every ~{args.restart_every:g} s, {args.inflight} rooms in flight per prefill engine; "
                      f"KV in {KV_PLACES[args.kv]}; logs in {self.workdir}")
        self.decode_broker = BrokerProcess.launch("decode", self.workdir, self.broker_args, env=self.broker_env)
        self.start_prefill_broker()
        self.decode_broker.wait_ready(60)
        self.check_fake_gpu(self.decode_broker)
        self.memory = allocate(self.spec, args.kv, pool_pages(args.max_pages, args.slots), args.slots)
        self.engine = BrokerClient(self.decode_broker.address).register_engine(self.spec, self.memory)
        self.children = [Child("steady", STEADY, killable=False), Child("victim", VICTIM, killable=True)]
        for child in self.children:
            self.start_child(child)
        self.t0 = time.monotonic()
        self.next_kill = self.t0 + args.warmup + args.kill_every * self.rng.uniform(0.3, 1.0)
        self.next_restart = self.t0 + args.warmup + args.restart_every * self.rng.uniform(0.5, 1.0)
        next_progress, next_check, next_poll = self.t0 + 30, self.t0, self.t0
        decode_alive = True
        while time.monotonic() < self.t0 + self.duration:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                if not (decode_alive := self.check_brokers()):
                    break
                if "start" not in self.rss_decode and now - self.t0 >= args.warmup:
                    self.rss_decode["start"] = h.rss(self.decode_broker.process.pid, 1024)
                for inc in self.incarnations:  # the first one's warm-up: from the start of the load
                    if inc.rss_warm_kib is None and inc.ended == "running" and now - max(inc.started_at, self.t0) >= args.warmup:
                        inc.rss_warm_kib = h.rss(inc.broker.process.pid, 1024)
            self.maybe_fault()
            self.read_children()
            for child in self.children:
                while child.ready and len(child.rooms) < args.inflight and self.free_slots:
                    self.open_room(child, self.faults_on())
            for room in list(self.rooms.values()):
                if room.abort_at is not None and room.abort_at <= now:
                    room.abort_at = None
                    self.abort(room, "soak: decode abort")
            if now >= next_poll:
                next_poll = now + 0.02
                self.poll()
                self.retire_finished()
            if now >= next_progress:
                next_progress += 30
                self.progress()
            time.sleep(0.005)
        return self.finish(time.monotonic() - self.t0, decode_alive)

    def tables(self, brokers: dict[str, BrokerProcess | None]) -> dict[str, dict[str, int]]:
        return {name: dict(b.stats().per_room_state) for name, b in brokers.items() if b and b.process.poll() is None}

    def buffers_free(self, brokers: dict[str, BrokerProcess | None], when: str) -> dict[str, Any]:
        """Wait up to --buffers-wait s until no live broker holds a slot or a credit (idle credits go back after 1 s
        unused): what each held at the last look, and after how long all was free."""
        started = time.monotonic()
        while True:
            held: dict[str, dict[str, int]] = {}
            for name, broker in ((n, b) for n, b in brokers.items() if b is not None and b.process.poll() is None):
                try:
                    self.last_stats[name] = stats = broker.stats(timeout_seconds=5)
                    held[name] = buffers_held(stats)
                except Exception as exc:  # a broker that does not answer holds what it holds
                    held[name] = {f"GetStats failed: {exc}"[:200]: 1}
            waited, free = round(time.monotonic() - started, 1), not any(held.values())
            if free or waited >= self.args.buffers_wait:
                return {"when": when, "free": free, "after_s": waited, "held": held}
            time.sleep(0.25)

    def finish(self, run_seconds: float, decode_alive: bool) -> dict[str, Any]:
        args, c, t = self.args, self.counts, self.tally
        # RSS at the end of the load (engines still registered: comparable with the warm-up).
        last = self.incarnations[-1]
        self.rss_decode["end"] = h.rss(self.decode_broker.process.pid, 1024) if self.decode_broker else None
        if last.ended == "running" and self.prefill is not None:
            last.rss_last_kib = h.rss(self.prefill.process.pid, 1024)
        # 1. Stop sending; let every room in flight end.
        drain_deadline = time.monotonic() + args.stuck_after + 15
        while decode_alive and self.rooms and time.monotonic() < drain_deadline:
            self.check_brokers()
            self.read_children()
            self.poll()
            self.retire_finished()
            time.sleep(0.01)
        unfinished = [f"room {r.id} decode={r.decode_state} settled={r.settled} sender={r.sender_state} tags={sorted(r.tags)}"
                      for r in self.rooms.values()]
        brokers = {"prefill": self.prefill, "decode": self.decode_broker}
        # Every room ended, the engines still registered: every slot and credit must be free.
        buffers = [self.buffers_free(brokers, "rooms drained, engines registered")]
        # 2. The engines unregister.
        self.stopping_children = True
        for child in self.children:
            with contextlib.suppress(OSError):
                child.conn.send(("stop",))
        for child in self.children:
            stop_deadline = time.monotonic() + 45
            while child.process.exitcode is None and time.monotonic() < stop_deadline:
                self.read_children()
                child.process.join(0.1)
            if child.process.exitcode is None:
                self.event(f"{child.name} did not stop; killing it")
                child.process.kill()
                child.process.join()
        self.read_children()
        guard_problems: list[str] = self.memory.check_guards()
        if error := h.release(self.engine, self.engine.client):
            self.event(f"decode UnregisterEngine failed: {error}")
        # 3. Wait for eviction; read the per-room tables.
        wait = args.finished_room_ttl + args.tombstone_ttl + 5
        drained_at = time.monotonic()
        time.sleep(wait)
        tables: dict[str, dict[str, int]] = {}
        try:
            tables = self.tables(brokers)
        except Exception as exc:  # a broker that does not answer
            self.event(f"GetStats failed: {exc}")
        leaked = {f"{name}.{k}": v for name, table in tables.items() for k, v in table.items() if v}
        late_drain = None
        while leaked and time.monotonic() < drained_at + wait + 60:  # not a pass, but say whether they go later or stay
            time.sleep(1)
            try:
                if not any(v for table in self.tables(brokers).values() for v in table.values()):
                    late_drain = round(time.monotonic() - drained_at, 1)
                    break
            except Exception:
                break
        buffers.append(self.buffers_free(brokers, "engines unregistered, rooms evicted"))
        device = collections.Counter(self.device_counts)
        for side, stats in self.last_stats.items():
            device.update(device_counters(stats, side))
        # 4. RSS once idle (engines unregistered, tables evicted), then stop the brokers.
        self.rss_decode["idle"] = h.rss(self.decode_broker.process.pid, 1024) if self.decode_broker else None
        rss_prefill_idle = h.rss(self.prefill.process.pid, 1024) if self.prefill is not None and self.prefill.process.poll() is None else None
        exit_codes = {name: b.stop() if b.process.poll() is None else f"already dead ({b.process.returncode})"
                      for name, b in brokers.items() if b is not None}
        last.ended = "stopped" if last.ended == "running" else last.ended
        seen = [b for b in (self.decode_broker, *(i.broker for i in self.incarnations)) if b is not None]
        warnings = {b.name: w for b in seen if (w := b.warnings())}  # each broker's log, warning and worse
        bad_exit = {k: v for k, v in exit_codes.items() if v != 0}
        held = [f"{b['when']}: {b['held']}" for b in buffers if not b["free"]]
        reasons = [text for failed, text in (
            (c["byte_mismatches"] or guard_problems, f"{c['byte_mismatches']} byte mismatches, {len(guard_problems)} overwritten guards"),
            (c["rooms_failed_unexpectedly"], f"{c['rooms_failed_unexpectedly']} rooms failed unexplained by an injected fault"),
            (leaked, f"leaked records: {leaked}"), (held, f"slots or credits still held {args.buffers_wait:g} s on: {'; '.join(held)}"),
            (self.broker_deaths, f"{len(self.broker_deaths)} unexpected broker deaths"),
            (bad_exit, f"brokers exited badly on SIGTERM: {bad_exit}"), (not c["rooms_verified"], "no room was verified"),
            (args.kv != "dram" and c["rooms_verified"] and not (device["prefill_packed_parts"] and device["decode_device_launches"]),
             f"KV in {KV_PLACES[args.kv]}, yet no packed part moved: {device}")) if failed]

        def spread(values: dict[str, list[float]]) -> dict[str, dict[str, float]]:
            return {k: {"n": len(v), "max": round(max(v), 2), "mean": round(sum(v) / len(v), 2)} for k, v in values.items()}

        def examples(prefix: str) -> dict[str, list[str]]:
            return {k.removeprefix(prefix): v for k, v in t.examples.items() if k.startswith(prefix)}

        return {
            "ok": not reasons, "reasons": reasons, "failures": reasons, "duration_s": round(run_seconds, 1),
            "workdir": str(self.workdir), "config": {k: v for k, v in vars(args).items() if k not in ("json", "keep_logs")},
            **{k: c[k] for k in ("rooms_started", "rooms_verified", "rooms_failed", "rooms_failed_unexpectedly")},
            "failed_by_cause": dict(t.failed_by_cause.most_common()), "failure_examples": examples("cause "),
            "unexpected_examples": t.examples["unexpected"], "outcomes_by_fault": {k: dict(v) for k, v in sorted(t.by_fault.items())},
            **{k: c[k] for k in ("aborts_decode", "aborts_prefill", "aborted_rooms_that_succeeded")},
            "sender_outcomes": dict(t.sender_outcomes.most_common()), "sender_examples": examples("sender "),
            "sides_disagree": dict(t.disagree.most_common()), "byte_mismatches": c["byte_mismatches"],
            "mismatch_examples": t.examples["mismatch"], "guard_problems": guard_problems,
            **{k: c[k] for k in ("decode_init_errors", "stuck_rooms", "rooms_never_settled", "sender_never_finished")},
            "unfinished_at_end": unfinished, "engine_kills": c["engine_kills"], "broker_restarts": c["broker_restarts"],
            "reregister_seconds": spread(t.reregister), "fault_to_failure_seconds": spread(t.fault_latency),
            "engine_crashes": self.engine_crashes, "broker_deaths": self.broker_deaths, "per_room_state": tables,
            "leaked": leaked, "leak_drained_after_s": late_drain, "eviction_wait_s": wait,
            "kv": args.kv, "device_path": device, "buffers_free": buffers,
            "rss_kib": {"decode": self.rss_decode, "prefill_idle": rss_prefill_idle, "prefill_incarnations": [
                {"n": i.n, "pid": i.broker.process.pid, "warm": i.rss_warm_kib, "last": i.rss_last_kib, "ended": i.ended} for i in self.incarnations]},
            "broker_exit": exit_codes, "broker_log_warnings": warnings, "events": self.events[-40:]}

    def cleanup(self) -> None:
        for child in self.children:
            if child.process is not None and child.process.exitcode is None:
                child.process.kill()
        for broker in (self.prefill, self.decode_broker):
            if broker is not None:
                broker.kill()
        if self.memory is not None:
            self.memory.close()


def print_report(r: dict[str, Any]) -> None:
    p = print
    p("\n" + "=" * 78)
    p(f"soak result: {'PASS' if r['ok'] else 'FAIL'}" + ("" if r["ok"] else f" ({'; '.join(r['reasons'])})"))
    p(f"duration: {r['duration_s']:.1f} s ({r['duration_s'] / 60:.1f} min); logs: {r['workdir']}")
    p(f"rooms: {r['rooms_started']} started, {r['rooms_verified']} SUCCESS and verified byte-exact, {r['rooms_failed']} failed "
      f"({r['rooms_failed_unexpectedly']} not explained by an injected fault)")
    p(f"faults injected: {r['engine_kills']} prefill engine kills, {r['broker_restarts']} prefill broker restarts, "
      f"aborts on {r['aborts_decode'] + r['aborts_prefill']} rooms ({r['aborts_decode']} decode side, {r['aborts_prefill']} prefill side; "
      f"{r['aborted_rooms_that_succeeded']} of them still succeeded)")
    p("rooms failed by cause (decode side):" + ("" if r["failed_by_cause"] else "\n  (none)"))
    for cause, n in r["failed_by_cause"].items():
        p(f"  {cause:<16} {n:6d}")
        for example in r["failure_examples"].get(cause, []):
            p(f"      e.g. {example}")
    p("outcomes by injected fault (a room in flight during a fault carries its tag):")
    for tag, outcomes in r["outcomes_by_fault"].items():
        p(f"  {tag:<16} " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])))
    if r["unexpected_examples"]:
        p("unexpected failures (examples):\n" + "\n".join(f"  {e}" for e in r["unexpected_examples"]))
    p("sender side (prefill engines): " + ", ".join(f"{k} {v}" for k, v in r["sender_outcomes"].items()))
    for outcome, examples in r["sender_examples"].items():
        for example in examples[:2]:
            p(f"      {outcome}: {example}")
    if r["sides_disagree"]:
        p("rooms whose two sides ended differently: " + ", ".join(f"{k}: {v}" for k, v in r["sides_disagree"].items()))
    p(f"byte mismatches: {r['byte_mismatches']}" + (f"; overwritten guards: {r['guard_problems']}" if r["guard_problems"] else ""))
    for example in r["mismatch_examples"]:
        p(f"  {example}")
    p(f"decode ExpectRoom errors: {r['decode_init_errors']}; stuck rooms aborted by the soak: {r['stuck_rooms']}; "
      f"pages never settled: {r['rooms_never_settled']}; no sender outcome: {r['sender_never_finished']}; unfinished at the end: "
      f"{len(r['unfinished_at_end'])}")
    for line in r["unfinished_at_end"][:5]:
        p(f"  {line}")
    for key, v in r["reregister_seconds"].items():
        p(f"engine registration {key}: {v['n']} times, mean {v['mean']} s, max {v['max']} s (from the fault to registered)")
    for key, v in r["fault_to_failure_seconds"].items():
        p(f"from {key} to the decode side's FAILED: {v['n']} rooms, mean {v['mean']} s, max {v['max']} s")
    for title, lines in (("engine child crashes:", r["engine_crashes"]), ("unexpected broker deaths:", r["broker_deaths"])):
        if lines:
            p(title + "".join(f"\n  {line}" for line in lines))
    p(f"per_room_state after the engines unregistered and {r['eviction_wait_s']:.0f} s (finished TTL + tombstone TTL + 5 s):")
    for name, table in r["per_room_state"].items():
        p(f"  {name:8} " + ", ".join(f"{k}={v}" for k, v in sorted(table.items())))
    p(f"leaked records: {len(r['leaked'])}" + (f" {r['leaked']}; drained after {r['leak_drained_after_s']} s" if r["leaked"] else ""))
    for b in r["buffers_free"]:
        p(f"slots and credits, {b['when']}: " + (f"all free on both brokers (after {b['after_s']} s)" if b["free"] else
          "NOT all free: " + "; ".join(f"{name} {held or 'nothing'}" for name, held in b["held"].items())))
    d = r["device_path"]
    p(f"device path: KV in {KV_PLACES[r['kv']]}; {d['prefill_packed_parts']} packed parts sent (every prefill incarnation), "
      f"device launches prefill {d['prefill_device_launches']}, decode {d['decode_device_launches']}")
    rss, incs = r["rss_kib"], r["rss_kib"]["prefill_incarnations"]
    p(f"RSS decode broker: {mib(rss['decode'].get('start'))} after warm-up -> {mib(rss['decode'].get('end'))} at the end of the load "
      f"({mib(rss['decode'].get('idle'))} idle, after the engines unregistered)")
    first, last = incs[0], incs[-1]
    when = f"when {first['ended']}" if len(incs) > 1 else f"at the end of the load ({mib(rss['prefill_idle'])} idle)"
    p(f"RSS prefill broker, first incarnation (pid {first['pid']}): {mib(first['warm'])} after warm-up -> {mib(first['last'])} {when}")
    if len(incs) > 1:
        p(f"RSS prefill broker, last incarnation #{last['n']} (pid {last['pid']}): {mib(last['warm'])} after warm-up -> "
          f"{mib(last['last'])} at the end of the load ({mib(rss['prefill_idle'])} idle)")
        p("  every incarnation: " + ", ".join(f"#{i['n']} {mib(i['warm'])}->{mib(i['last'])}" for i in incs))
    p(f"broker exit status on SIGTERM: {r['broker_exit']}")
    if r["broker_log_warnings"]:
        p("warnings and errors in the broker logs (event: count):")
        for name, counter in r["broker_log_warnings"].items():
            p(f"  {name}: " + ", ".join(f"{k} x{v}" for k, v in sorted(counter.items(), key=lambda kv: -kv[1])))
    p("=" * 78)
    if r["config"]["verbose"] or not r["ok"]:
        p("last events:\n" + "\n".join(f"  {line}" for line in r["events"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--minutes", type=float, default=10.0)
    add("--fault-rate", type=float, default=0.1, help="fraction of rooms aborted mid-flight (0 turns aborts off)")
    add("--kill-every", type=float, default=45.0, help="seconds between prefill engine kills (0: never)")
    add("--restart-every", type=float, default=120.0, help="seconds between prefill broker restarts (0: never)")
    add("--inflight", type=int, default=4, help="rooms in flight per prefill engine")
    add("--slots", type=int, default=24, help="destination slots of the decode pool")
    add("--min-pages", type=int, default=2)
    add("--max-pages", type=int, default=32)
    add("--warmup", type=float, default=15.0, help="seconds without faults at the start (RSS is taken after it)")
    add("--quiet-tail", type=float, default=30.0, help="seconds without faults before the end")
    add("--stuck-after", type=float, default=90.0, help="a room open this long is aborted and counted as stuck")
    add("--peer-heartbeat", type=float, default=0.5)
    add("--peer-dead-after", type=float, default=2.0)
    add("--finished-room-ttl", type=float, default=3.0)
    add("--tombstone-ttl", type=float, default=5.0)
    add("--broker-log-level", default="warning")
    add("--fake-vram", action="store_true", help=f"every rank's KV in fake VRAM: brokers with {FAKE_GPUS_ENV}=1 move it as "
        "packed parts on a fake CUDA driver (CPU only)")
    add("--gpu-model", default="h200,byte_scale=1024", help="--fake-vram: the modelled GPU whose lanes carry the copies "
        "(kvbroker.testing.gpu_model; none: the copy thread, as host memory)")
    add("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: every rank's KV in VRAM of cuda:0 (a GPU host)")
    add("--device-buffer-mib", type=int, default=8, help="each broker's transfer buffers per GPU (send and receive)")
    add("--device-part-mib", type=int, default=1, help="largest packed part (a room's largest chunk is 1 MiB and its aux)")
    add("--buffers-wait", type=float, default=10.0, help="seconds every slot and credit may take to be free at the end")
    add("--seed", type=int, default=secrets.randbits(31))
    add("--verbose", action="store_true", help="print fault events as they happen")
    add("--json", action="store_true", help="one JSON line on stdout (progress goes to stderr)")
    args = parser.parse_args()
    args.keep_logs = True  # the brokers' and engines' logs: the report names them
    if args.fake_vram and args.device == "cuda":
        parser.error("--fake-vram and --device cuda: one or the other")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (--fake-vram runs the device path without a GPU)")
    args.kv = "cuda" if args.device == "cuda" else "fake-vram" if args.fake_vram else "dram"
    if args.slots < 2 * args.inflight:
        parser.error("--slots must be at least 2 x --inflight")
    if pool_pages(args.max_pages, 1) > PREFILL_POOL_PAGES or args.min_pages < 1 or args.min_pages > args.max_pages:
        parser.error("bad --min-pages/--max-pages")
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def run(held: h.Held) -> dict[str, Any]:
        soak = Soak(args, held)
        held.defer("stopping the soak's processes", soak.cleanup)
        return soak.run()

    return h.bench_main("soak", args, run, print_report, report_lists_failures=True)

if __name__ == "__main__":
    sys.exit(main())

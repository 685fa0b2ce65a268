"""Soak test: many rooms through two brokers for a set time, with faults injected.

    python bench/soak.py --minutes 10 [--fault-rate 0.1] [--kill-every 45] [--restart-every 120] [--json]

Two ``kvbroker serve`` processes on 127.0.0.1: a prefill broker on a fixed
port (so it can be restarted at the same address) and a decode broker, both
with fast liveness (``--peer-heartbeat 0.5 --peer-dead-after 2``) and short
TTLs so their tables drain. Engines:

- decode: one rank in this process. It opens every room (ExpectRoom), watches
  it by polling, checks every byte of every SUCCESS room (KV pages and aux
  row) against the reference pattern of ``kvbroker.demo.pattern``, and reuses
  a room's destination slot only once its pages are settled;
- prefill: two ranks, each in its own spawned child process, group
  ``soak-steady`` and ``soak-victim``. They receive room orders from this
  process, open the room (BeginSend), send it in 1-4 chunks with small gaps,
  poll until it ends and report the sender-side outcome. When their broker
  goes away they report their open rooms as lost and re-register (new client,
  new memory) until the broker is back.

Faults (none during the warm-up, none in the quiet tail before the end):

- aborts: a fraction ``--fault-rate`` of rooms is aborted mid-flight, on a
  random side (decode ``receiver.abort`` 0-60 ms after ExpectRoom, or prefill
  ``sender.abort`` after one of its chunks);
- killed engines: every ``--kill-every`` s (+-30%) the victim child is
  SIGKILLed and a new one started with the same group, which registers as
  soon as the broker has released the old registration;
- broker restart: every ``--restart-every`` s (+-30%) the prefill broker is
  SIGKILLed and restarted on the same port; both children reconnect.

Every room in flight when a fault hits is tagged with it; a failure is
"expected" when its cause matches a tag (aborts: ABORTED, killed engine:
ENGINE_LOST, broker restart: PEER), otherwise it is listed as unexpected.

At the end: sending stops, every room in flight finishes, the engines
unregister, and after finished-room TTL + tombstone TTL + 5 s both brokers'
``GetStats.per_room_state`` must be all zero. Exit status 1 on any byte
mismatch, any leaked record, a broker that died unexpectedly (or exited
non-zero on SIGTERM), or no verified room at all. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import multiprocessing
import os
import random
import secrets
import select
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")

import numpy as np
import torch

from kvbroker.client import BrokerClient, EngineMemory, ModelSpec, RankSpec, RoomState, SenderRef
from kvbroker.demo.pattern import fill_rank, verify_room, write_aux
from kvbroker.errors import KvBrokerError, NotFound, Unavailable
from kvbroker.testing import BrokerProcess
from kvbroker.v1 import common_pb2

MODEL = ModelSpec(num_layers=4, total_kv_heads=4, head_dim=32, dtype=torch.bfloat16, page_size=16)
AUX_ROW_BYTES = [32]
PREFILL_POOL_PAGES = 256
DECODE_GROUP = "soak-decode"
STEADY, VICTIM = "soak-steady", "soak-victim"
FINAL = (RoomState.SUCCESS, RoomState.FAILED)
EXPECTED_CAUSE = {
    "abort-decode": {"ABORTED"},
    "abort-prefill": {"ABORTED"},
    "engine-kill": {"ENGINE_LOST"},
    "broker-restart": {"PEER"},
    "sender-error": {"ABORTED"},
    "stuck": {"ABORTED"},
}


def kind_name(kind: int) -> str:
    return common_pb2.FailureKind.Name(kind).removeprefix("FAILURE_KIND_")


def span_pages(pages: int) -> int:
    return pages + max(2, pages // 2)


def pick_pages(rng: random.Random, pages: int, base: int) -> list[int]:
    """``pages`` distinct pages from [base, base + span): contiguous runs in shuffled order."""
    span = span_pages(pages)
    chosen = sorted(rng.sample(range(span), pages))
    runs: list[list[int]] = []
    for page in chosen:
        if runs and runs[-1][-1] == page - 1:
            runs[-1].append(page)
        else:
            runs.append([page])
    rng.shuffle(runs)
    return [base + p for run in runs for p in run]


def read_rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def mib(kib: int | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f} MiB"


# --------------------------------------------------------------------------
# The prefill engine (a spawned child process)
# --------------------------------------------------------------------------


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
    """One prefill rank that sends the rooms the soak orders, and survives its broker."""

    def __init__(self, address: str, group: str, slots: int, conn: Any) -> None:
        self.address = address
        self.spec = RankSpec(group=group, role="prefill")
        self.slots = slots
        self.conn = conn
        self.client: BrokerClient | None = None
        self.engine: Any = None
        self.memory: EngineMemory | None = None
        self.open: dict[int, SendingRoom] = {}
        self.actions: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.stopping_since: float | None = None

    # -- connection -------------------------------------------------------
    def connect(self, reason: str) -> None:
        started = time.monotonic()
        attempts = 0
        last = ""
        while True:
            attempts += 1
            memory = client = None
            try:
                client = BrokerClient(self.address, timeout_seconds=5)
                memory = EngineMemory.allocate(
                    self.spec, MODEL, num_pages=PREFILL_POOL_PAGES, aux_rows=self.slots, aux_row_bytes=AUX_ROW_BYTES
                )
                fill_rank(memory, MODEL, self.spec)
                engine = client.register_engine(self.spec, memory)
            except (KvBrokerError, OSError) as exc:
                last = str(exc)
                if client is not None:
                    client.close()
                if memory is not None:
                    memory.close()
                time.sleep(0.2)
                continue
            self.client, self.memory, self.engine = client, memory, engine
            self.conn.send(("ready", reason, attempts, round(time.monotonic() - started, 3), last[:300]))
            return

    def disconnect(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:
                pass
        if self.client is not None:
            self.client.close()
        if self.memory is not None:
            self.memory.close()
        self.engine = self.client = self.memory = None

    def session_closed(self) -> bool:
        """Whether the broker closed our fd-socket session (it died)."""
        session: socket.socket | None = getattr(self.engine, "_fd_session", None)
        if session is None:
            return True
        readable, _, _ = select.select([session], [], [], 0)
        if not readable:
            return False
        try:
            return session.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

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

    # -- rooms ------------------------------------------------------------
    def schedule(self, delay: float, room: int, what: str) -> None:
        self.seq += 1
        heapq.heappush(self.actions, (time.monotonic() + delay, self.seq, room, what))

    def fail(self, room: int, what: str, exc: Exception) -> None:
        self.open.pop(room, None)
        self.conn.send(("error", room, f"{what}: {exc}"[:400]))

    def begin(self, room: int, src: list[int], bounds: list[tuple[int, int]], slot: int, abort_after: int | None, gap: float) -> None:
        assert self.memory is not None
        write_aux(self.memory, room, slot)
        sender = self.engine.sender(room)
        # Open before the call: a BrokerGone from it reports the room as lost.
        self.open[room] = SendingRoom(sender, src, bounds, abort_after, gap)
        try:
            self.call(sender.init, num_pages=len(src), aux_row=slot)
        except KvBrokerError as exc:
            self.fail(room, "BeginSend", exc)
            return
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
            self.fail(room, f"SendChunk {i}", exc)
            return
        state.next_chunk += 1
        if state.abort_after == i:
            self.schedule(state.gap, room, "abort")
        elif not last:
            self.schedule(state.gap, room, "chunk")

    def abort(self, room: int, reason: str) -> None:
        state = self.open.get(room)
        if state is None:
            return
        try:
            self.call(state.sender.abort, reason)
        except KvBrokerError as exc:
            self.conn.send(("note", room, f"sender abort: {exc}"[:400]))

    def poll_open(self) -> None:
        if not self.open:
            return
        for room, status in self.call(self.engine.poll, list(self.open)).items():
            if status.state in FINAL and room in self.open:
                del self.open[room]
                cause = kind_name(status.cause.kind) if status.state == RoomState.FAILED else ""
                self.conn.send(("final", room, RoomState(status.state).name, cause, status.cause.message[:400], status.bytes))

    def handle(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "room":
            self.begin(*msg[1:])
        elif msg[0] == "abort":
            self.abort(msg[1], "soak: the decode side could not open the room")
        elif msg[0] == "stop":
            self.stopping_since = time.monotonic()

    # -- loop -------------------------------------------------------------
    def run(self) -> None:
        self.connect("start")
        next_poll = 0.0
        next_session_check = 0.0
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
                    if self.session_closed():
                        raise BrokerGone("the broker closed the engine session (fd socket EOF)")
                if self.stopping_since is not None and (not self.open or now - self.stopping_since > 30):
                    unfinished = list(self.open)
                    self.disconnect()
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
                    self.conn.send(("stopped", lost))
                    return
                self.connect(str(exc)[:200])


def prefill_engine_main(address: str, group: str, slots: int, conn: Any, log_path: str) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    torch.set_num_threads(1)
    try:
        PrefillEngine(address, group, slots, conn).run()
    except BaseException:
        with open(log_path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} pid {os.getpid()} crashed:\n{traceback.format_exc()}\n")
        try:
            conn.send(("crash", traceback.format_exc()[-2000:]))
        except Exception:
            pass
        raise


# --------------------------------------------------------------------------
# The soak (this process: orchestrator and decode engine)
# --------------------------------------------------------------------------


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
class Room:
    id: int
    child: Child
    slot: int
    src: list[int]
    dst: list[int]
    started: float
    fault: str | None
    tags: set[str] = field(default_factory=set)
    #: When each fault hit this room (monotonic).
    tagged_at: dict[str, float] = field(default_factory=dict)
    abort_at: float | None = None
    decode_state: str | None = None
    decode_cause: str = ""
    decode_message: str = ""
    decode_final_at: float | None = None
    settled: bool = False
    sender_state: str | None = None

    def tag(self, what: str) -> None:
        self.tags.add(what)
        self.tagged_at.setdefault(what, time.monotonic())

    def timing(self) -> str:
        now = time.monotonic()
        parts = [f"{now - self.started:.1f} s after it opened"]
        parts += [f"{now - at:.1f} s after {what}" for what, at in self.tagged_at.items() if what in ("engine-kill", "broker-restart", "broker-died")]
        return ", ".join(parts)


@dataclass
class Incarnation:
    n: int
    pid: int
    started_at: float
    rss_warm_kib: int | None = None
    rss_last_kib: int | None = None
    ended: str = "running"


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="kvb-soak-"))
        self.port = self.free_port()
        self.broker_args = [
            "--peer-heartbeat", str(args.peer_heartbeat),
            "--peer-dead-after", str(args.peer_dead_after),
            "--finished-room-ttl", str(args.finished_room_ttl),
            "--tombstone-ttl", str(args.tombstone_ttl),
            "--orphan-timeout", "15",
            "--bootstrap-timeout", "15",
            "--sender-info-timeout", "30",
            "--receiver-data-timeout", "60",
            "--transfer-timeout", "30",
            "--unregister-settle-timeout", "5",
            "--log-level", args.broker_log_level,
        ]
        self.out = sys.stderr if args.json else sys.stdout
        self.t0 = time.monotonic()
        self.prefill: BrokerProcess | None = None
        self.decode_broker: BrokerProcess | None = None
        self.incarnations: list[Incarnation] = []
        self.rooms: dict[int, Room] = {}
        self.room_ids = secrets.randbits(30) << 24
        self.slots_total = args.slots
        self.free_slots = list(range(args.slots))
        self.retired_slots: list[int] = []
        self.children: list[Child] = []
        self.ctx = multiprocessing.get_context("spawn")
        # outcomes
        self.counts: collections.Counter[str] = collections.Counter()
        self.failed_by_cause: collections.Counter[str] = collections.Counter()
        self.cause_examples: dict[str, list[str]] = collections.defaultdict(list)
        self.by_fault: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.unexpected: list[str] = []
        self.sender_outcomes: collections.Counter[str] = collections.Counter()
        self.sender_examples: dict[str, list[str]] = collections.defaultdict(list)
        self.mismatch_examples: list[str] = []
        self.events: list[str] = []
        self.disagree: collections.Counter[str] = collections.Counter()
        self.fault_latency: dict[str, list[float]] = collections.defaultdict(list)
        self.reregister: dict[str, list[float]] = collections.defaultdict(list)
        self.broker_deaths: list[str] = []
        self.engine_crashes: list[str] = []
        self.rss_decode: dict[str, int | None] = {}
        self.last_fault_at = 0.0
        self.last_progress = (0.0, 0)
        self.duration = args.minutes * 60.0
        self.next_kill = self.next_restart = 0.0

    # -- helpers ------------------------------------------------------------
    @staticmethod
    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def now(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def event(self, text: str) -> None:
        line = f"[{self.now():7.1f}s] {text}"
        self.events.append(line)
        if self.args.verbose:
            self.say(line)

    @property
    def prefill_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -- brokers --------------------------------------------------------------
    def start_prefill_broker(self) -> None:
        n = len(self.incarnations) + 1
        for attempt in range(10):
            broker = BrokerProcess.launch(f"prefill-{n}", self.workdir, [*self.broker_args, "--listen", self.prefill_address])
            try:
                # Keep watching the decode rooms meanwhile: a room that ends
                # now is evicted after --finished-room-ttl, maybe before this returns.
                broker.wait_ready(60, while_waiting=self.poll_decode)
            except RuntimeError as exc:
                self.event(f"prefill broker #{n} did not start (attempt {attempt + 1}): {str(exc)[-300:]}")
                time.sleep(0.5)
                continue
            self.prefill = broker
            self.incarnations.append(Incarnation(n, broker.process.pid, time.monotonic()))
            return
        raise RuntimeError("the prefill broker could not be restarted on its port")

    def restart_prefill_broker(self) -> None:
        assert self.prefill is not None
        inc = self.incarnations[-1]
        inc.rss_last_kib = read_rss_kib(self.prefill.process.pid)
        inc.ended = "killed"
        for child in self.children:
            child.ready = False
        for room in self.rooms.values():
            if room.decode_state is None:
                room.tag("broker-restart")
        self.prefill.kill()
        self.counts["broker_restarts"] += 1
        self.event(f"SIGKILL prefill broker #{inc.n} (pid {inc.pid}, RSS {mib(inc.rss_last_kib)}), {len(self.rooms)} rooms in flight")
        restarted = time.monotonic()
        self.start_prefill_broker()
        for child in self.children:
            child.since = restarted
        self.event(f"prefill broker #{self.incarnations[-1].n} serves on the same port after {time.monotonic() - restarted:.1f} s")

    def check_brokers(self) -> bool:
        """False when the decode broker died (the soak cannot go on)."""
        assert self.prefill is not None and self.decode_broker is not None
        if self.decode_broker.process.poll() is not None:
            msg = f"decode broker died (exit {self.decode_broker.process.returncode}); log tail:\n{self.decode_broker.log_tail(3000)}"
            self.broker_deaths.append(msg)
            self.event(msg)
            return False
        if self.prefill.process.poll() is not None:
            inc = self.incarnations[-1]
            inc.ended = f"died (exit {self.prefill.process.returncode})"
            msg = f"prefill broker #{inc.n} died (exit {self.prefill.process.returncode}); log tail:\n{self.prefill.log_tail(3000)}"
            self.broker_deaths.append(msg)
            self.event(msg)
            for child in self.children:
                child.ready = False
            for room in self.rooms.values():
                if room.decode_state is None:
                    room.tag("broker-died")
            self.start_prefill_broker()
        return True

    # -- prefill children -------------------------------------------------------
    def start_child(self, child: Child) -> None:
        parent, there = self.ctx.Pipe()
        child.incarnation += 1
        process = self.ctx.Process(
            target=prefill_engine_main,
            args=(self.prefill_address, child.group, self.slots_total, there, str(self.workdir / f"engine-{child.name}.log")),
            daemon=True,
            name=f"soak-{child.name}-{child.incarnation}",
        )
        process.start()
        there.close()
        child.process, child.conn, child.ready, child.since = process, parent, False, time.monotonic()

    def kill_child(self, child: Child) -> None:
        child.process.kill()
        child.process.join()
        child.conn.close()
        child.ready = False
        lost = 0
        for rid in list(child.rooms):
            room = self.rooms[rid]
            if room.decode_state is None:
                room.tag("engine-kill")
            if room.sender_state is None:
                room.sender_state = "KILLED"
                self.sender_outcomes["KILLED"] += 1
                lost += 1
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
                crash = f"{child.name} #{child.incarnation} exited on its own (exit {child.process.exitcode}); see {self.workdir}/engine-{child.name}.log"
                self.engine_crashes.append(crash)
                self.event(crash)
                for rid in list(child.rooms):
                    room = self.rooms[rid]
                    if room.decode_state is None:
                        room.tag("engine-crash")
                    if room.sender_state is None:
                        room.sender_state = "CRASHED"
                child.conn.close()
                self.start_child(child)

    stopping_children = False

    def on_child(self, child: Child, msg: tuple[Any, ...]) -> None:
        what = msg[0]
        if what == "ready":
            _, reason, attempts, took, last = msg
            child.ready = True
            waited = time.monotonic() - child.since
            if reason != "start":
                key = "after broker restart"
            else:
                key = "after engine kill" if child.incarnation > 1 else "first start"
            self.reregister[key].append(waited)
            self.event(f"{child.name} #{child.incarnation} registered ({key}; {attempts} attempts, {waited:.1f} s; last refusal: {last or '-'})")
        elif what == "final":
            _, rid, state, cause, message, _bytes = msg
            self.set_sender(rid, state if state == "SUCCESS" else f"FAILED {cause}", message)
        elif what == "error":
            _, rid, message = msg
            self.set_sender(rid, "CALL_ERROR", message)
            room = self.rooms.get(rid)
            if room is not None and room.decode_state is None:
                room.tag("sender-error")
                self.abort_decode(room, "soak: the prefill side could not send")
        elif what == "lost":
            _, rids, reason = msg
            child.ready = False
            for rid in rids:
                self.set_sender(rid, "LOST", reason)
        elif what == "note":
            self.event(f"{child.name}: room {msg[1]}: {msg[2]}")
        elif what == "crash":
            self.engine_crashes.append(f"{child.name} #{child.incarnation}: {msg[1]}")
        elif what == "stopped":
            child.ready = False
            for rid in msg[1]:
                self.set_sender(rid, "UNFINISHED_AT_STOP", "")

    def set_sender(self, rid: int, outcome: str, message: str) -> None:
        room = self.rooms.get(rid)
        if room is None or room.sender_state is not None:
            return
        room.sender_state = outcome
        self.sender_outcomes[outcome] += 1
        if outcome != "SUCCESS" and len(self.sender_examples[outcome]) < 3 and message:
            self.sender_examples[outcome].append(f"room {rid}: {message}")

    # -- decode side ----------------------------------------------------------
    def open_room(self, child: Child) -> None:
        args = self.args
        slot = self.free_slots.pop(0)
        n = self.rng.randint(args.min_pages, args.max_pages)
        src_span = span_pages(n)
        src = pick_pages(self.rng, n, self.rng.randrange(0, PREFILL_POOL_PAGES - src_span + 1))
        dst = pick_pages(self.rng, n, slot * span_pages(args.max_pages))
        nchunks = self.rng.randint(1, min(4, n))
        cuts = sorted(self.rng.sample(range(1, n), nchunks - 1)) if nchunks > 1 else []
        edges = [0, *cuts, n]
        bounds = list(zip(edges[:-1], edges[1:]))
        fault = None
        if self.faults_on() and self.rng.random() < args.fault_rate:
            fault = self.rng.choice(["abort-decode", "abort-prefill"])
        abort_after = None
        if fault == "abort-prefill":
            abort_after = self.rng.randrange(-1, nchunks - 1) if nchunks > 1 else -1
        gap = self.rng.uniform(0, 0.02)
        self.room_ids += 1
        rid = self.room_ids
        room = Room(rid, child, slot, src, dst, time.monotonic(), fault)
        if fault:
            room.tag(fault)
        if fault:
            self.counts[f"aborts_{fault.removeprefix('abort-')}"] += 1
        if fault == "abort-decode":
            room.abort_at = time.monotonic() + self.rng.uniform(0, 0.06)
        # Zero the destination so a page the broker did not write cannot pass.
        idx = torch.as_tensor(dst, dtype=torch.int64)
        for layer in range(MODEL.num_layers):
            for t in self.decode_memory.kv_tensors(layer):
                t[idx] = 0
        for aux in self.decode_memory.aux:
            aux[slot].zero_()
        self.rooms[rid] = room
        child.rooms.add(rid)
        self.counts["rooms_started"] += 1
        order = ("room", rid, src, bounds, slot, abort_after, gap)
        receiver_first = self.rng.random() < 0.5
        if not receiver_first:
            child.conn.send(order)
        try:
            self.decode.receiver(rid, SenderRef(self.prefill_address, child.group)).init(dst, aux_row=slot)
        except KvBrokerError as exc:
            room.decode_state, room.decode_cause, room.decode_message = "INIT_ERROR", type(exc).__name__, str(exc)
            room.decode_final_at, room.settled = time.monotonic(), True
            self.counts["decode_init_errors"] += 1
            self.record_failure(room, f"INIT_ERROR {type(exc).__name__}", str(exc))
            if not receiver_first:
                child.conn.send(("abort", rid))
            else:
                room.sender_state = "NOT_SENT"
            return
        if receiver_first:
            child.conn.send(order)

    def abort_decode(self, room: Room, reason: str) -> None:
        try:
            self.decode.receiver(room.id, SenderRef(self.prefill_address, room.child.group)).abort(reason)
        except KvBrokerError as exc:
            self.event(f"room {room.id}: decode abort failed: {exc}")

    def record_failure(self, room: Room, cause: str, message: str) -> None:
        self.counts["rooms_failed"] += 1
        self.failed_by_cause[cause] += 1
        if len(self.cause_examples[cause]) < 3:
            self.cause_examples[cause].append(f"room {room.id} [{','.join(sorted(room.tags)) or 'no fault'}] ({room.timing()}): {message[:300]}")
        expected = set().union(*(EXPECTED_CAUSE.get(t, set()) for t in room.tags)) if room.tags else set()
        bare = cause.removeprefix("FAILED ")
        for tag in ("engine-kill", "broker-restart"):
            if tag in room.tagged_at:
                self.fault_latency[tag].append(time.monotonic() - room.tagged_at[tag])
        if bare not in expected:
            self.counts["rooms_failed_unexpectedly"] += 1
            if len(self.unexpected) < 10:
                self.unexpected.append(f"room {room.id} [{','.join(sorted(room.tags)) or 'no fault'}] {cause} ({room.timing()}): {message[:300]}")
        for tag in room.tags or {"none"}:
            self.by_fault[tag][bare] += 1

    def poll_decode(self) -> None:
        ids = [r.id for r in self.rooms.values() if r.decode_state is None or not r.settled]
        if not ids:
            return
        statuses = self.decode.poll(ids)
        now = time.monotonic()
        for rid, status in statuses.items():
            room = self.rooms.get(rid)
            if room is None:
                continue
            if room.decode_state is None and status.state in FINAL:
                room.decode_final_at = now
                room.abort_at = None
                if status.state == RoomState.SUCCESS:
                    room.decode_state = "SUCCESS"
                    self.verify(room)
                else:
                    cause = kind_name(status.cause.kind)
                    room.decode_state, room.decode_cause, room.decode_message = "FAILED", cause, status.cause.message
                    self.record_failure(room, cause, status.cause.message)
            if room.decode_state is not None:
                if status.pages_settled:
                    room.settled = True
                elif status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_UNKNOWN_ROOM:
                    # Unknown to the broker (or evicted after we saw it end): nothing of it can still write.
                    room.settled = True

    def verify(self, room: Room) -> None:
        problems = verify_room(
            self.decode_memory,
            MODEL,
            self.decode_spec,
            src_pages=np.asarray(room.src),
            dst_pages=np.asarray(room.dst),
            room=room.id,
            aux_row=room.slot,
        )
        if problems:
            self.counts["byte_mismatches"] += 1
            if len(self.mismatch_examples) < 10:
                self.mismatch_examples.append(f"room {room.id} [{','.join(sorted(room.tags)) or 'no fault'}]: {'; '.join(problems[:3])}")
        else:
            self.counts["rooms_verified"] += 1
            if room.fault:
                self.counts["aborted_rooms_that_succeeded"] += 1
            for tag in room.tags or {"none"}:
                self.by_fault[tag]["SUCCESS"] += 1

    def retire_finished(self) -> None:
        now = time.monotonic()
        stuck_after = self.args.stuck_after
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
                self.abort_decode(room, "soak: stuck")
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
        if room.sender_state == "SUCCESS" and room.decode_state == "FAILED":
            # The sender's broker moved every chunk, yet the receiver failed (an abort racing the
            # end is fine; with no abort tag it is worth a look).
            key = "aborted" if room.fault else ",".join(sorted(room.tags)) or "no fault"
            self.disagree[f"sender SUCCESS, decode FAILED {room.decode_cause} [{key}]"] += 1
        elif room.decode_state == "SUCCESS" and room.sender_state not in (None, "SUCCESS"):
            key = ",".join(sorted(room.tags)) or "no fault"
            self.disagree[f"decode SUCCESS, sender {room.sender_state} [{key}]"] += 1
        elif room.sender_state == "FAILED TIMEOUT":
            # The sender waited out its transfer-info timeout: say what the decode side did.
            key = ",".join(sorted(room.tags)) or "no fault"
            self.disagree[f"sender FAILED TIMEOUT, decode {room.decode_state} {room.decode_cause or ''} [{key}]"] += 1
        del self.rooms[room.id]
        room.child.rooms.discard(room.id)
        (self.free_slots if keep_slot else self.retired_slots).append(room.slot)

    # -- schedule ----------------------------------------------------------------
    def faults_on(self) -> bool:
        elapsed = time.monotonic() - self.t0
        return self.args.warmup <= elapsed <= self.duration - self.args.quiet_tail

    def maybe_fault(self) -> None:
        if not self.faults_on():
            return
        now = time.monotonic()
        if now - self.last_fault_at < 10:
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

    def schedule_rooms(self) -> None:
        for child in self.children:
            while child.ready and len(child.rooms) < self.args.inflight and self.free_slots:
                self.open_room(child)

    def progress(self) -> None:
        elapsed = self.now()
        c = self.counts
        rate = c["rooms_verified"] / max(elapsed, 1e-9)
        recent = (c["rooms_verified"] - self.last_progress[1]) / max(elapsed - self.last_progress[0], 1e-9)
        self.last_progress = (elapsed, c["rooms_verified"])
        p_rss = read_rss_kib(self.prefill.process.pid) if self.prefill else None
        d_rss = read_rss_kib(self.decode_broker.process.pid) if self.decode_broker else None
        self.say(
            f"[{elapsed:6.0f}s] started {c['rooms_started']}, verified {c['rooms_verified']}, failed {c['rooms_failed']} "
            f"({c['rooms_failed_unexpectedly']} unexpected), mismatches {c['byte_mismatches']}, in flight {len(self.rooms)} | "
            f"kills {c['engine_kills']}, restarts {c['broker_restarts']} | RSS prefill#{len(self.incarnations)} {mib(p_rss)}, "
            f"decode {mib(d_rss)} | {rate:.1f} verified rooms/s ({recent:.1f} in the last interval)"
        )

    # -- run -----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        args = self.args
        self.duration = args.minutes * 60.0
        self.say(
            f"soak: {args.minutes:g} min, fault rate {args.fault_rate:g}, engine kill every ~{args.kill_every:g} s, "
            f"prefill broker restart every ~{args.restart_every:g} s, {args.inflight} rooms in flight per prefill engine; "
            f"logs in {self.workdir}"
        )
        self.decode_broker = BrokerProcess.launch("decode", self.workdir, self.broker_args)
        self.start_prefill_broker()
        self.decode_broker.wait_ready(60)
        self.decode_spec = RankSpec(group=DECODE_GROUP, role="decode")
        self.decode_memory = EngineMemory.allocate(
            self.decode_spec, MODEL, num_pages=args.slots * span_pages(args.max_pages), aux_rows=args.slots, aux_row_bytes=AUX_ROW_BYTES
        )
        self.decode_client = BrokerClient(self.decode_broker.address)
        self.decode = self.decode_client.register_engine(self.decode_spec, self.decode_memory)
        self.children = [Child("steady", STEADY, killable=False), Child("victim", VICTIM, killable=True)]
        for child in self.children:
            self.start_child(child)
        self.t0 = time.monotonic()
        self.next_kill = self.t0 + args.warmup + args.kill_every * self.rng.uniform(0.3, 1.0)
        self.next_restart = self.t0 + args.warmup + args.restart_every * self.rng.uniform(0.5, 1.0)
        next_progress = self.t0 + 30
        next_check = next_poll = self.t0
        warm_done = False
        decode_alive = True
        end = self.t0 + self.duration
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                decode_alive = self.check_brokers()
                if not decode_alive:
                    break
                if not warm_done and now - self.t0 >= args.warmup:
                    warm_done = True
                    self.rss_decode["start"] = read_rss_kib(self.decode_broker.process.pid)
                    self.incarnations[0].rss_warm_kib = read_rss_kib(self.incarnations[0].pid)
                for inc in self.incarnations[1:]:
                    if inc.rss_warm_kib is None and inc.ended == "running" and now - inc.started_at >= args.warmup:
                        inc.rss_warm_kib = read_rss_kib(inc.pid)
            self.maybe_fault()
            self.read_children()
            self.schedule_rooms()
            for room in list(self.rooms.values()):
                if room.abort_at is not None and room.abort_at <= now:
                    room.abort_at = None
                    self.abort_decode(room, "soak: decode abort")
            if now >= next_poll:
                next_poll = now + 0.02
                self.poll_decode()
                self.retire_finished()
            if now >= next_progress:
                next_progress += 30
                self.progress()
            time.sleep(0.005)
        run_seconds = time.monotonic() - self.t0
        return self.finish(run_seconds, decode_alive)

    def finish(self, run_seconds: float, decode_alive: bool) -> dict[str, Any]:
        args = self.args
        # RSS at the end of the load (engines still registered: comparable with the warm-up).
        last = self.incarnations[-1]
        self.rss_decode["end"] = read_rss_kib(self.decode_broker.process.pid) if self.decode_broker else None
        if last.ended == "running" and self.prefill is not None:
            last.rss_last_kib = read_rss_kib(self.prefill.process.pid)
        # 1. Stop sending; let every room in flight end.
        drain_deadline = time.monotonic() + args.stuck_after + 15
        while decode_alive and self.rooms and time.monotonic() < drain_deadline:
            self.check_brokers()
            self.read_children()
            self.poll_decode()
            self.retire_finished()
            time.sleep(0.01)
        unfinished = [f"room {r.id} decode={r.decode_state} settled={r.settled} sender={r.sender_state} tags={sorted(r.tags)}" for r in self.rooms.values()]
        # 2. The engines unregister.
        self.stopping_children = True
        for child in self.children:
            try:
                child.conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
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
        guard_problems = self.decode_memory.check_guards()
        try:
            self.decode.close()
        except KvBrokerError as exc:
            self.event(f"decode UnregisterEngine failed: {exc}")
        self.decode_client.close()
        # 3. Wait for eviction; read the per-room tables.
        wait = args.finished_room_ttl + args.tombstone_ttl + 5
        drained_at = time.monotonic()
        deadline = drained_at + wait
        tables: dict[str, dict[str, int]] = {}
        brokers = {"prefill": self.prefill, "decode": self.decode_broker}
        while True:
            try:
                tables = {name: dict(b.stats().per_room_state) for name, b in brokers.items() if b and b.process.poll() is None}
            except Exception as exc:  # a dead broker
                self.event(f"GetStats failed: {exc}")
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        leaked = {f"{name}.{k}": v for name, t in tables.items() for k, v in t.items() if v}
        late_drain = None
        if leaked:
            # Not a pass, but say whether they go later (a slow timeout) or stay.
            later = time.monotonic() + 60
            while time.monotonic() < later:
                time.sleep(1)
                try:
                    now_tables = {name: dict(b.stats().per_room_state) for name, b in brokers.items() if b and b.process.poll() is None}
                except Exception:
                    break
                if not any(v for t in now_tables.values() for v in t.values()):
                    late_drain = round(time.monotonic() - drained_at, 1)
                    break
            else:
                late_drain = None
        # 4. RSS once idle (engines unregistered, tables evicted), then stop the brokers.
        self.rss_decode["idle"] = read_rss_kib(self.decode_broker.process.pid) if self.decode_broker else None
        last = self.incarnations[-1]
        rss_prefill_idle = read_rss_kib(self.prefill.process.pid) if self.prefill is not None and self.prefill.process.poll() is None else None
        exit_codes = {}
        for name, broker in brokers.items():
            if broker is not None:
                alive = broker.process.poll() is None
                exit_codes[name] = broker.stop() if alive else f"already dead ({broker.process.returncode})"
        last.ended = "stopped" if last.ended == "running" else last.ended
        log_summary = self.log_summary()

        reasons = []
        if self.counts["byte_mismatches"] or guard_problems:
            reasons.append(f"{self.counts['byte_mismatches']} byte mismatches, {len(guard_problems)} overwritten guards")
        if leaked:
            reasons.append(f"leaked records: {leaked}")
        if self.broker_deaths:
            reasons.append(f"{len(self.broker_deaths)} unexpected broker deaths")
        bad_exit = {k: v for k, v in exit_codes.items() if v != 0}
        if bad_exit:
            reasons.append(f"brokers exited badly on SIGTERM: {bad_exit}")
        if not self.counts["rooms_verified"]:
            reasons.append("no room was verified")
        return {
            "ok": not reasons,
            "reasons": reasons,
            "duration_s": round(run_seconds, 1),
            "workdir": str(self.workdir),
            "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
            "rooms_started": self.counts["rooms_started"],
            "rooms_verified": self.counts["rooms_verified"],
            "rooms_failed": self.counts["rooms_failed"],
            "rooms_failed_unexpectedly": self.counts["rooms_failed_unexpectedly"],
            "failed_by_cause": dict(self.failed_by_cause.most_common()),
            "failure_examples": dict(self.cause_examples),
            "unexpected_examples": self.unexpected,
            "outcomes_by_fault": {k: dict(v) for k, v in sorted(self.by_fault.items())},
            "aborts_decode": self.counts["aborts_decode"],
            "aborts_prefill": self.counts["aborts_prefill"],
            "aborted_rooms_that_succeeded": self.counts["aborted_rooms_that_succeeded"],
            "sender_outcomes": dict(self.sender_outcomes.most_common()),
            "sender_examples": dict(self.sender_examples),
            "sides_disagree": dict(self.disagree.most_common()),
            "byte_mismatches": self.counts["byte_mismatches"],
            "mismatch_examples": self.mismatch_examples,
            "guard_problems": guard_problems,
            "decode_init_errors": self.counts["decode_init_errors"],
            "stuck_rooms": self.counts["stuck_rooms"],
            "rooms_never_settled": self.counts["rooms_never_settled"],
            "sender_never_finished": self.counts["sender_never_finished"],
            "unfinished_at_end": unfinished,
            "engine_kills": self.counts["engine_kills"],
            "broker_restarts": self.counts["broker_restarts"],
            "reregister_seconds": {k: {"n": len(v), "max": round(max(v), 2), "mean": round(sum(v) / len(v), 2)} for k, v in self.reregister.items()},
            "fault_to_failure_seconds": {k: {"n": len(v), "max": round(max(v), 2), "mean": round(sum(v) / len(v), 2)} for k, v in self.fault_latency.items()},
            "engine_crashes": self.engine_crashes,
            "broker_deaths": self.broker_deaths,
            "per_room_state": tables,
            "leaked": leaked,
            "leak_drained_after_s": late_drain,
            "eviction_wait_s": wait,
            "rss_kib": {
                "decode": self.rss_decode,
                "prefill_idle": rss_prefill_idle,
                "prefill_incarnations": [
                    {"n": i.n, "pid": i.pid, "warm": i.rss_warm_kib, "last": i.rss_last_kib, "ended": i.ended} for i in self.incarnations
                ],
            },
            "broker_exit": exit_codes,
            "broker_log_warnings": log_summary,
            "events": self.events[-40:],
        }

    def log_summary(self) -> dict[str, dict[str, int]]:
        """Warning-and-worse events of each broker log: event -> count."""
        out: dict[str, dict[str, int]] = {}
        for path in sorted(self.workdir.glob("*.log")):
            counter: collections.Counter[str] = collections.Counter()
            try:
                lines = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    if line.strip():
                        counter["<not json> " + line.strip()[:80]] += 1
                    continue
                if isinstance(record, dict) and record.get("level") in ("warning", "error", "critical", "exception"):
                    counter[f"{record.get('level')} {record.get('event')}"] += 1
            if counter:
                out[path.name] = dict(counter.most_common(12))
        return out

    def cleanup(self) -> None:
        for child in self.children:
            if child.process is not None and child.process.exitcode is None:
                child.process.kill()
        for broker in (self.prefill, self.decode_broker):
            if broker is not None:
                broker.kill()


def print_report(r: dict[str, Any]) -> None:
    p = print
    p("")
    p("=" * 78)
    p(f"soak result: {'PASS' if r['ok'] else 'FAIL'}" + ("" if r["ok"] else f" ({'; '.join(r['reasons'])})"))
    p(f"duration: {r['duration_s']:.1f} s ({r['duration_s'] / 60:.1f} min); logs: {r['workdir']}")
    p(f"rooms: {r['rooms_started']} started, {r['rooms_verified']} SUCCESS and verified byte-exact, {r['rooms_failed']} failed "
      f"({r['rooms_failed_unexpectedly']} not explained by an injected fault)")
    p(f"faults injected: {r['engine_kills']} prefill engine kills, {r['broker_restarts']} prefill broker restarts, "
      f"aborts on {r['aborts_decode'] + r['aborts_prefill']} rooms ({r['aborts_decode']} decode side, {r['aborts_prefill']} prefill side; "
      f"{r['aborted_rooms_that_succeeded']} of them still succeeded)")
    p("rooms failed by cause (decode side):")
    if not r["failed_by_cause"]:
        p("  (none)")
    for cause, n in r["failed_by_cause"].items():
        p(f"  {cause:<16} {n:6d}")
        for example in r["failure_examples"].get(cause, []):
            p(f"      e.g. {example}")
    p("outcomes by injected fault (a room in flight during a fault carries its tag):")
    for tag, outcomes in r["outcomes_by_fault"].items():
        p(f"  {tag:<16} " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])))
    if r["unexpected_examples"]:
        p("unexpected failures (examples):")
        for example in r["unexpected_examples"]:
            p(f"  {example}")
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
      f"pages never settled: {r['rooms_never_settled']}; no sender outcome: {r['sender_never_finished']}; unfinished at the end: {len(r['unfinished_at_end'])}")
    for line in r["unfinished_at_end"][:5]:
        p(f"  {line}")
    for key, v in r["reregister_seconds"].items():
        p(f"engine registration {key}: {v['n']} times, mean {v['mean']} s, max {v['max']} s (from the fault to registered)")
    for key, v in r["fault_to_failure_seconds"].items():
        p(f"from {key} to the decode side's FAILED: {v['n']} rooms, mean {v['mean']} s, max {v['max']} s")
    if r["engine_crashes"]:
        p("engine child crashes:")
        for c in r["engine_crashes"]:
            p(f"  {c}")
    if r["broker_deaths"]:
        p("unexpected broker deaths:")
        for d in r["broker_deaths"]:
            p(f"  {d}")
    p(f"per_room_state after the engines unregistered and {r['eviction_wait_s']:.0f} s (finished TTL + tombstone TTL + 5 s):")
    for name, table in r["per_room_state"].items():
        p(f"  {name:8} " + ", ".join(f"{k}={v}" for k, v in sorted(table.items())))
    p(f"leaked records: {len(r['leaked'])}" + (f" {r['leaked']}; drained after {r['leak_drained_after_s']} s" if r["leaked"] else ""))
    rss = r["rss_kib"]
    p(f"RSS decode broker: {mib(rss['decode'].get('start'))} after warm-up -> {mib(rss['decode'].get('end'))} at the end of the load "
      f"({mib(rss['decode'].get('idle'))} idle, after the engines unregistered)")
    incs = rss["prefill_incarnations"]
    first, last = incs[0], incs[-1]
    when = f"when {first['ended']}" if len(incs) > 1 else f"at the end of the load ({mib(rss['prefill_idle'])} idle)"
    p(f"RSS prefill broker, first incarnation (pid {first['pid']}): {mib(first['warm'])} after warm-up -> {mib(first['last'])} {when}")
    if len(incs) > 1:
        p(f"RSS prefill broker, last incarnation #{last['n']} (pid {last['pid']}): {mib(last['warm'])} after warm-up -> {mib(last['last'])} "
          f"at the end of the load ({mib(rss['prefill_idle'])} idle)")
        p("  every incarnation: " + ", ".join(f"#{i['n']} {mib(i['warm'])}->{mib(i['last'])}" for i in incs))
    p(f"broker exit status on SIGTERM: {r['broker_exit']}")
    if r["broker_log_warnings"]:
        p("warnings and errors in the broker logs (event: count):")
        for name, counter in r["broker_log_warnings"].items():
            p(f"  {name}: " + ", ".join(f"{k} x{v}" for k, v in counter.items()))
    p("=" * 78)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--fault-rate", type=float, default=0.1, help="fraction of rooms aborted mid-flight (0 turns aborts off)")
    parser.add_argument("--kill-every", type=float, default=45.0, help="seconds between prefill engine kills (0: never)")
    parser.add_argument("--restart-every", type=float, default=120.0, help="seconds between prefill broker restarts (0: never)")
    parser.add_argument("--inflight", type=int, default=4, help="rooms in flight per prefill engine")
    parser.add_argument("--slots", type=int, default=24, help="destination slots of the decode pool")
    parser.add_argument("--min-pages", type=int, default=2)
    parser.add_argument("--max-pages", type=int, default=32)
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds without faults at the start (RSS is taken after it)")
    parser.add_argument("--quiet-tail", type=float, default=30.0, help="seconds without faults before the end")
    parser.add_argument("--stuck-after", type=float, default=90.0, help="a room open this long is aborted and counted as stuck")
    parser.add_argument("--peer-heartbeat", type=float, default=0.5)
    parser.add_argument("--peer-dead-after", type=float, default=2.0)
    parser.add_argument("--finished-room-ttl", type=float, default=3.0)
    parser.add_argument("--tombstone-ttl", type=float, default=5.0)
    parser.add_argument("--broker-log-level", default="warning")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--verbose", action="store_true", help="print fault events as they happen")
    parser.add_argument("--json", action="store_true", help="one JSON line on stdout (progress goes to stderr)")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = secrets.randbits(31)
    if args.slots < 2 * args.inflight:
        parser.error("--slots must be at least 2 x --inflight")
    if span_pages(args.max_pages) > PREFILL_POOL_PAGES or args.min_pages < 1 or args.min_pages > args.max_pages:
        parser.error("bad --min-pages/--max-pages")

    torch.set_num_threads(1)
    soak = Soak(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = soak.run()
    except BaseException:
        soak.cleanup()
        raise
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print_report(result)
        if args.verbose or not result["ok"]:
            print("last events:")
            for line in result["events"]:
                print(f"  {line}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

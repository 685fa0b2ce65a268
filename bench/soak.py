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
import json
import random
import secrets
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import rss_bytes, spawn
from soak_decode import DecodeSide, span_pages
from soak_engine import PREFILL_POOL_PAGES, prefill_engine_main
from soak_report import Tally, mib, print_report, result

from kvbroker.testing import BrokerProcess

STEADY, VICTIM = "soak-steady", "soak-victim"


def read_rss_kib(pid: int) -> int | None:
    rss = rss_bytes(pid)
    return None if rss is None else rss // 1024


# The soak: this process orchestrates; its decode engine is soak_decode.py's, the
# prefill engines (child processes) soak_engine.py's, the tally and report soak_report.py's.


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
        self.slots_total = args.slots
        self.children: list[Child] = []
        self.tally = Tally()
        self.counts = self.tally.counts
        self.side = DecodeSide(args, self.rng, self.tally, self.prefill_address, self.event)
        self.rooms = self.side.rooms
        self.events: list[str] = []
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
                broker.wait_ready(60, while_waiting=self.side.poll)
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
        child.incarnation += 1
        log = str(self.workdir / f"engine-{child.name}.log")
        started = spawn(
            f"soak-{child.name}-{child.incarnation}", prefill_engine_main, self.prefill_address, child.group, self.slots_total, log
        )
        child.process, child.conn, child.ready, child.since = started.proc, started.conn, False, time.monotonic()

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
                self.tally.sender_outcomes["KILLED"] += 1
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
            self.tally.reregister[key].append(waited)
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
                self.side.abort(room, "soak: the prefill side could not send")
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
        self.tally.sender(self.rooms.get(rid), outcome, message)

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
            while child.ready and len(child.rooms) < self.args.inflight and self.side.free_slots:
                self.side.open_room(child, self.faults_on())

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
        self.side.register(self.decode_broker.address)
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
                    self.side.abort(room, "soak: decode abort")
            if now >= next_poll:
                next_poll = now + 0.02
                self.side.poll()
                self.side.retire_finished()
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
            self.side.poll()
            self.side.retire_finished()
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
        guard_problems = self.side.unregister()
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
        return result(
            self.tally,
            duration_s=run_seconds,
            workdir=self.workdir,
            config={k: v for k, v in vars(args).items() if k not in ("json",)},
            guard_problems=guard_problems,
            unfinished=unfinished,
            engine_crashes=self.engine_crashes,
            broker_deaths=self.broker_deaths,
            tables=tables,
            leaked=leaked,
            late_drain=late_drain,
            wait=wait,
            rss={
                "decode": self.rss_decode,
                "prefill_idle": rss_prefill_idle,
                "prefill_incarnations": [
                    {"n": i.n, "pid": i.pid, "warm": i.rss_warm_kib, "last": i.rss_last_kib, "ended": i.ended} for i in self.incarnations
                ],
            },
            exit_codes=exit_codes,
            events=self.events,
        )

    def cleanup(self) -> None:
        for child in self.children:
            if child.process is not None and child.process.exitcode is None:
                child.process.kill()
        for broker in (self.prefill, self.decode_broker):
            if broker is not None:
                broker.kill()


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

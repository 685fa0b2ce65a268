"""The harness every benchmark in bench/ runs on (what it holds: bench/README.md).

Importing it sets ``UCX_NET_DEVICES=lo`` unless the environment says otherwise, so no benchmark traffic
leaves loopback (UCX reads it when the first NIXL agent starts; NIXL is imported only where one is made).
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import multiprocessing
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbroker.brokerproc import BrokerProcess
from kvbroker.client import BrokerClient, EngineMemory, ModelSpec, RankSpec, RoomState, SenderRef
from kvbroker.errors import KvBrokerError
from kvbroker.v1 import transfer_pb2

os.environ.setdefault("UCX_NET_DEVICES", "lo")

# -- the model ------------------------------------------------------------------------

MIB, GIB = 1 << 20, 1 << 30
#: The default model: 8 KV heads of 128, bfloat16 (2 bytes), 16 tokens per page.
KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE_BYTES = 8, 128, 16, 2


def model_spec(layers: int, *, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, page_size: int = PAGE_SIZE) -> Any:
    """A ``ModelSpec`` of ``layers`` layers (bfloat16, non-MLA, a K and a V tensor per layer)."""
    return ModelSpec(num_layers=layers, total_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16, page_size=page_size)


def page_bytes(layers: int, *, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, page_size: int = PAGE_SIZE) -> int:
    """Bytes of one page of every layer's K and V of the whole model."""
    return layers * 2 * page_size * kv_heads * head_dim * DTYPE_BYTES

# -- a run: what it holds, how it ends --------------------------------------------------


class BenchFailed(RuntimeError):
    """Something the run depends on failed (a room, a byte, a process): the figures are not valid."""


def bench_main(script: str, args: Any, measure: Callable[[Held], dict[str, Any]], report: Callable[[dict[str, Any]], None],
               *, report_lists_failures: bool = False) -> int:
    """Run ``measure`` with a :class:`Held` of its own (a fresh scratch directory), stop what it holds, print the result
    (``report`` and ``args.broker_arg``, or one JSON line with ``args.json``; when ``measure`` failed, what it put in
    ``held.result``) with the problems as ``failures`` (those it added or returned, the error it raised, what stopping
    found), each problem on stderr unless the report lists them; exit status 130 when interrupted, 1 on any problem,
    else 0."""
    as_json, keep = bool(getattr(args, "json", False)), bool(getattr(args, "keep_logs", False))
    held = Held(Path(tempfile.mkdtemp(prefix=f"kvb-{script}-")), as_json)
    result: dict[str, Any] | None = None
    problems, interrupted = held.problems, False
    try:
        result = measure(held)
        if result.get("failures") is not problems:
            problems.extend(result.get("failures", ()))
    except KeyboardInterrupt:
        interrupted = True
    except BenchFailed as exc:
        problems.append(str(exc))
    except Exception:
        problems.append(traceback.format_exc())
    finally:
        try:
            problems.extend(held.close())
        finally:
            for b in held.brokers if problems and not interrupted else ():
                print(f"--- broker {b.name}, its log's end:\n{b.log_tail(1500)}", file=sys.stderr)
            if keep:
                print(f"{script}: broker logs kept in {held.workdir}", file=sys.stderr)
            else:
                shutil.rmtree(held.workdir, ignore_errors=True)
    if interrupted:
        print(f"{script}: interrupted", file=sys.stderr)
        return 130
    result = held.result or None if result is None else result
    if result is not None:
        result["failures"] = problems
        if as_json:
            print(json.dumps(result, default=str))
        else:
            report(result)
            if getattr(args, "broker_arg", None):
                print(f"brokers started with extra arguments: {' '.join(args.broker_arg)}")
    for problem in problems if result is None or as_json or not report_lists_failures else ():
        print(f"{script}: FAILED: {problem}", file=sys.stderr)
    if problems and held.brokers and not keep:
        print(f"{script}: run again with --keep-logs to keep the broker logs", file=sys.stderr)
    return 1 if problems else 0


def add_run_options(parser: Any, brokers: str = "both ") -> None:
    """The options of a script that runs on :func:`bench_main`: ``--broker-arg``, ``--keep-logs``, ``--json``."""
    parser.add_argument("--broker-arg", action="append", default=[], metavar="ARG",
                        help=f"extra argument for {brokers}`kvbroker serve` (repeatable; e.g. --broker-arg=--peer-dead-after=30)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the broker logs' directory")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the report")


@dataclass
class Group:
    """One tp group's ranks, registered from this process with the broker at ``address``."""
    name: str
    address: str
    memories: list[Any] = field(default_factory=list)
    engines: list[Any] = field(default_factory=list)

    def ref(self) -> Any:
        """The ``SenderRef`` a decode rank names this (prefill) group by."""
        return SenderRef(self.address, self.name)

Step = tuple[str, Callable[[], object]]


@dataclass
class Held:
    """What a run started: its brokers, and the steps that stop the rest (child processes, engines, their clients and
    memory, ...), which :meth:`close` takes the last first, then stops the brokers."""
    workdir: Path
    as_json: bool = False
    brokers: list[Any] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    #: What went wrong so far that does not stop the run.
    problems: list[str] = field(default_factory=list)
    #: What was measured so far: printed if the run fails before it returns.
    result: dict[str, Any] = field(default_factory=dict)

    def say(self, text: str) -> None:
        """A line of progress: on stdout, or on stderr when stdout carries the JSON line."""
        print(text, file=sys.stderr if self.as_json else sys.stdout, flush=True)

    def defer(self, what: str, step: Callable[[], object]) -> None:
        """Run ``step`` when the run stops (an error in it is a problem: ``what`` failed)."""
        self.steps.append((what, step))

    def now(self, *steps: Callable[[], object]) -> None:
        """Run these deferred steps now, in this order."""
        for fn in steps:
            step = next(s for s in self.steps if s[1] == fn)
            self.steps.remove(step)
            _run(step, self.problems)

    def start_brokers(self, names: Sequence[str], extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> list[Any]:
        """``kvbroker serve`` processes on 127.0.0.1, one per name, once all serve."""
        brokers = [BrokerProcess.launch(name, self.workdir, list(extra_args), env=env) for name in names]
        self.brokers.extend(brokers)
        for broker in brokers:
            broker.wait_ready(60)
        return brokers

    def spawn(self, name: str, target: Callable[..., object], *args: Any) -> Child:
        """:func:`spawn` ``target``, which tells this process what failed in it (``("error", text)``)."""
        child = spawn(name, _reporting, target, *args)
        self.defer(f"stopping {name}", child.stop)
        return child

    def group(self, address: str, role: str, model: Any, pages: int, *, tp: int = 1, device: str = "cpu",
              seed: int | None = None, prepare: Callable[[Any], None] | None = None, name: str = "") -> Group:
        """A tp group of ``tp`` ranks of ``role``, ``pages`` pages each on ``device``, registered with the broker at
        ``address`` rank by rank (each a client of its own): allocated, K and V filled (``seed``: :func:`fill_kv`;
        else zero), ``prepare(memory)``, registered."""
        group = Group(name or f"bench-{role}-{secrets.token_hex(4)}", address)
        for tp_rank in range(tp):
            spec = RankSpec(group.name, role, tp_size=tp, tp_rank=tp_rank)
            memory = EngineMemory.allocate(spec, model, num_pages=pages, device=device)
            self.defer("freeing engine memory", memory.close)
            if seed is not None:
                fill_kv(memory, seed + 1000 * tp_rank)
            if prepare is not None:
                prepare(memory)
            client = BrokerClient(address)
            self.defer("closing a client", client.close)
            group.engines.append(client.register_engine(spec, memory))
            self.defer("unregistering an engine", group.engines[-1].close)
            group.memories.append(memory)
        return group

    def release(self, *groups: Group) -> None:
        """Unregister ``groups``' engines and free their memory now (before the run ends)."""
        for g in groups:
            self.now(*(fn for e, m in zip(g.engines, g.memories) for fn in (e.close, e.client.close, m.close)))

    def close(self) -> list[str]:
        """Stop everything; the problems found on the way (a step that failed, a broker that died or exited non-zero on
        SIGTERM)."""
        problems: list[str] = []
        while self.steps:
            _run(self.steps.pop(), problems)
        try:
            for broker in self.brokers:
                died = broker.process.poll() is not None
                code = broker.process.returncode if died else broker.stop()
                if died or code != 0:
                    how = f"died (exit status {code})" if died else f"exited with status {code} on SIGTERM"
                    problems.append(f"broker {broker.name} {how}; log tail:\n" + broker.log_tail(1500))
        finally:
            for broker in self.brokers:
                broker.kill()
        return problems


def _run(step: Step, problems: list[str]) -> None:
    try:
        step[1]()
    except Exception as exc:
        problems.append(f"{step[0]}: {exc!r}")


def allocate(rank: Any, model: Any, num_pages: int, touch: bool = False) -> tuple[Any, float, int]:
    """``EngineMemory.allocate`` (``touch``: and a write to every 4 KiB page, so that the pages are resident); the
    memory, the seconds that took and the memory's bytes."""
    t0 = time.perf_counter()
    memory = EngineMemory.allocate(rank, model, num_pages=num_pages)
    if touch:
        pages = memory.raw.numpy()[::4096]
        pages += 0  # contents and guards unchanged
    return memory, time.perf_counter() - t0, sum(spec.size_bytes for _, spec in memory.buffers)


def release(engine: Any = None, client: Any = None, memory: Any = None) -> Exception | None:
    """Unregister ``engine``, close ``client``, free ``memory`` (those given), each whatever the one before did; the
    engine's unregister error, if any."""
    error = None
    try:
        if engine is not None:
            engine.close()
    except Exception as exc:
        error = exc
    finally:
        if client is not None:
            client.close()
        if memory is not None:
            memory.close()
    return error

# -- /proc (Linux) -----------------------------------------------------------------------

#: A broker's threads by role: its control loop (the main thread), the NIXL data plane (kvb-nixl),
#: the copy thread (kvb-copy: staging gather and scatter), the memory threads (kvb-memory, kvb-warm: mapping
#: and faulting in engine buffers), and every other thread (gRPC's pollers, exporters).
THREAD_ROLES = ("loop", "nixl", "copy", "memory", "other", "fake-gpu")  # fake-gpu: a modelled GPU's copies (not the broker's)
_BY_NAME = {"kvb-nixl": "nixl", "kvb-copy": "copy", "kvb-memory": "memory", "kvb-warm": "memory"}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` (all its threads, ended ones too) used so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()  # the name (field 2) may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds a broker's live threads used so far, summed by role (:data:`THREAD_ROLES`), to the nanosecond:
    /proc/PID/task/TID/schedstat (its first field), where /proc/PID/stat counts 10 ms ticks."""
    out = dict.fromkeys(THREAD_ROLES, 0.0)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh, open(f"/proc/{pid}/task/{tid}/comm") as comm:
                ns, name = int(fh.read().split()[0]), comm.read().strip()
        except (OSError, ValueError, IndexError):
            continue  # the thread ended
        out["loop" if int(tid) == pid else "fake-gpu" if name.startswith("kvb-fakegpu") else _BY_NAME.get(name, "other")] += ns / 1e9
    return out


def cpu_snapshot(processes: Mapping[str, int], brokers: Mapping[str, int] | None = None) -> dict[str, float]:
    """CPU seconds so far of each of ``processes`` (name: pid), then of each of ``brokers`` (side: pid) by thread role,
    as ``"side/role"``."""
    out = {name: cpu_seconds(pid) for name, pid in processes.items()}
    for side, pid in (brokers or {}).items():
        out.update({f"{side}/{role}": s for role, s in thread_cpu_seconds(pid).items()})
    return out


def cpu_delta(before: Mapping[str, float], after: Mapping[str, float], scale: float = 1e3) -> dict[str, float]:
    """``after - before`` of two :func:`cpu_snapshot` s, times ``scale`` (ms by default)."""
    return {name: (v - before[name]) * scale for name, v in after.items()}


def proc_status(pid: int, name: str) -> int | None:
    """The number of field ``name`` of /proc/PID/status (kB for memory, a count for Threads), or None if the process is
    gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) for line in fh if line.startswith(name + ":")), None)
    except OSError:
        return None


def rss(pid: int, unit: int = 1) -> int | None:
    """Resident memory of process ``pid`` (VmRSS) in units of ``unit`` bytes, or None if it is gone."""
    kib = proc_status(pid, "VmRSS")
    return None if kib is None else kib * 1024 // unit


def meminfo_bytes(name: str) -> int:
    """Field ``name`` of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(name + ":"))

# -- statistics ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0-1) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def us_stats(seconds: Sequence[float], *qs: float) -> dict[str, float]:
    """``n``, ``median_us``, ``min_us``, ``max_us`` and ``pNN_us`` for each of ``qs`` of ``seconds``."""
    us = [v * 1e6 for v in seconds]
    out = {"n": len(us), "median_us": statistics.median(us), "min_us": min(us), "max_us": max(us)}
    return out | {f"p{round(q * 100)}_us": percentile(us, q) for q in qs}


def timed_calls(calls: int, fn: Callable[[], object]) -> list[float]:
    """Seconds each of ``calls`` calls of ``fn`` took, one after another."""
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def poll_round_trips(engine: Any, room: int, calls: int) -> list[float]:
    """Seconds of ``calls`` bare unary ``Poll`` calls of ``room`` by ``engine`` (past its session's table: one gRPC
    round trip to its broker each)."""
    client = engine.client
    request = transfer_pb2.PollRequest(engine_id=engine.engine_id, rooms=[room])
    return timed_calls(calls, lambda: client.call(client.stub.Poll, request))

# -- child processes -------------------------------------------------------------------


@dataclass
class Child:
    """A spawned child process and this end of its pipe. Its messages are tuples whose first item names them;
    ``("error", text)`` reports its failure."""
    name: str
    proc: BaseProcess
    conn: Connection

    def recv(self, timeout: float, expect: str | None = None) -> Any:
        """The next message (which must be ``expect``, if given); :class:`BenchFailed` if the child fails, exits,
        closes its pipe or says nothing for ``timeout`` s."""
        what = repr(expect) if expect else "an answer"
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.1):
            if not self.proc.is_alive():
                raise BenchFailed(f"{self.name} exited (status {self.proc.exitcode}) before {what}")
            if time.monotonic() > deadline:
                raise BenchFailed(f"{self.name}: no {what} after {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise BenchFailed(f"{self.name} closed its pipe before {what}") from None
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            raise BenchFailed(f"{self.name}: {msg[1]}")
        if expect is not None and msg[0] != expect:
            raise BenchFailed(f"{self.name}: expected {expect!r}, got {msg[0]!r}")
        return msg

    def ask(self, *command: Any, timeout: float = 600, expect: str | None = None) -> Any:
        """Send ``command`` (a tuple) and return the answer (:meth:`recv`)."""
        self.conn.send(command)
        return self.recv(timeout, expect)

    def stop(self, bye: Any = ("exit",), wait: float = 10) -> None:
        """Send ``bye``, give the child ``wait`` s to exit, then terminate or kill it."""
        with suppress(OSError, ValueError):
            self.conn.send(bye)
        self.proc.join(wait)
        for end, grace in ((self.proc.terminate, 5), (self.proc.kill, None)):
            if self.proc.is_alive():
                end()
                self.proc.join(grace)
        self.conn.close()


def spawn(name: str, target: Callable[..., object], *args: Any) -> Child:
    """Start ``target(conn, *args)`` in a spawned daemon process; its :class:`Child`."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
    proc.start()
    child.close()
    return Child(name, proc, parent)


def _reporting(conn: Connection, target: Callable[..., object], *args: Any) -> None:
    """In a child: ``target(conn, *args)``; what fails in it (an interrupt aside) is told to the parent."""
    try:
        target(conn, *args)
    except KeyboardInterrupt:
        pass
    except BaseException:
        with suppress(Exception):
            conn.send(("error", traceback.format_exc(limit=6)))
        raise

# -- rooms ---------------------------------------------------------------------------------


def wait_open(engine: Any, rooms: Sequence[int], timeout: float, interval: float = 0.05) -> dict[int, Any]:
    """Poll ``rooms`` until each is WAITING_FOR_INPUT or later (its receiver registered with its sender); their
    statuses. :class:`BenchFailed` if one FAILED or ``timeout`` s pass first."""
    deadline = time.monotonic() + timeout
    while True:
        states: dict[int, Any] = engine.poll(rooms)
        late = [s for s in states.values() if s.state < RoomState.WAITING_FOR_INPUT]
        if not late:
            return states
        if any(s.state == RoomState.FAILED for s in late) or time.monotonic() > deadline:
            kinds = sorted({(RoomState(s.state).name, s.cause.message[:120]) for s in late})[:3]
            raise BenchFailed(f"{len(late)} of {len(rooms)} rooms did not open in {timeout:.0f} s: {kinds}")
        time.sleep(interval)


def failed_rooms(what: str, statuses: Mapping[int, Any]) -> None:
    """:class:`BenchFailed` unless every one of ``statuses`` is SUCCESS."""
    bad = [(r, s.cause.message) for r, s in statuses.items() if s.state != RoomState.SUCCESS]
    if bad:
        raise BenchFailed(f"{what}: {len(bad)} of {len(statuses)} rooms did not succeed, e.g. {bad[0]}")


def move_room(room: int, prefill: Any, decode: Sequence[Any], sender: Any, src: Any, dst: Any,
              chunk_pages: int, timeout: float) -> tuple[float, list[str]]:
    """Move one room: each decode engine expects pages ``dst`` from ``sender`` (a ``SenderRef``), the prefill engine
    sends pages ``src`` in chunks of ``chunk_pages``, and every rank waits for the end. When the decode ranks had
    ended (``time.monotonic``), and the problems: failed calls and ranks that did not end SUCCESS (none: the room
    moved; its bytes are not checked)."""
    problems: list[str] = []
    try:
        for engine in decode:
            engine.receiver(room, sender).init(dst)
        send = prefill.sender(room)
        send.init(num_pages=len(src))
        for a in range(0, len(src), chunk_pages):
            send.send(src[a : a + chunk_pages])
    except KvBrokerError as exc:
        problems.append(f"room {room}: a control call failed: {type(exc).__name__}: {exc}")
    statuses = []

    def wait(engine: Any, side: str) -> None:
        try:
            statuses.append(engine.wait([room], timeout_seconds=timeout)[room])
        except KvBrokerError as exc:
            problems.append(f"room {room}: waiting on {side}: {type(exc).__name__}: {exc}")

    for engine in decode:
        wait(engine, "a decode rank")
    decoded = time.monotonic()
    wait(prefill, "the prefill rank")
    bad = sorted({f"{RoomState(s.state).name}: {s.cause.message}" for s in statuses if s.state != RoomState.SUCCESS})
    if bad:
        problems.append(f"room {room} did not succeed on every rank: {bad}")
    return decoded, problems

# -- bytes -------------------------------------------------------------------------------


def fill_pattern(buf: Any, seed: int) -> None:
    """Write distinct, never-zero 8-byte words over ``buf`` (a contiguous numpy array or CPU tensor, a multiple of 8
    bytes), in place; the same words for the same seed and size."""
    if not isinstance(buf, np.ndarray):
        buf = buf.view(torch.uint8).numpy()
    words = buf.reshape(-1).view(np.uint64)
    step = 1 << 22
    for i in range(0, words.size, step):
        x = np.arange(i, min(i + step, words.size), dtype=np.uint64)
        x += np.uint64(seed) << np.uint64(40)
        x *= np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(29)
        x |= np.uint64(1)
        words[i : i + x.size] = x


def fill_kv(memory: Any, seed: int) -> None:
    """Fill every K and V tensor of ``memory``: :func:`fill_pattern` (seed ``seed`` + its index) on the host, random
    bytes on a GPU."""
    tensors = [t for layer in sorted(memory.k) for t in memory.kv_tensors(layer)]
    for i, t in enumerate(tensors):
        if t.device.type == "cpu":
            fill_pattern(t, seed + i)
        else:
            t.view(torch.uint8).random_(0, 256)
    sync(tensors[0].device)


def kv_mismatches(what: str, prefill: Sequence[Any], decode: Sequence[Any], src: Any, dst: Any) -> list[str]:
    """Where the decode ranks' K and V pages ``dst`` differ from the prefill ranks' pages ``src``, compared as bytes,
    head by head (the ranks of a tp group hold equal shares of the KV heads, in rank order), for every layer.
    ``prefill`` and ``decode`` are the ranks' ``EngineMemory``; empty: equal."""
    def index(pages: Any, device: Any) -> Any:
        return torch.as_tensor(np.asarray(pages).reshape(-1)).to(device=device, dtype=torch.int64)

    problems = []
    for layer in sorted(decode[0].k):
        for kind in ("k", "v"):
            wants = [(p, t[index(src, t.device)]) for p, t in enumerate(getattr(m, kind)[layer] for m in prefill)]
            for d, memory in enumerate(decode):
                tensor = getattr(memory, kind)[layer]
                got = tensor[index(dst, tensor.device)]
                heads = got.shape[2]  # [pages, tokens, heads, head_dim]
                for p, want in wants:
                    lo, hi = max(d * heads, p * want.shape[2]), min((d + 1) * heads, (p + 1) * want.shape[2])
                    if lo >= hi:
                        continue
                    mine = got[:, :, lo - d * heads : hi - d * heads]
                    theirs = want[:, :, lo - p * want.shape[2] : hi - p * want.shape[2]]
                    if not torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)):
                        problems.append(f"{what}: layer {layer} {kind.upper()}: decode rank {d}'s pages differ from prefill rank {p}'s")
    return problems


def check_kv(what: str, prefill: Group, decode: Group, src: Any, dst: Any) -> None:
    """:class:`BenchFailed` at the first of :func:`kv_mismatches`."""
    wrong = kv_mismatches(what, prefill.memories, decode.memories, src, dst)
    if wrong:
        raise BenchFailed(wrong[0])

Shape = tuple[int, int, int]  # a buffer as [region, page, byte]
Pages = tuple[np.ndarray, np.ndarray]  # (src, dst) page indices


def pattern_bytes(seed: int, n: int, device: Any) -> Any:
    """``n`` pseudo-random bytes, the same in every process for one device and seed."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


def sync(device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shaped(flat: Any, shape: Shape) -> Any:
    return flat[: math.prod(shape)].view(shape)


def differs(dst: Any, ref: Any, shape: Shape, pages: Pages | None) -> str:
    """'' if ``dst`` holds ``ref``'s bytes (all, or dst pages = src pages of every region)."""
    if pages is None:
        return "" if torch.equal(dst, ref) else "the buffer differs from the source"
    s, d = (torch.from_numpy(p.ravel()).to(dst.device) for p in pages)
    dv, rv = shaped(dst, shape), shaped(ref, shape)
    bad = [r for r in range(shape[0]) if not torch.equal(dv[r][d], rv[r][s])]
    return f"regions {bad[:8]} differ from their source pages" if bad else ""


def require(what: str, problem: str) -> None:
    if problem:
        raise BenchFailed(f"{what}: byte mismatch: {problem}")

# -- raw NIXL ------------------------------------------------------------------------------


def bare_agent(name: str, *, ucx_error_mode: str = "peer", telemetry: bool = False) -> Any:
    """A bare NIXL agent made like the broker's: no progress thread, the UCX backend with the broker's error mode
    (``telemetry``: per-transfer telemetry on)."""
    from kvbroker.broker.dataplane._agent import import_nixl
    api = import_nixl()
    # After the import: NIXL's logging setup (dictConfig, on first import) sets its logger to INFO on
    # stdout, which would break --json.
    logging.getLogger("nixl").setLevel(logging.WARNING)
    config = api.nixl_agent_config(enable_prog_thread=False, backends=[], capture_telemetry=telemetry)
    agent = api.nixl_agent(name, config)
    agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_mode})
    return agent


def _mem(device: Any) -> tuple[str, int]:
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


def _register(agent: Any, *tensors: Any) -> None:
    for t in tensors:
        agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), _mem(t.device)[1], "")], _mem(t.device)[0])


def _settle(agent: Any, handles: list[Any], what: str, count: list[int] | None = None) -> list[Any]:
    """Progress posted transfers: release those DONE (adding their descriptors to ``count``), raise on ERR; those in
    flight."""
    left = []
    for h in handles:
        state = agent.check_xfer_state(h)
        if state == "ERR":
            raise BenchFailed(f"{what}: a NIXL transfer failed")
        if state != "DONE":
            left.append(h)
            continue
        if count is not None:
            count[0] += int(agent.get_xfer_telemetry(h).descCount)
        agent.release_xfer_handle(h)
    return left


class Lane:
    """A dedicated CUDA stream and blocking events on it; on the host work is done when issued, unless a modelled GPU
    (``streams``: kvbroker.testing.gpu_model) says when it is done."""

    def __init__(self, device: Any, streams: Any = None) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.streams = streams

    def on(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def mark(self, op: str, nbytes: int) -> Any:
        """An event after the work issued so far (``op`` over ``nbytes``: what a modelled GPU times)."""
        if self.streams is not None:
            from kvbroker.broker.device import Work
            return self.streams.timelines.take(op, self.streams.host, 0, self.streams.model.job_seconds(Work(op, nbytes)), nbytes)
        event = torch.cuda.Event(blocking=True) if self.stream is not None else None
        if event is not None:
            event.record(self.stream)
        return event

    @staticmethod
    def done(event: Any, wait: bool) -> bool:
        if isinstance(event, float):  # a modelled GPU's: when it completes
            if wait:
                time.sleep(max(0.0, event - time.monotonic()))
            return time.monotonic() >= event
        if event is not None and wait:
            event.synchronize()
        return event is None or wait or bool(event.query())


def modelled(spec: str | None) -> tuple[Any, Any]:
    """The modelled GPU ``spec`` names (kvbroker.testing.gpu_model), as a lane's streams and a write clock; (None, None)
    without one."""
    if not spec:
        return None, None
    from kvbroker.testing.gpu_model import ModelledStreams, ModelSetting
    streams = ModelledStreams(ModelSetting.parse(spec))
    return streams, streams.clock()


def _scatter_slots(agent: Any, peer: str, dstv: Any, ring: Any, didx: list[Any], timeout: float,
                   lane: Lane) -> tuple[float, dict[int, dict[str, float]]]:
    """The staged path's target: scatter each slot that arrives, then return it; the end time, and each chunk's times
    (``r.`` hops of ``kvbroker.testing.otlp.PART_HOPS``)."""
    pending, done, hops = deque(), 0, {}
    regions, _, page = dstv.shape
    deadline = time.monotonic() + timeout
    while done < len(didx):
        arrived = 0
        for msgs in agent.get_new_notifs().values():
            for msg in msgs:
                i, k = map(int, bytes(msg).decode().split(":"))
                hops[i] = {"r.notice": time.monotonic(), "r.scatter_start": time.monotonic()}
                slot = ring[k, : regions * didx[i].numel() * page].view(regions, -1, page)
                with lane.on():
                    dstv.index_copy_(1, didx[i], slot)
                pending.append((k, lane.mark("scatter", slot.numel()), i))
                arrived += 1
        while pending and Lane.done(pending[0][1], wait=not arrived):
            k, _, i = pending.popleft()
            hops[i]["r.scatter_end"] = time.monotonic()
            agent.send_notif(peer, str(k).encode())
            done += 1
        if not arrived:
            os.sched_yield()  # a pass that found nothing gives the kernel its turn (UCX's TCP lanes need it on small hosts)
        if time.monotonic() > deadline:
            raise BenchFailed(f"raw staged target: {done} of {len(didx)} chunks after {timeout} s")
    return time.perf_counter(), hops


def _target_main(conn: Connection, device_name: str, nbytes: int, dst_path: str, slot_bytes: int, slots: int,
                 seed: int, ucx_error_mode: str, model: str | None = None) -> None:
    """The raw NIXL target process: the destination and slots; zeroes, checks, waits for a notification and scatters on
    command (each answered ("ok", value))."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # as the broker's copies: a pool of a thread per core spins on the cores the other side needs
    streams, clock = modelled(model)
    agent = bare_agent(f"bench-target-{os.getpid()}", ucx_error_mode=ucx_error_mode)
    if clock is not None:
        from kvbroker.testing.gpu_model import ModelledNixl
        agent = ModelledNixl(agent, clock)
    lane = Lane(device, streams)
    if dst_path:  # the initiator's memfd: it reads the bytes itself
        fd = os.open(dst_path, os.O_RDWR)
        dst = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
        os.close(fd)
    else:
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    ring = torch.zeros(slots, slot_bytes, dtype=torch.uint8, device=device)
    _register(agent, dst, *([ring] if slots else []))
    ref = None
    conn.send((bytes(agent.get_agent_metadata()), dst.data_ptr(), ring.data_ptr()))
    peer = agent.add_remote_agent(conn.recv())
    shape, didx = (1, nbytes, 1), []
    while True:
        while not conn.poll(0.001):
            agent.get_new_notifs()  # progress while idle, as a serving process would
        cmd, *a = conn.recv()
        out: Any = None
        if cmd == "exit":
            break
        if cmd == "zero":
            dst.zero_()
        elif cmd == "plan":  # the dst pages of each chunk, for the staged path
            shape, didx = a[0], [torch.from_numpy(d).to(device) for d in a[1]]
        elif cmd == "scatter":
            conn.send(("ok", None))
            out = _scatter_slots(agent, peer, shaped(dst, shape), ring, didx, a[0], lane)
        elif cmd == "arm":  # when the notification ``a[0]`` arrives (None: not within a[1] s)
            conn.send(("ok", None))
            deadline = time.monotonic() + a[1]
            while out is None and time.monotonic() < deadline:
                if any(a[0] in msgs for msgs in agent.get_new_notifs().values()):
                    out = time.perf_counter()
                else:
                    time.sleep(100e-6)
        elif cmd == "verify":
            ref = pattern_bytes(seed, nbytes, device) if ref is None else ref  # the initiator's source
            out = differs(dst, ref, a[0], a[1])
        sync(device)
        conn.send(("ok", out))


class RawPeer:
    """Bare NIXL agents made like the broker's: this process initiates from ``src`` (by default ``nbytes`` of
    :func:`pattern_bytes`, registered), a spawned target holds the destination (on a GPU, or a memfd this process
    maps too, ``dst``) and ``slots`` transfer slots of the staged path. The target polls for notifications every 100
    us while it waits for one, and every 1 ms while idle."""

    def __init__(self, held: Held, device: Any, nbytes: int, *, src: Any = None, slot_bytes: int = 0,
                 slots: int = 0, seed: int = 1, ucx_error_mode: str = "peer", telemetry: bool = False,
                 model: str | None = None) -> None:
        self.device, self.slots, self.slot_bytes, self.telemetry = device, slots, slot_bytes, telemetry
        dst_path = ""
        self.dst: np.ndarray | None = None
        if device.type == "cpu":
            self.fd = os.memfd_create("kvbroker-bench-raw-dst", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, nbytes)
            self.dst = np.frombuffer(mmap.mmap(self.fd, nbytes), dtype=np.uint8)
            self.dst[:] = 0  # touch every page before anything is timed
            dst_path = f"/proc/{os.getpid()}/fd/{self.fd}"
            held.defer("closing the raw NIXL destination", lambda: os.close(self.fd))
        self.held = held
        self.child = held.spawn("raw NIXL target", _target_main, str(device), nbytes, dst_path, slot_bytes,
                                slots, seed, ucx_error_mode, model)
        streams, clock = modelled(model)
        torch.set_num_threads(1)  # as the target's
        self.agent = bare_agent(f"bench-initiator-{os.getpid()}", ucx_error_mode=ucx_error_mode, telemetry=telemetry)
        if clock is not None:
            from kvbroker.testing.gpu_model import ModelledNixl
            self.agent = ModelledNixl(self.agent, clock)
        self.src = pattern_bytes(seed, nbytes, device) if src is None else src
        self.ring = torch.zeros(slots, slot_bytes, dtype=torch.uint8, device=device)
        _register(self.agent, self.src, *([self.ring] if slots else []))
        self.mem, self.dev = _mem(device)
        meta, self.dst_ptr, self.ring_ptr = self.child.recv(300)
        self.peer = self.agent.add_remote_agent(meta)
        self.peer = self.peer.decode() if isinstance(self.peer, bytes) else self.peer
        self.child.conn.send(bytes(self.agent.get_agent_metadata()))
        self.lane = Lane(device, streams)
        self.seq = 0
        sync(device)

    def call(self, *cmd: Any, timeout: float = 600) -> Any:
        return self.child.ask(*cmd, timeout=timeout)[1]

    def close(self) -> None:
        """Stop the target now (before the run ends)."""
        self.held.now(self.child.stop)

    def check(self, what: str, shape: Shape, pages: Pages | None) -> None:
        """The target's destination holds the default source's bytes (all, or ``pages`` of every region)."""
        require(what, self.call("verify", shape, pages))

    def descs(self, rows: np.ndarray) -> Any:
        return self.agent.get_xfer_descs(rows, self.mem)

    def one(self, base: int, size: int) -> Any:
        return self.descs(np.array([[base, size, self.dev]], dtype=np.uint64))

    def post_all(self, work: Sequence[tuple[Any, Any]], what: str, timeout: float, *, notify: bool = False,
                 make: Callable[[Any, Any, bytes], Any] | None = None) -> tuple[float, dict[str, float]]:
        """One WRITE per (local, remote) pair, back to back (``make(local, remote, notif)``: its handle; default
        ``initialize_xfer``); seconds until all are DONE and (``notify``) the target saw the last one's
        notification, and when each happened (ms)."""
        self.seq += 1
        tag = f"bench-{self.seq}".encode() if notify else b""
        if notify:
            self.call("arm", tag, timeout)
        agent, handles, descriptors = self.agent, [], [0]
        t0 = time.perf_counter()
        for i, (local, remote) in enumerate(work):
            notif = tag if i == len(work) - 1 else b""
            h = make(local, remote, notif) if make else agent.initialize_xfer("WRITE", local, remote, self.peer, notif)
            if agent.transfer(h) == "ERR":
                raise BenchFailed(f"{what}: NIXL refused a transfer")
            handles.append(h)
        t_posted = time.perf_counter()
        deadline = time.monotonic() + timeout
        while handles:
            handles = _settle(agent, handles, what, descriptors if self.telemetry else None)
            if handles and time.monotonic() > deadline:
                raise BenchFailed(f"{what}: transfers not DONE after {timeout} s")
        t_done = t_notif = time.perf_counter()
        if notify:
            t_notif = self.child.recv(timeout + 10)[1]
            if t_notif is None:
                raise BenchFailed(f"{what}: the target never saw the notification")
        ms = {k: (t - t0) * 1e3 for k, t in (("post_ms", t_posted), ("done_ms", t_done), ("notif_ms", t_notif))}
        return max(t_done, t_notif) - t0, ms | {"transfers": len(work), "descriptors": descriptors[0]}

    def staged(self, shape: Shape, chunk_bytes: int, sidx: list[Any], timeout: float, hops: list[Any] | None = None) -> float:
        """Gather -> one WRITE -> scatter per chunk (its pages ``sidx``, of every region of ``shape``), ``slots`` in
        flight; s to the last scatter (the target was told the dst pages: ``call("plan", ...)``). ``hops``: gets each
        chunk's times (as ``kvbroker.testing.otlp.PART_HOPS`` names them)."""
        ag, n, step, now = self.agent, len(sidx), self.slot_bytes, time.monotonic
        times = [{"s.handed_on": now()} for _ in range(n)]
        holder, writing = {}, {}
        slots = [(self.one(self.ring.data_ptr() + k * step, chunk_bytes),
                  self.one(self.ring_ptr + k * step, chunk_bytes)) for k in range(self.slots)]
        srcv = shaped(self.src, shape)
        free, gathered, inflight = deque(range(self.slots)), deque(), []
        issued = credits = 0
        self.call("scatter", timeout)
        deadline = time.monotonic() + timeout
        t0 = time.perf_counter()
        while credits < n:
            while issued < n and free:
                k = free.popleft()
                holder[k], t = issued, times[issued]
                t["s.slot"] = t["s.credit"] = t["s.gather_start"] = now()
                slot = self.ring[k, :chunk_bytes].view(shape[0], -1, shape[2])
                with self.lane.on():
                    torch.index_select(srcv, 1, sidx[issued], out=slot)
                gathered.append((issued, k, self.lane.mark("gather", chunk_bytes)))
                issued += 1
            if gathered and Lane.done(gathered[0][2], wait=not inflight):
                i, k, _ = gathered.popleft()
                times[i]["s.gathered"] = now()
                h = ag.initialize_xfer("WRITE", *slots[k], self.peer, f"{i}:{k}".encode())
                if ag.transfer(h) == "ERR":
                    raise BenchFailed("raw staged: NIXL refused a transfer")
                times[i]["s.posted"], writing[id(h)] = now(), i
                inflight.append(h)
            left = _settle(ag, inflight, "raw staged")
            for h in inflight if len(left) < len(inflight) else ():
                if h not in left:
                    times[writing.pop(id(h))]["s.done"] = now()
            inflight = left
            returned = [int(bytes(m)) for msgs in ag.get_new_notifs().values() for m in msgs]
            for k in returned:
                times[holder[k]]["s.credit_back"] = now()
            free.extend(returned)
            credits += len(returned)
            if not returned:
                os.sched_yield()  # as the target's loop
            if time.monotonic() > deadline:
                raise BenchFailed(f"raw staged: {credits} of {n} chunks after {timeout} s")
        t_end, seen = self.child.recv(timeout)[1]
        while inflight:
            inflight = _settle(ag, inflight, "raw staged")
        for i, t in seen.items() if hops is not None else ():
            hops.append(times[i] | t)
        return float(t_end - t0)

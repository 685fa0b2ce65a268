"""The harness every benchmark in bench/ runs on (what it holds: bench/README.md).

Importing it sets ``UCX_NET_DEVICES=lo`` unless the environment says otherwise, so no benchmark traffic
leaves loopback (UCX reads it when the first NIXL agent starts; NIXL is imported only where one is made).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from kvbroker.brokerproc import BrokerProcess
from kvbroker.client import BrokerClient, EngineMemory, ModelSpec, RankSpec, RoomState, SenderRef
from kvbroker.errors import KvBrokerError
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.testing.rawpeer import PeerFailed, sync
from kvbroker.v1 import peer_pb2, peer_pb2_grpc, transfer_pb2

os.environ.setdefault("UCX_NET_DEVICES", "lo")

# -- the model ------------------------------------------------------------------------

MIB, GIB = 1 << 20, 1 << 30
#: The default model: 8 KV heads of 128, bfloat16 (2 bytes), 16 tokens per page.
KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE_BYTES = 8, 128, 16, 2


def model_spec(layers: int, *, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, page_size: int = PAGE_SIZE) -> Any:
    """A ``ModelSpec`` of ``layers`` layers (bfloat16, non-MLA, a K and a V tensor per layer)."""
    return ModelSpec(num_layers=layers, total_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16, page_size=page_size)


def page_bytes(layers: int) -> int:
    """Bytes of one page of every layer's K and V of the default model."""
    return layers * 2 * PAGE_SIZE * KV_HEADS * HEAD_DIM * DTYPE_BYTES

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
    except (BenchFailed, PeerFailed) as exc:  # PeerFailed: the raw NIXL peer's (kvbroker.testing.rawpeer)
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
        for other in (client, memory):
            if other is not None:
                other.close()
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


def proc_status(pid: int | None, name: str) -> int | None:
    """The number of field ``name`` of /proc/PID/status, or of /proc/meminfo (the host's) when ``pid`` is None (kB for
    memory, a count for Threads); None if the process is gone."""
    try:
        with open("/proc/meminfo" if pid is None else f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) for line in fh if line.startswith(name + ":")), None)
    except OSError:
        return None


def rss(pid: int, unit: int = 1) -> int | None:
    """Resident memory of process ``pid`` (VmRSS) in units of ``unit`` bytes, or None if it is gone."""
    kib = proc_status(pid, "VmRSS")
    return None if kib is None else kib * 1024 // unit

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

def stream_round_trips(address: str, calls: int) -> dict[str, list[float]]:
    """Seconds of ``calls`` Ping round trips, one after another, on a bare peer stream (``PeerBroker.Stream``) to the
    broker at ``address``, answered by its loop: ``sync``, a grpc stream fed by a request iterator, as an engine's
    session is; ``aio``, a grpc.aio stream. The floor under a session hop, in the same processes."""
    import asyncio
    import queue
    opening = peer_pb2.PeerFrame(open=peer_pb2.StreamOpen(protocol_version=PROTOCOL_VERSION, broker_id="rtt-probe"))

    def ping(i: int) -> peer_pb2.PeerFrame:
        return peer_pb2.PeerFrame(calls=[peer_pb2.PeerCall(id=i, ping=peer_pb2.PingRequest(from_broker_id="rtt-probe"))])

    def answered(frame: Any) -> None:
        if len(frame.answers) != 1 or frame.answers[0].code:
            raise BenchFailed(f"a bare stream's Ping was answered {frame}")

    requests: Any = queue.SimpleQueue()
    requests.put(opening)
    with grpc.insecure_channel(address) as channel:
        frames = peer_pb2_grpc.PeerBrokerStub(channel).Stream(iter(requests.get, None))
        next(frames)
        sync_took = timed_calls(calls, lambda: (requests.put(ping(1)), answered(next(frames))))
        requests.put(None)

    async def aio() -> list[float]:
        async with grpc.aio.insecure_channel(address) as channel:
            call = peer_pb2_grpc.PeerBrokerStub(channel).Stream()
            await call.write(opening)
            await call.read()
            took = []
            for i in range(calls):
                t = time.perf_counter()
                await call.write(ping(i + 1))
                answered(await call.read())
                took.append(time.perf_counter() - t)
            await call.done_writing()
            return took

    return {"sync": sync_took, "aio": asyncio.run(aio())}

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

"""What the benchmark scripts share: the model they move, how they start and
stop brokers and child processes, what they read from /proc, how they check
the bytes that moved, and how a run ends (its report, failures, exit status).

The scripts import it as a sibling module (``python bench/x.py`` puts bench/
on ``sys.path``). Importing it sets ``UCX_NET_DEVICES=lo`` unless the
environment says otherwise, so no benchmark traffic leaves loopback. kvbroker,
torch and NIXL are imported only by the helpers that need them.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("UCX_NET_DEVICES", "lo")

# -- the model ------------------------------------------------------------------------

MIB = 1 << 20
GIB = 1 << 30
#: The default model: 8 KV heads of 128, bfloat16, 16 tokens per page.
KV_HEADS = 8
HEAD_DIM = 128
PAGE_SIZE = 16
DTYPE_BYTES = 2  # bfloat16


def model_spec(layers: int, *, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, page_size: int = PAGE_SIZE) -> Any:
    """A ``ModelSpec`` of ``layers`` layers (bfloat16, non-MLA, a K and a V tensor per layer)."""
    import torch

    from kvbroker.client import ModelSpec

    return ModelSpec(num_layers=layers, total_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16, page_size=page_size)


def page_bytes(layers: int, *, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM, page_size: int = PAGE_SIZE) -> int:
    """Bytes of one page of every layer's K and V of the whole model."""
    return layers * 2 * page_size * kv_heads * head_dim * DTYPE_BYTES


# -- how a run ends ------------------------------------------------------------------------


class BenchFailed(RuntimeError):
    """Something the run depends on failed (a room, a byte, a process): the figures are not valid."""


def finish(
    script: str,
    result: dict[str, Any] | None,
    problems: list[str],
    *,
    interrupted: bool,
    as_json: bool,
    print_report: Callable[[dict[str, Any]], None],
    report_lists_failures: bool = False,
) -> int:
    """Print ``result`` (one JSON line, or ``print_report``) with ``problems``
    as its ``failures``, then each problem on stderr (unless the printed
    report already lists them); the exit status: 130 when interrupted, 1 on
    any problem, else 0."""
    if interrupted:
        print(f"{script}: interrupted", file=sys.stderr)
        return 130
    if result is not None:
        result["failures"] = problems
        if as_json:
            print(json.dumps(result))
        else:
            print_report(result)
    if result is None or as_json or not report_lists_failures:
        for problem in problems:
            print(f"{script}: FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def bench_main(
    script: str,
    args: Any,
    measure: Callable[[Held], dict[str, Any]],
    *,
    print_report: Callable[[dict[str, Any]], None],
    report_lists_failures: bool = False,
) -> int:
    """Run ``measure`` with a :class:`Held` of its own (a fresh scratch
    directory), stop everything it holds, and :func:`finish`.

    The problems are what ``measure`` added to ``held.problems`` or returned
    as its result's ``failures``, a :class:`BenchFailed` it raised (its
    message) or any other error (its traceback), and what stopping found (a
    broker that died or exited non-zero). The scratch directory (the broker
    logs) is removed unless ``args.keep_logs``; ``args.json`` picks the
    output.
    """
    held = Held(Path(tempfile.mkdtemp(prefix=f"kvb-{script}-")))
    keep = bool(getattr(args, "keep_logs", False))
    result: dict[str, Any] | None = None
    problems = held.problems
    interrupted = False
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
            if keep:
                print(f"{script}: broker logs kept in {held.workdir}", file=sys.stderr)
            else:
                shutil.rmtree(held.workdir, ignore_errors=True)
    if problems and hasattr(args, "keep_logs") and not keep and not interrupted:
        print(f"{script}: run again with --keep-logs to keep the broker logs", file=sys.stderr)
    return finish(
        script,
        result,
        problems,
        interrupted=interrupted,
        as_json=args.json,
        print_report=print_report,
        report_lists_failures=report_lists_failures,
    )


def add_run_options(parser: Any, brokers: str = "both ") -> None:
    """The options of a script that runs on :func:`bench_main`: ``--broker-arg``, ``--keep-logs``, ``--json``."""
    parser.add_argument(
        "--broker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help=f"extra argument for {brokers}`kvbroker serve` (repeatable; e.g. --broker-arg=--peer-dead-after=30)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the broker logs' directory")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the report")


# -- /proc (Linux) -----------------------------------------------------------------------

#: A broker's threads by role: its control loop (the main thread), the NIXL
#: data plane (kvb-nixl), the copy thread (kvb-copy: staging gather and
#: scatter), the memory thread (kvb-memory: mapping and faulting in engine
#: buffers), and every other thread (gRPC's pollers, exporters).
THREAD_ROLES = ("loop", "nixl", "copy", "memory", "other")
_BY_NAME = {"kvb-nixl": "nixl", "kvb-copy": "copy", "kvb-memory": "memory"}


def _ticks(stat: str) -> int:
    # The command name (field 2) may contain spaces: split after its ')'.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime and stime, fields 14 and 15 of proc(5)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` (all its threads) used so far."""
    with open(f"/proc/{pid}/stat") as fh:
        return _ticks(fh.read()) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds a broker's threads used so far, summed by role (:data:`THREAD_ROLES`)."""
    out = dict.fromkeys(THREAD_ROLES, 0.0)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue  # the thread ended
        name = stat.split("(", 1)[1].rsplit(")", 1)[0]
        role = "loop" if int(tid) == pid else _BY_NAME.get(name, "other")
        out[role] += _ticks(stat) / os.sysconf("SC_CLK_TCK")
    return out


def cpu_snapshot(processes: Mapping[str, int], brokers: Mapping[str, int] | None = None) -> dict[str, float]:
    """CPU seconds so far of each of ``processes`` (name: pid), then of each
    of ``brokers`` (side: pid) by thread role, as ``"side/role"``."""
    out = {name: cpu_seconds(pid) for name, pid in processes.items()}
    for side, pid in (brokers or {}).items():
        out.update({f"{side}/{role}": s for role, s in thread_cpu_seconds(pid).items()})
    return out


def proc_status(pid: int, name: str) -> int | None:
    """The number of field ``name`` of /proc/PID/status (kB for memory, a count
    for Threads), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` (VmRSS), or None if it is gone."""
    kib = proc_status(pid, "VmRSS")
    return None if kib is None else kib * 1024


def meminfo_bytes(name: str) -> int:
    """Field ``name`` of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise BenchFailed(f"/proc/meminfo has no {name}")


# -- statistics ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile ``q`` (0-1) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def timed_calls(calls: int, fn: Callable[[], object]) -> list[float]:
    """Seconds each of ``calls`` calls of ``fn`` took, one after another."""
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def poll_round_trips(engine: Any, room: int, calls: int) -> list[float]:
    """Seconds of ``calls`` bare unary ``Poll`` calls of ``room`` by ``engine``
    (past its session's table: one gRPC round trip to its broker each)."""
    from kvbroker.v1 import transfer_pb2

    client = engine.client
    request = transfer_pb2.PollRequest(engine_id=engine.engine_id, rooms=[room])
    return timed_calls(calls, lambda: client.call(client.stub.Poll, request))


# -- child processes -------------------------------------------------------------------


@dataclass
class Child:
    """A spawned child process and this end of its pipe. Its messages are
    tuples whose first item names them; ``("error", text)`` reports its failure."""

    name: str
    proc: BaseProcess
    conn: Connection

    def recv(self, timeout: float, expect: str | None = None) -> Any:
        """The next message (which must be ``expect``, if given); :class:`BenchFailed`
        if the child fails, exits, closes its pipe or says nothing for ``timeout`` s."""
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
        try:
            self.conn.send(bye)
        except (OSError, ValueError):
            pass
        self.proc.join(wait)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def spawn(name: str, target: Callable[..., object], *args: Any) -> Child:
    """Start ``target(conn, *args)`` in a spawned daemon process; its :class:`Child`."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
    proc.start()
    child.close()
    return Child(name, proc, parent)


def report_error(conn: Connection) -> None:
    """In a child: tell the parent what failed (the traceback being handled)."""
    try:
        conn.send(("error", traceback.format_exc(limit=6)))
    except Exception:
        pass


# -- engines and brokers -----------------------------------------------------------------


def release(engine: Any = None, client: Any = None, memory: Any = None) -> Exception | None:
    """Unregister ``engine``, close ``client``, free ``memory`` (those given),
    each whatever the one before did; the engine's unregister error, if any."""
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


@dataclass
class Held:
    """What a run started, stopped by :meth:`close` in reverse order of
    dependence: child processes, engines, clients, engine memory, brokers."""

    workdir: Path
    brokers: list[Any] = field(default_factory=list)
    children: list[Child] = field(default_factory=list)
    clients: list[Any] = field(default_factory=list)
    engines: list[Any] = field(default_factory=list)
    memories: list[Any] = field(default_factory=list)
    #: What went wrong so far that does not stop the run.
    problems: list[str] = field(default_factory=list)

    def start_brokers(self, names: Sequence[str], extra_args: Sequence[str] = ()) -> list[Any]:
        """``kvbroker serve`` processes on 127.0.0.1, one per name, once all serve."""
        from kvbroker.testing import BrokerProcess

        brokers = BrokerProcess.start_many(list(names), self.workdir, list(extra_args))
        self.brokers.extend(brokers)
        return brokers

    def spawn(self, name: str, target: Callable[..., object], *args: Any) -> Child:
        child = spawn(name, target, *args)
        self.children.append(child)
        return child

    def allocate(self, rank: Any, model: Any, **kwargs: Any) -> Any:
        """``EngineMemory.allocate(rank, model, **kwargs)``."""
        from kvbroker.client import EngineMemory

        memory = EngineMemory.allocate(rank, model, **kwargs)
        self.memories.append(memory)
        return memory

    def register(self, address: str, rank: Any, memory: Any) -> Any:
        """Register ``memory`` as ``rank`` with the broker at ``address`` (a client of its own)."""
        from kvbroker.client import BrokerClient

        client = BrokerClient(address)
        self.clients.append(client)
        engine = client.register_engine(rank, memory)
        self.engines.append(engine)
        return engine

    def close(self) -> list[str]:
        """Stop everything; the problems found on the way (a broker that died
        or exited non-zero on SIGTERM, an engine that did not unregister)."""
        problems: list[str] = []
        for child in self.children:
            try:
                child.stop()
            except Exception as exc:
                problems.append(f"stopping {child.name}: {exc!r}")
        for engine in self.engines:
            try:
                engine.close()
            except Exception as exc:
                problems.append(f"unregistering an engine: {exc!r}")
        for client in self.clients:
            client.close()
        for memory in self.memories:
            memory.close()
        try:
            for broker in self.brokers:
                if broker.process.poll() is not None:
                    problems.append(
                        f"broker {broker.name} died (exit status {broker.process.returncode}); log tail:\n"
                        + broker.log_tail(1500)
                    )
                    continue
                code = broker.stop()
                if code != 0:
                    problems.append(
                        f"broker {broker.name} exited with status {code} on SIGTERM; log tail:\n"
                        + broker.log_tail(1500)
                    )
        finally:
            for broker in self.brokers:
                broker.kill()
        return problems


def wait_open(engine: Any, rooms: Sequence[int], timeout: float, interval: float = 0.05) -> dict[int, Any]:
    """Poll ``rooms`` until each is WAITING_FOR_INPUT or later (its receiver
    registered with its sender); their statuses. :class:`BenchFailed` if one
    FAILED or ``timeout`` s pass first."""
    from kvbroker.client import RoomState

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


def move_room(
    room: int,
    prefill: Any,
    decode: Sequence[Any],
    sender: Any,
    src: Any,
    dst: Any,
    chunk_pages: int,
    timeout: float,
) -> tuple[float, list[str]]:
    """Move one room: each decode engine expects pages ``dst`` from ``sender``
    (a ``SenderRef``), the prefill engine sends pages ``src`` in chunks of
    ``chunk_pages``, and every rank waits for the end. When the decode ranks
    had ended (``time.monotonic``), and the problems: failed calls and ranks
    that did not end SUCCESS (none: the room moved; its bytes are not checked)."""
    from kvbroker.client import RoomState
    from kvbroker.errors import KvBrokerError

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
    for engine in decode:
        try:
            statuses.append(engine.wait([room], timeout_seconds=timeout)[room])
        except KvBrokerError as exc:
            problems.append(f"room {room}: waiting on a decode rank: {type(exc).__name__}: {exc}")
    decoded = time.monotonic()
    try:
        statuses.append(prefill.wait([room], timeout_seconds=timeout)[room])
    except KvBrokerError as exc:
        problems.append(f"room {room}: waiting on the prefill rank: {type(exc).__name__}: {exc}")
    bad = sorted({f"{RoomState(s.state).name}: {s.cause.message}" for s in statuses if s.state != RoomState.SUCCESS})
    if bad:
        problems.append(f"room {room} did not succeed on every rank: {bad}")
    return decoded, problems


# -- bytes -------------------------------------------------------------------------------


def fill_pattern(buf: Any, seed: int) -> None:
    """Write distinct, never-zero 8-byte words over ``buf`` (a contiguous
    numpy array or CPU tensor, a multiple of 8 bytes), in place; the same
    words for the same seed and size."""
    if not isinstance(buf, np.ndarray):
        import torch

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


def kv_mismatches(what: str, prefill: Sequence[Any], decode: Sequence[Any], src: Any, dst: Any) -> list[str]:
    """Where the decode ranks' K and V pages ``dst`` differ from the prefill
    ranks' pages ``src``, compared as bytes, head by head (the ranks of a tp
    group hold equal shares of the KV heads, in rank order), for every layer.
    ``prefill`` and ``decode`` are the ranks' ``EngineMemory``; empty: equal."""
    import torch

    def index(pages: Any, device: Any) -> Any:
        return torch.as_tensor(np.asarray(pages).reshape(-1)).to(device=device, dtype=torch.int64)

    problems = []
    for layer in sorted(decode[0].k):
        for kind in ("k", "v"):
            wants = []
            for p, memory in enumerate(prefill):
                tensor = getattr(memory, kind)[layer]
                wants.append((p, tensor[index(src, tensor.device)]))
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
                        problems.append(
                            f"{what}: layer {layer} {kind.upper()}: decode rank {d}'s pages differ "
                            f"from prefill rank {p}'s"
                        )
    return problems


# -- NIXL ----------------------------------------------------------------------------------


def bare_agent(name: str, *, ucx_error_mode: str = "peer", telemetry: bool = False) -> Any:
    """A bare NIXL agent made like the broker's: no progress thread, the UCX
    backend with the broker's error mode (``telemetry``: per-transfer telemetry on)."""
    from kvbroker.broker.dataplane._agent import import_nixl

    api = import_nixl()
    # After the import: NIXL's logging setup (dictConfig, on first import) sets
    # its logger to INFO on stdout, which would break --json.
    logging.getLogger("nixl").setLevel(logging.WARNING)
    config = api.nixl_agent_config(enable_prog_thread=False, backends=[], capture_telemetry=telemetry)
    agent = api.nixl_agent(name, config)
    agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_mode})
    return agent

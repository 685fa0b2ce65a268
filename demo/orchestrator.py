"""``kvbroker demo``: brokers, engine processes, progress, verification, summary."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from kvbroker.brokerproc import BrokerProcess
from kvbroker.demo.engine import EngineConfig, run_engine
from kvbroker.testing import hosts as hosts_harness
from kvbroker.testing.hosts import Host, Network
from kvbroker.testing.room_plan import STATE_KINDS
from kvbroker.v1 import admin_pb2, admin_pb2_grpc

__all__ = ["run_demo"]

PREFILL_GROUP = "demo-prefill"
DECODE_GROUP = "demo-decode"


@dataclass
class _Broker:
    """A broker the demo uses: one it started (``process``) or one given to it."""

    name: str
    #: Its TCP address: what its peers dial (the SenderRef of a room names it).
    address: str
    process: BrokerProcess | None = None
    #: With --hosts, the host it runs on; its TCP address is reachable only
    #: from the hosts, and this process and the engines reach it by ``local``.
    host: Host | None = None
    #: Where this process and the engines of its host reach it, when that is
    #: not ``address``: its engine socket (a unix socket, every service).
    local: str = ""

    @property
    def reach(self) -> str:
        """The address this process and the engines on the broker's host dial."""
        return self.local or self.address

    def stats(self) -> admin_pb2.Stats:
        with grpc.insecure_channel(self.reach) as channel:
            stats: admin_pb2.Stats = admin_pb2_grpc.AdminStub(channel).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
            return stats

    def transports(self) -> list[str]:
        """This broker's transport self-test verdicts (ListPeers): "prefill VRAM:0->VRAM:0 device speed 312.4 GB/s"."""
        with grpc.insecure_channel(self.reach) as channel:
            peers = admin_pb2_grpc.AdminStub(channel).ListPeers(admin_pb2.ListPeersRequest(), timeout=10).peers
        return [
            f"{self.name} {t.local}->{t.remote} {t.verdict}" + (f" {t.gbps:.1f} GB/s" if t.gbps else "")
            for peer in peers
            for t in peer.transports
        ]


@dataclass
class _Tally:
    rooms_verified: int = 0
    bytes: int = 0
    transfer_seconds: float = 0.0
    #: room -> side -> event -> wall-clock seconds (with --trace)
    timelines: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: "event (broker)" -> how often the brokers the demo started logged it at warning or above.
    warnings: dict[str, int] = field(default_factory=dict)
    #: The brokers' transport self-test verdicts (pairs of transfer buffers where either is a GPU's).
    transports: list[str] = field(default_factory=list)
    #: With --hosts: broker name -> (bytes sent, bytes received) on its host's eth0.
    links: dict[str, tuple[int, int]] = field(default_factory=dict)


def _broker_warnings(brokers: list[_Broker]) -> dict[str, int]:
    """What the brokers the demo started warned of (their logs), e.g. VRAM moving at host speed."""
    return {
        f"{event} ({broker.name})": count
        for broker in brokers
        if broker.process is not None
        for event, count in broker.process.warnings().items()
    }


def _broker_args(ucx_error_mode: str, staging: bool) -> list[str]:
    # Short TTLs, so the demo can show every per-room table back at zero.
    extra = ["--finished-room-ttl", "0.5", "--tombstone-ttl", "1", "--ucx-error-mode", ucx_error_mode, "--log-level", "warning"]
    if not staging:
        extra.append("--no-staging")
    return extra


def _start_brokers(names: list[str], workdir: Path, ucx_error_mode: str, staging: bool) -> list[_Broker]:
    extra = _broker_args(ucx_error_mode, staging)
    return [_Broker(p.name, p.address, p) for p in BrokerProcess.start_many(names, workdir, extra)]


def _start_brokers_on_hosts(network: Network, workdir: Path, ucx_error_mode: str, staging: bool) -> list[_Broker]:
    """A broker on each host of ``network`` (named after it), on the host's address."""
    names = list(network.hosts)
    processes = network.brokers(names, workdir, _broker_args(ucx_error_mode, staging))
    return [_Broker(p.name, p.address, p, host=network[p.name], local=p.local_address) for p in processes]


def _engine_on_host(host: Host, cfg: EngineConfig, events: Any, go: Any) -> None:
    """An engine process on ``host``: it moves onto the host first (no socket is open and
    no thread but the math library's has started yet), then runs as on one machine."""
    try:
        host.enter()
    except BaseException:
        events.put(("error", f"{cfg.role} tp{cfg.tp_rank} pp{cfg.pp_rank}", traceback.format_exc()))
        raise
    run_engine(cfg, events, go)


@contextmanager
def _sigterm_as_exit(enabled: bool) -> Iterator[None]:
    """SIGTERM raises SystemExit while this lasts, so the demo's clean-up (the hosts'
    namespaces with it) runs as it does on Ctrl-C."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait_for_empty_tables(brokers: list[_Broker], timeout_seconds: float) -> dict[str, dict[str, int]]:
    deadline = time.monotonic() + timeout_seconds
    while True:
        tables = {b.name: dict(b.stats().per_room_state) for b in brokers}
        if all(not any(t.values()) for t in tables.values()) or time.monotonic() > deadline:
            return tables
        time.sleep(0.2)


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.tty = enabled and sys.stderr.isatty()
        self.enabled = enabled
        self.start = time.perf_counter()
        self._last_decile = -1

    def update(self, done: int, nbytes: int) -> None:
        if not self.enabled:
            return
        line = f"{done}/{self.total} rooms verified  {nbytes / 2**20:8.1f} MiB"
        if self.tty:
            width = 30
            filled = int(width * done / max(self.total, 1))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {line}")
            sys.stderr.flush()
        else:
            decile = 10 * done // max(self.total, 1)
            if decile != self._last_decile:
                self._last_decile = decile
                print(f"progress: {line}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _engine_configs(args: argparse.Namespace, prefill: _Broker, decode: _Broker, room_base: int) -> list[EngineConfig]:
    """One config per engine rank: every prefill (tp, pp) rank, then every decode rank. A rank
    registers where the engines of its broker's host reach it; the decode ranks name the
    prefill broker by its TCP address, the one the decode broker dials."""
    mla = args.mla
    base = EngineConfig(
        role="prefill",
        broker=prefill.reach,
        group=PREFILL_GROUP,
        tp_size=args.prefill_tp,
        tp_rank=0,
        pp_size=args.prefill_pp,
        pp_rank=0,
        sender_broker=prefill.address,
        sender_group=PREFILL_GROUP,
        layers=args.layers,
        page_size=args.page_size,
        kv_heads=1 if mla else (args.kv_heads if args.kv_heads is not None else 8),
        head_dim=args.head_dim if args.head_dim is not None else (576 if mla else 64),
        dtype=args.dtype,
        mla=mla,
        rooms=args.rooms,
        pages=args.pages,
        chunks=args.chunks,
        window=max(1, min(args.window, args.rooms)),
        aux_bytes=args.aux_bytes,
        state=tuple(s for s in args.state.split(",") if s),
        trace=args.trace,
        seed=args.seed,
        room_base=room_base,
        timeout_seconds=args.timeout,
    )
    configs = [
        replace(base, tp_rank=tp, pp_rank=pp) for pp in range(args.prefill_pp) for tp in range(args.prefill_tp)
    ]
    configs += [
        replace(base, role="decode", broker=decode.reach, group=DECODE_GROUP, tp_size=args.decode_tp, tp_rank=tp, pp_size=args.decode_pp, pp_rank=pp)
        for pp in range(args.decode_pp)
        for tp in range(args.decode_tp)
    ]
    if args.device == "cuda":
        import torch  # only here: the CPU demo does not load torch in this process

        # torch.cuda.device_count() does not initialise CUDA in this process.
        count = torch.cuda.device_count()
        configs = [replace(c, device=f"cuda:{i % count}") for i, c in enumerate(configs)]
    return configs


def _check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, or None."""
    if (args.prefill_broker is None) != (args.decode_broker is None):
        return "give both --prefill-broker and --decode-broker, or neither"
    if args.hosts and args.prefill_broker is not None:
        return "--hosts starts its own brokers on hosts of their own: leave out --prefill-broker and --decode-broker"
    if args.hosts and args.single_broker:
        return "--hosts puts the prefill and the decode broker on two hosts: leave out --single-broker"
    if args.hosts and args.device != "cpu":
        return "--hosts moves the KV with UCX over TCP only (no CUDA transport between the hosts): leave out --device cuda"
    if args.rooms < 1 or args.pages < 0 or args.layers < 1 or args.chunks < 1:
        return "--rooms, --layers and --chunks must be at least 1, --pages at least 0"
    for name in ("prefill_tp", "decode_tp", "prefill_pp", "decode_pp"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if max(args.prefill_pp, args.decode_pp) > args.layers:
        return "a pipeline stage needs at least one layer: --layers must be at least the pp sizes"
    unknown = [s for s in args.state.split(",") if s and s not in STATE_KINDS]
    if unknown:
        return f"unknown state kinds {unknown}; choose from {', '.join(STATE_KINDS)}"
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() == 0:
            return "--device cuda: no CUDA device is visible to torch here"
    if args.mla and args.kv_heads not in (None, 1):
        return "an MLA model has one latent KV head: leave --kv-heads out with --mla"
    return None


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every room arrived byte-exact and nothing leaked."""
    problem = _check_args(args)
    if problem:
        print(f"kvbroker demo: {problem}", file=sys.stderr)
        return 2
    if args.hosts and (why := hosts_harness.unavailable()):
        # Never on loopback instead: the run would not show what --hosts asks for.
        print(f"kvbroker demo: --hosts: {why}", file=sys.stderr)
        return 2
    with _sigterm_as_exit(args.hosts):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    workdir = Path(tempfile.mkdtemp(prefix="kvbroker-demo-"))
    owned: list[_Broker] = []
    processes: list[multiprocessing.process.BaseProcess] = []
    tally = _Tally()
    tables: dict[str, dict[str, int]] = {}
    wall = 0.0
    network: Network | None = None
    try:
        if args.prefill_broker:
            prefill = _Broker("prefill", args.prefill_broker)
            decode = _Broker("decode", args.decode_broker)
            brokers = [prefill, decode]
        elif args.hosts:
            network = Network(["prefill", "decode"])
            network.open()
            owned.extend(_start_brokers_on_hosts(network, workdir, args.ucx_error_mode, args.staging))
            prefill, decode = owned
            brokers = list(owned)
        else:
            names = ["host"] if args.single_broker else ["prefill", "decode"]
            owned.extend(_start_brokers(names, workdir, args.ucx_error_mode, args.staging))
            prefill, decode = owned[0], owned[-1]
            brokers = list(owned)
        room_base = secrets.randbits(40) << 20
        configs = _engine_configs(args, prefill, decode, room_base)
        homes = {"prefill": prefill.host, "decode": decode.host}
        ctx = multiprocessing.get_context("spawn")
        events: Any = ctx.Queue()
        go = ctx.Event()
        progress = _Progress(args.rooms, not args.no_progress and not args.json)
        start = time.perf_counter()
        # All ranks start at once: a receiving room waits (bootstrap timeout)
        # for the sender group to register.
        for cfg in configs:
            home = homes[cfg.role]
            target, target_args = (run_engine, (cfg, events, go)) if home is None else (_engine_on_host, (home, cfg, events, go))
            proc = ctx.Process(target=target, args=target_args, name=f"{cfg.role}-tp{cfg.tp_rank}-pp{cfg.pp_rank}", daemon=True)
            proc.start()
            processes.append(proc)
        _await(events, "ready", len(configs), processes, owned, tally, args.timeout)
        go.set()
        if not tally.errors:
            _collect(events, configs, processes, owned, tally, progress, args.timeout)
        progress.close()
        wall = time.perf_counter() - start
        if tally.errors:  # a broker or an engine is gone: stop now, say which
            return _finish(args, tally, {}, wall, workdir, owned, processes)
        for p in processes:
            p.join(timeout=30)
        if owned:
            tables = _wait_for_empty_tables(brokers, timeout_seconds=15)
        else:
            tables = {b.name: dict(b.stats().per_room_state) for b in brokers}
        tally.transports = [line for b in brokers for line in b.transports()]
        if args.device == "cuda" and not tally.transports:
            tally.errors.append("GPU memory moved, but no broker probed a pair of transfer buffers")
        tally.errors += [f"the transport self-test found a pair moving through the host: {t}" for t in tally.transports if "device speed" not in t]
        tally.links = {b.name: b.host.link_bytes() for b in brokers if b.host is not None}
    except grpc.RpcError as exc:  # a broker that does not answer any more
        tally.errors.append(f"a broker does not answer: {exc.code().name} {exc.details()}")
    except Exception as exc:  # report, then clean up
        tally.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        try:
            _stop(processes, owned)
        finally:
            if network is not None:  # also on Ctrl-C: kills what is left on the hosts, removes them
                network.close()
    return _finish(args, tally, tables, wall, workdir, owned, processes)


def _stop(processes: list[Any], owned: list[_Broker]) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()
    for broker in owned:
        if broker.process is not None:
            broker.process.stop()


def _finish(
    args: argparse.Namespace,
    tally: _Tally,
    tables: dict[str, dict[str, int]],
    wall: float,
    workdir: Path,
    owned: list[_Broker],
    processes: list[Any],
) -> int:
    """Stop what is left, print the summary; the exit status."""
    _stop(processes, owned)
    leaked = {name: {k: v for k, v in t.items() if v} for name, t in tables.items()} if owned else {}
    ok = not (tally.failed or tally.mismatched or tally.errors or any(leaked.values())) and tally.rooms_verified == args.rooms
    tally.warnings = _broker_warnings(owned)
    _summary(args, tally, tables, leaked, wall, ok, workdir, owned)
    if ok:  # a failed run keeps its broker logs (the summary names the folder)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


def _died(processes: list[Any], brokers: list[_Broker]) -> str | None:
    """Which engine process or broker the demo started is gone, if one is."""
    gone = [
        f"broker {b.name} at {b.address} exited (status {b.process.process.returncode})"
        for b in brokers
        if b.process is not None and b.process.process.poll() is not None
    ]
    gone += [f"engine process {p.name} exited (status {p.exitcode})" for p in processes if p.exitcode not in (None, 0)]
    return "; ".join(gone) or None


def _await(events: Any, kind: str, count: int, processes: list[Any], brokers: list[_Broker], tally: _Tally, timeout: float) -> None:
    seen = 0
    deadline = time.monotonic() + timeout
    while seen < count and not tally.errors:
        try:
            event, name, payload = events.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                tally.errors.append(f"engines not {kind} after {timeout} s")
            elif gone := _died(processes, brokers):
                tally.errors.append(gone)
            continue
        if event == "error":
            tally.errors.append(f"{name}: {payload}")
        elif event == kind:
            seen += 1


def _collect(
    events: Any, configs: list[EngineConfig], processes: list[Any], brokers: list[_Broker], tally: _Tally, progress: _Progress, timeout: float
) -> None:
    done = 0
    deadline = time.monotonic() + timeout
    decode_ranks = sum(1 for c in configs if c.role == "decode")
    while done < len(configs):
        try:
            event, name, payload = events.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                tally.errors.append(f"the demo did not finish in {timeout} s")
                return
            if gone := _died(processes, brokers):
                tally.errors.append(gone)
                return
            continue
        if event == "verified":
            room, nbytes, problems = payload
            tally.bytes += nbytes
            if problems:
                tally.mismatched.append(f"room {room} ({name}): {'; '.join(problems[:4])}")
            tally.rooms_verified += 1
            progress.update(tally.rooms_verified // decode_ranks, tally.bytes)
        elif event == "batch_time":
            elapsed, _nbytes = payload
            tally.transfer_seconds += elapsed / decode_ranks
        elif event == "timeline":
            room, sides = payload
            tally.timelines[room] = sides
        elif event == "room_failed":
            room, why = payload
            tally.failed.append(f"room {room} ({name}): {why}")
        elif event == "error":
            # The exception's last line says what happened (e.g. which broker is unreachable).
            tally.errors.append(f"{name}: {payload.strip().splitlines()[-1]}")
            return
        elif event == "done":
            done += 1
    tally.rooms_verified //= max(decode_ranks, 1)


_TIMELINE_EVENTS = ("handshaken", "registered", "ready", "first_byte", "last_byte", "success", "failed")


def _print_timelines(timelines: dict[int, dict[str, dict[str, float]]], limit: int = 20) -> None:
    """Milliseconds from the receiver opening the room, per side and event."""
    print("  per-room timeline (ms after the decode side opened the room; full traces: OTEL_TRACES_EXPORTER=otlp)")
    header = "  " + f"{'room':>8} {'side':44}" + "".join(f"{e:>11}" for e in _TIMELINE_EVENTS)
    print(header)
    for room in sorted(timelines)[:limit]:
        sides = timelines[room]
        origin = min((t.get("opened", 0.0) for s, t in sides.items() if s.startswith("receiver")), default=None)
        if origin is None:
            origin = min(t.get("opened", 0.0) for t in sides.values())
        for side in sorted(sides, reverse=True):
            times = sides[side]
            cells = "".join(
                f"{(times[e] - origin) * 1e3:11.1f}" if e in times else f"{'-':>11}" for e in _TIMELINE_EVENTS
            )
            print(f"  {room % 100000:>8} {side[:44]:44}{cells}")
    if len(timelines) > limit:
        print(f"  ... {len(timelines) - limit} more rooms")


def _layout_line(args: argparse.Namespace) -> str:
    heads = "MLA" if args.mla else f"{args.kv_heads if args.kv_heads is not None else 8} KV heads"
    text = f"{heads}, prefill tp{args.prefill_tp} pp{args.prefill_pp} -> decode tp{args.decode_tp} pp{args.decode_pp}"
    if args.device != "cpu":
        # Whatever lies in VRAM moves packed through the brokers' transfer buffers.
        text += f", KV in {args.device.upper()} memory (the device path)"
    elif args.prefill_tp != args.decode_tp and not args.mla:
        text += ", staging" if args.staging else ", per-token descriptors"
    if args.state:
        text += f", state {args.state}"
    return text


def _summary(
    args: argparse.Namespace,
    tally: _Tally,
    tables: dict[str, dict[str, int]],
    leaked: dict[str, dict[str, int]],
    wall: float,
    ok: bool,
    workdir: Path,
    owned: list[_Broker],
) -> None:
    gbps = tally.bytes / tally.transfer_seconds / 1e9 if tally.transfer_seconds else 0.0
    summary = {
        "ok": ok,
        "rooms": args.rooms,
        "rooms_verified": tally.rooms_verified,
        "rooms_failed": len(tally.failed),
        "rooms_mismatched": len(tally.mismatched),
        "bytes": tally.bytes,
        "gb_per_s": round(gbps, 3),
        "wall_seconds": round(wall, 3),
        "layout": _layout_line(args),
        "brokers": "single" if args.single_broker else ("external" if args.prefill_broker else ("hosts" if args.hosts else "two")),
        "per_room_state": tables,
        "broker_warnings": tally.warnings,
        "transports": tally.transports,
    }
    if args.hosts:
        summary["hosts"] = {
            b.name: {"address": b.address, "eth0_tx_bytes": tally.links.get(b.name, (0, 0))[0], "eth0_rx_bytes": tally.links.get(b.name, (0, 0))[1]}
            for b in owned
        }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"kvbroker demo: {'OK' if ok else 'FAILED'}")
        print(f"  layout        {summary['layout']}")
        print(f"  workload      {args.layers} layers, {args.pages} pages/room of {args.page_size} tokens, {args.chunks} chunks/room")
        if args.hosts:
            print("  brokers       two, each on a host of its own (network namespaces on a bridge), UCX over TCP on eth0")
            for b in owned:
                sent, received = tally.links.get(b.name, (0, 0))
                link = f"eth0 sent {sent} B, received {received} B" if b.name in tally.links else "eth0 not read"
                print(f"  {b.name + ' host':13} broker {b.address}, {link}")
        else:
            print(f"  brokers       {summary['brokers']}")
        print(f"  rooms         {tally.rooms_verified}/{args.rooms} verified byte-exact, {len(tally.failed)} failed, {len(tally.mismatched)} mismatched")
        print(f"  bytes         {tally.bytes} ({tally.bytes / 2**20:.1f} MiB)")
        print(f"  throughput    {gbps:.2f} GB/s (decode side, ExpectRoom to SUCCESS)")
        for name, table in tables.items():
            state = "all zero" if not any(table.values()) else ", ".join(f"{k}={v}" for k, v in table.items() if v)
            print(f"  {name:13} per-room tables: {state}")
        print(f"  transport     {'; '.join(tally.transports) or 'no pair probed (no GPU memory)'}")
        if owned:
            said = ", ".join(f"{event} x{n}" for event, n in sorted(tally.warnings.items())) or "none"
            print(f"  broker warnings {said}")
    if args.trace and tally.timelines and not args.json:
        _print_timelines(tally.timelines)
    for line in (*tally.failed[:10], *tally.mismatched[:10], *tally.errors[:5]):
        print(f"  ! {line}", file=sys.stderr)
    for name, table in leaked.items():
        if table:
            print(f"  ! broker {name} kept per-room records after eviction: {table}", file=sys.stderr)
    if not ok and owned:
        print(f"  broker logs: {workdir}", file=sys.stderr)

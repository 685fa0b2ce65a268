"""The ``kvbroker`` command: ``serve`` runs a broker, ``demo`` shows one working."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvbroker import __version__

if TYPE_CHECKING:
    from kvbroker.broker import BrokerConfig

__all__ = ["main"]


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvbroker.broker.config import BrokerConfig

    d = BrokerConfig()
    p = sub.add_parser(
        "serve",
        help="run one broker (one per GPU host)",
        description="Run one kvbroker: gRPC for engines, peers and operators; NIXL for the bytes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--listen", default=d.listen_address, metavar="HOST:PORT", help="TCP address for peers and operators (port 0: any free port)")
    p.add_argument("--advertise", default=None, metavar="HOST:PORT", help="address peers should dial (default: the bound --listen address)")
    p.add_argument("--uds", default=None, metavar="PATH", help="gRPC unix socket for engines (default: $XDG_RUNTIME_DIR or /tmp, kvbroker-PORT.sock)")
    p.add_argument("--fd-socket", default=None, metavar="PATH", help="unix socket for buffer fd uploads (default: next to --uds, .fds)")
    p.add_argument("--ucx-error-mode", choices=("peer", "none"), default=d.ucx_error_mode, help="UCX error handling: 'peer' detects dead peers, 'none' is faster and blind")
    p.add_argument("--finished-room-ttl", type=float, default=d.finished_room_ttl_seconds, metavar="SECONDS", help="how long finished rooms stay pollable (from when they ended and their pages settled)")
    p.add_argument("--tombstone-ttl", type=float, default=d.tombstone_ttl_seconds, metavar="SECONDS", help="how long evicted room ids are remembered")
    p.add_argument("--orphan-timeout", type=float, default=d.orphan_room_timeout_seconds, metavar="SECONDS", help="how long transfer infos wait for a BeginSend")
    p.add_argument("--bootstrap-timeout", type=float, default=d.bootstrap_timeout_seconds, metavar="SECONDS", help="how long a receiving room retries reaching the sender's broker and group")
    p.add_argument("--peer-timeout", type=float, default=d.peer_rpc_timeout_seconds, metavar="SECONDS", help="deadline of broker-to-broker calls")
    p.add_argument("--sender-info-timeout", type=float, default=d.sender_info_timeout_seconds, metavar="SECONDS", help="how long a sending room waits for its receivers' transfer info")
    p.add_argument("--lease-renew-max", type=float, default=d.lease_renew_max_seconds, metavar="SECONDS", help="the longest interval between lease renewals for rooms this broker's decode engines announced (else a third of the sender's lease)")
    p.add_argument("--receiver-data-timeout", type=float, default=d.receiver_data_timeout_seconds, metavar="SECONDS", help="how long a registered receiving room waits for its data")
    p.add_argument("--transfer-timeout", type=float, default=d.transfer_timeout_seconds, metavar="SECONDS", help="how long one NIXL transfer may stay in flight before it is cancelled")
    p.add_argument("--peer-heartbeat", type=float, default=d.peer_heartbeat_seconds, metavar="SECONDS", help="ping interval to peers with open rooms")
    p.add_argument("--unregister-settle-timeout", type=float, default=d.unregister_settle_timeout_seconds, metavar="SECONDS", help="how long unregistering (or stopping) waits for posted transfers to settle")
    p.add_argument("--peer-dead-after", type=float, default=d.peer_dead_after_seconds, metavar="SECONDS", help="a peer silent this long is lost: its rooms fail")
    p.add_argument(
        "--verify-checksums",
        action="store_true",
        help="verify every room this broker receives against chunk checksums the sender computes (a pass over the bytes on both sides)",
    )
    p.add_argument(
        "--no-priorities",
        action="store_true",
        help="serve every queue first come, first served: ignore the rooms' priority classes and deadlines, no fair shares between engines",
    )
    p.add_argument("--staging-mib", type=int, default=d.staging_send_bytes >> 20, metavar="MIB", help="size of each staging buffer (send and receive) for head-sliced transfers")
    p.add_argument("--no-staging", action="store_true", help="no staging buffers: head slices move with per-token descriptors")
    p.add_argument("--device-buffer-mib", type=float, default=d.device_send_bytes / (1 << 20), metavar="MIB", help="size of each transfer buffer (send and receive) per GPU an engine's memory lives on: the device path's slots (at most 1/32 of the GPU's memory each)")
    p.add_argument("--part-mib", type=float, default=d.part_bytes / (1 << 20), metavar="MIB", help="largest part written straight between engines' pages (one NIXL write); larger chunks are cut between pages so that higher classes can pass them (0: no cut)")
    p.add_argument("--send-window-mib", type=float, default=d.send_window_bytes / (1 << 20), metavar="MIB", help="bytes of such parts in flight at most; the rest wait in class and fair-share order (0: no bound)")
    p.add_argument("--device-part-mib", type=float, default=d.device_part_bytes / (1 << 20), metavar="MIB", help="largest packed part (one NIXL write) on the device path; larger chunks are split")
    p.add_argument("--transport-floor-gbps", type=float, default=d.transport_floor_gbps, metavar="GBPS", help="the transport self-test's floor: a pair of transfer buffers (either a GPU's) that writes slower moves through the host ('host fallback', a warning)")
    p.add_argument("--agent-name-prefix", default=d.agent_name_prefix, help="prefix of the NIXL agent name")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="this broker's certificate chain (mutual TLS on the TCP port)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="this broker's private key")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="CA that signs peer and operator certificates; clients without one are refused")
    p.add_argument("--etcd", default=None, metavar="URL", help="keep this broker's record in etcd (http://HOST:PORT); off by default")
    p.add_argument("--etcd-prefix", default=d.etcd_prefix, metavar="PREFIX", help="key prefix of the fleet in etcd")
    p.add_argument("--etcd-ttl", type=float, default=d.etcd_ttl_seconds, metavar="SECONDS", help="lease TTL of the record: a killed broker's record goes this long after")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT", help="serve Prometheus metrics on this port (off by default)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST", help="address of the Prometheus endpoint")
    p.add_argument("--ready-file", default=None, metavar="PATH", help="write a JSON line with the broker's addresses here once it serves")
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto", help="auto: console on a terminal, JSON otherwise")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--exit-with-parent",
        type=int,
        default=None,
        metavar="PID",
        help="get SIGTERM when the process that started this broker (PID, its parent) exits (Linux; for harnesses)",
    )


def _demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvbroker.demo.options import add_demo_arguments

    p = sub.add_parser(
        "demo",
        help="move and verify real KV bytes between two brokers",
        description=(
            "Start two brokers on loopback (a prefill host and a decode host) and one engine process per rank, "
            "move rooms of KV through NIXL, verify every byte on the decode side, and print a summary. "
            "Exit status 1 on any mismatch, failed room or leaked broker record."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_demo_arguments(p)


def _fleet_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fleet",
        help="list the brokers registered in etcd",
        description="Every broker record in etcd (address, groups, lease, version), and what each broker says of "
        "itself (health, open rooms, draining).",
    )
    p.add_argument("--etcd", required=True, metavar="URL", help="etcd endpoint, http://HOST:PORT")
    p.add_argument("--etcd-prefix", default="/kvbroker", metavar="PREFIX")
    p.add_argument("--group", default=None, metavar="GROUP", help="only the brokers that serve this engine group")
    p.add_argument("--no-probe", action="store_true", help="do not ask the brokers themselves (etcd only)")
    p.add_argument("--json", action="store_true", help="print the records as JSON")


def _fleet(args: argparse.Namespace) -> int:
    from kvbroker.broker.peers import read_fleet

    try:
        records = asyncio.run(read_fleet(args.etcd, args.etcd_prefix, probe=not args.no_probe))
    except Exception as exc:  # noqa: BLE001 - an operator command: say why and exit 1
        print(f"kvbroker fleet: cannot read {args.etcd}: {exc}", file=sys.stderr)
        return 1
    if args.group is not None:
        records = [r for r in records if args.group in r.get("groups", {})]
    if args.json:
        print(json.dumps(records, indent=2, sort_keys=True))
        return 0
    for record in records:
        up = time.time() - float(record.get("started_at", time.time()))
        line = (
            f"{record['address']}  broker {record['broker_id'][:12]}  protocol {record['protocol']}  "
            f"version {record['version']}  up {up:.0f} s  lease {record['lease_ttl']}/{record['lease_granted']} s"
        )
        if "health" in record:
            line += f"  {record['health']}"
            if record.get("open_rooms") is not None:
                line += f"  open rooms {record['open_rooms']}"
        if record.get("draining"):
            line += "  DRAINING"
        print(line)
        for group, info in sorted(record.get("groups", {}).items()):
            print(f"    {group}: {info['role']} tp{info['tp_size']} pp{info['pp_size']}  ranks {', '.join(info['ranks'])}")
    if not records:
        print("no broker is registered" + (f" for group {args.group}" if args.group is not None else ""))
        return 1 if args.group is not None else 0
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvbroker", description="A per-host KV-cache transfer broker (NIXL + gRPC).")
    parser.add_argument("--version", action="version", version=f"kvbroker {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _demo_parser(sub)
    _fleet_parser(sub)
    args = parser.parse_args(argv)
    if args.command in ("serve", "fleet") and (why := _refusal(args)) is not None:
        print(f"kvbroker {args.command}: error: {why}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return _serve(args)
    if args.command == "fleet":
        return _fleet(args)
    from kvbroker.demo.orchestrator import run_demo

    return run_demo(args)


#: What an option needs that an install may lack: (the option, the module it
#: imports, what to install). ``kvbroker serve`` and ``kvbroker fleet`` refuse
#: to start without it (exit status 2) rather than start and not do it.
_NEEDS = {
    "etcd": ("--etcd", "aetcd", "pip install 'kvbroker[etcd]'"),
    "metrics_port": ("--metrics-port", "opentelemetry.exporter.prometheus", "pip install opentelemetry-exporter-prometheus"),
    "otlp": (
        "OTEL_TRACES_EXPORTER=otlp",
        "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
        "pip install opentelemetry-exporter-otlp-proto-grpc",
    ),
}


def _refusal(args: argparse.Namespace) -> str | None:
    """Why the command cannot do what its options ask (None: it can)."""
    import importlib

    wanted = [name for name in ("etcd", "metrics_port") if getattr(args, name, None) is not None]
    if "otlp" in os.environ.get("OTEL_TRACES_EXPORTER", "").split(","):
        wanted.append("otlp")
    for name in wanted:
        option, module, install = _NEEDS[name]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"{option} needs the {module.split('.')[0]} package, which cannot be imported here ({exc}): {install}"
    tls = {flag: getattr(args, attr, None) for flag, attr in (("--tls-cert", "tls_cert"), ("--tls-key", "tls_key"), ("--tls-ca", "tls_ca"))}
    given = [flag for flag, path in tls.items() if path]
    if given and len(given) != len(tls):
        return f"{', '.join(given)} without {', '.join(f for f in tls if f not in given)}: mutual TLS needs all three"
    for flag, path in tls.items():
        if path and not os.access(path, os.R_OK):
            return f"{flag} {path}: no such readable file"
    return None


def _serve(args: argparse.Namespace) -> int:
    from kvbroker.broker import BrokerConfig
    from kvbroker.broker.telemetry import configure_metrics, configure_tracing
    from kvbroker.logconfig import configure_logging

    if args.exit_with_parent is not None and not _exit_with_parent(args.exit_with_parent):
        print(f"kvbroker serve: the parent process {args.exit_with_parent} is gone", file=sys.stderr)
        return 1
    configure_logging(args.log_format, args.log_level)
    # Tracing follows the OTEL_* environment variables (nothing is exported
    # unless OTEL_TRACES_EXPORTER says so); metrics are scraped if asked.
    tracer_provider = configure_tracing()
    meter_provider = configure_metrics(args.metrics_port, args.metrics_host)
    config = BrokerConfig(
        listen_address=args.listen,
        advertise_address=args.advertise,
        engine_socket_path=args.uds,
        fd_socket_path=args.fd_socket,
        ucx_error_mode=args.ucx_error_mode,
        agent_name_prefix=args.agent_name_prefix,
        finished_room_ttl_seconds=args.finished_room_ttl,
        tombstone_ttl_seconds=args.tombstone_ttl,
        orphan_room_timeout_seconds=args.orphan_timeout,
        bootstrap_timeout_seconds=args.bootstrap_timeout,
        peer_rpc_timeout_seconds=args.peer_timeout,
        sender_info_timeout_seconds=args.sender_info_timeout,
        receiver_data_timeout_seconds=args.receiver_data_timeout,
        lease_renew_max_seconds=args.lease_renew_max,
        transfer_timeout_seconds=args.transfer_timeout,
        peer_heartbeat_seconds=args.peer_heartbeat,
        peer_dead_after_seconds=args.peer_dead_after,
        verify_checksums=args.verify_checksums,
        priorities=not args.no_priorities,
        unregister_settle_timeout_seconds=args.unregister_settle_timeout,
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        tls_ca_file=args.tls_ca,
        staging_send_bytes=0 if args.no_staging else args.staging_mib << 20,
        staging_receive_bytes=0 if args.no_staging else args.staging_mib << 20,
        device_send_bytes=int(args.device_buffer_mib * (1 << 20)),
        device_receive_bytes=int(args.device_buffer_mib * (1 << 20)),
        device_part_bytes=int(args.device_part_mib * (1 << 20)),
        part_bytes=int(args.part_mib * (1 << 20)),
        send_window_bytes=int(args.send_window_mib * (1 << 20)),
        transport_floor_gbps=args.transport_floor_gbps,
        etcd_url=args.etcd,
        etcd_prefix=args.etcd_prefix,
        etcd_ttl_seconds=args.etcd_ttl,
    )
    try:
        try:
            options = _testing_server_options(config)
        except ValueError as exc:
            print(f"kvbroker serve: error: {exc}", file=sys.stderr)
            return 2
        return asyncio.run(_serve_async(config, args.ready_file, options))
    finally:
        # Flush spans still batched (OTLP) before the process goes.
        tracer_provider.shutdown()
        meter_provider.shutdown()


def _exit_with_parent(parent: int) -> bool:
    """Ask the kernel for SIGTERM when the parent exits (``PR_SET_PDEATHSIG``);
    False if ``parent`` is not (or no longer) this process's parent.

    Set here, after exec, rather than by the parent between fork and exec: a
    parent with gRPC threads must not run Python in a forked child (gRPC's fork
    handlers start threads there that ``close_fds`` then breaks)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        pass
    return os.getppid() == parent


def _testing_server_options(config: BrokerConfig) -> dict[str, object]:
    """What a testing-only environment variable changes in the server: with
    ``KVBROKER_TESTING_FAKE_GPUS=N`` the broker runs on N fake GPUs
    (``kvbroker.testing.fake_gpu``, which says so loudly on stderr); else nothing."""
    if not os.environ.get("KVBROKER_TESTING_FAKE_GPUS"):
        return {}
    import uuid

    from kvbroker.testing.fake_gpu import fake_gpu_server_options

    name = f"{config.agent_name_prefix}-{uuid.uuid4().hex[:12]}"
    return fake_gpu_server_options(name, config.ucx_error_mode) or {}


async def _serve_async(config: BrokerConfig, ready_file: str | None, options: dict[str, object] | None = None) -> int:
    from kvbroker.broker import BrokerServer

    server = BrokerServer(config, **(options or {}))  # type: ignore[arg-type]
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_file:
        info = server.broker.broker_info()
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as fh:
            json.dump(
                {
                    "address": info.listen_address,
                    "engine_socket": info.engine_socket_path,
                    "fd_socket": info.fd_socket_path,
                    "broker_id": info.broker_id,
                    "pid": os.getpid(),
                },
                fh,
            )
        os.replace(tmp, ready_file)
    await stop.wait()
    await server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run ``kvbroker serve`` as a child process (the demo, the tests, the benchmark).

``BrokerProcess.start_many`` launches brokers in parallel on loopback port 0,
each writing its addresses to a ready file, and returns once every one
serves. ``UCX_NET_DEVICES=lo`` is the default for children unless the caller's
environment says otherwise, so no test or demo traffic leaves loopback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvbroker.v1 import admin_pb2, admin_pb2_grpc

__all__ = ["BrokerProcess"]


@dataclass
class BrokerProcess:
    """A ``kvbroker serve`` child process."""

    name: str
    process: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path
    address: str = ""
    broker_id: str = ""
    #: The broker's engine socket (gRPC on a unix socket, every service, no TLS):
    #: how this machine reaches a broker on a host of its own (kvbroker.testing.hosts).
    engine_socket: str = ""

    @classmethod
    def launch(
        cls,
        name: str,
        workdir: Path,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        *,
        listen: str = "127.0.0.1:0",
        wrapper: Sequence[str] = (),
    ) -> BrokerProcess:
        """Start one broker; call :meth:`wait_ready` before using it. ``wrapper``
        comes before the command (``Host.command([])`` runs it on a host)."""
        ready = workdir / f"{name}.json"
        if ready.exists():
            ready.unlink()
        log_path = workdir / f"{name}.log"
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("UCX_NET_DEVICES", "lo")
        cmd = [
            *wrapper,
            sys.executable,
            "-m",
            "kvbroker",
            "serve",
            "--listen",
            listen,
            "--uds",
            str(workdir / f"{name}.sock"),
            "--ready-file",
            str(ready),
            "--log-format",
            "json",
            # SIGTERM if this process dies, so a crashed test run or demo does
            # not leave brokers behind.
            "--exit-with-parent",
            str(os.getpid()),
            *extra_args,
        ]
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env
            )
        return cls(name=name, process=process, ready_file=ready, log_path=log_path)

    @classmethod
    def start_many(
        cls, names: Sequence[str], workdir: Path, extra_args: Sequence[str] = (), timeout_seconds: float = 60.0
    ) -> list[BrokerProcess]:
        """Start brokers in parallel and wait until all serve."""
        return cls.all_ready([cls.launch(name, workdir, extra_args) for name in names], timeout_seconds)

    @staticmethod
    def all_ready(brokers: list[BrokerProcess], timeout_seconds: float = 60.0) -> list[BrokerProcess]:
        """Wait until every launched broker serves; kill them all if one does not."""
        try:
            for broker in brokers:
                broker.wait_ready(timeout_seconds)
        except BaseException:
            for broker in brokers:
                broker.kill()
            raise
        return brokers

    def wait_ready(self, timeout_seconds: float = 60.0, while_waiting: Callable[[], None] | None = None) -> None:
        """Block until the broker serves (``while_waiting`` runs every 50 ms
        meanwhile); ``RuntimeError`` with its log tail if it exits or takes
        longer than ``timeout_seconds``."""
        deadline = time.monotonic() + timeout_seconds
        while not self.ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"broker {self.name} did not start; the end of its log:\n{self.log_tail()}")
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.05)
        info = json.loads(self.ready_file.read_text())
        self.address = info["address"]
        self.broker_id = info["broker_id"]
        self.engine_socket = info.get("engine_socket", "")

    @property
    def local_address(self) -> str:
        """Where this machine reaches the broker whatever its network: its engine socket
        (its TCP address until it is ready)."""
        return f"unix:{self.engine_socket}" if self.engine_socket else self.address

    def log_records(self) -> list[dict[str, Any]]:
        """The broker's JSON log lines so far, parsed (other lines are skipped)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        records = []
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict):
                records.append(entry)
        return records

    def warnings(self) -> dict[str, int]:
        """Events the broker logged at warning level or above (its JSON log), and how often."""
        seen: dict[str, int] = {}
        for entry in self.log_records():
            if entry.get("level") in ("warning", "error", "critical"):
                event = str(entry.get("event", "?"))
                seen[event] = seen.get(event, 0) + 1
        return seen

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    def stats(self, timeout_seconds: float = 10.0) -> admin_pb2.Stats:
        """``Admin.GetStats`` of this broker."""
        with grpc.insecure_channel(self.local_address) as channel:
            stats: admin_pb2.Stats = admin_pb2_grpc.AdminStub(channel).GetStats(
                admin_pb2.GetStatsRequest(), timeout=timeout_seconds
            )
            return stats

    def engines(self, timeout_seconds: float = 10.0) -> list[admin_pb2.EngineInfo]:
        """``Admin.ListEngines`` of this broker: its engines."""
        with grpc.insecure_channel(self.local_address) as channel:
            listed: admin_pb2.ListEnginesResponse = admin_pb2_grpc.AdminStub(channel).ListEngines(
                admin_pb2.ListEnginesRequest(), timeout=timeout_seconds
            )
            return list(listed.engines)

    def stop(self, timeout_seconds: float = 20.0) -> int:
        """SIGTERM, then SIGKILL after the timeout; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

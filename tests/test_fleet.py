"""The fleet in etcd (``serve --etcd``, ``kvbroker fleet``): a real etcd (Debian's etcd-server, which
.ci/run installs) on a loopback port. A broker keeps its record under a lease, with its engine
groups; a clean stop removes it, a killed broker's goes within the TTL; etcd stopped and restarted:
the broker keeps serving and registers again."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbroker.broker.fleet import read_fleet
from kvbroker.client import BrokerClient, EngineMemory, RankSpec
from kvbroker.testing import BrokerProcess, eventually

from .conftest import SMALL_MODEL

pytestmark = [pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (.ci/run installs etcd-server)")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Etcd:
    """One etcd member on loopback ports, with its data in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port, self.peer_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.workdir / "etcd.log", "ab")
        self.process = subprocess.Popen(
            [
                "etcd", "--name", "kvbroker-test", "--data-dir", str(self.workdir / "data"),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
                "--initial-cluster", f"kvbroker-test=http://127.0.0.1:{self.peer_port}",
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        eventually(self._answers, 30, interval_seconds=0.2, describe=lambda: (self.workdir / "etcd.log").read_text()[-2000:])

    def _answers(self) -> bool:
        try:
            asyncio.run(read_fleet(self.url))
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(20)
        self.process = None


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    server = Etcd(tmp_path)
    server.start()
    yield server
    server.stop()


def _records(etcd: Etcd) -> list[dict[str, Any]]:
    return asyncio.run(read_fleet(etcd.url))


def _broker(tmp_path: Path, etcd: Etcd, name: str, ttl: float = 2) -> BrokerProcess:
    broker = BrokerProcess.launch(name, tmp_path, ["--etcd", etcd.url, "--etcd-ttl", str(ttl), "--log-level", "info"])
    broker.wait_ready()
    return broker


def test_a_broker_keeps_its_record_with_its_groups_and_removes_it_on_stop(tmp_path: Path, etcd: Etcd) -> None:
    broker = _broker(tmp_path, etcd, "a")
    try:
        eventually(lambda: [r["broker_id"] for r in _records(etcd)] == [broker.broker_id], 10)
        (record,) = _records(etcd)
        assert record["address"] == broker.address and record["groups"] == {} and record["lease_ttl"] > 0
        rank = RankSpec("prefill-0", "prefill", tp_size=2, tp_rank=1)
        memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=4)
        with BrokerClient(broker.address) as client:
            engine = client.register_engine(rank, memory)
            eventually(lambda: "prefill-0" in _records(etcd)[0]["groups"], 10)
            group = _records(etcd)[0]["groups"]["prefill-0"]
            assert (group["role"], group["tp_size"], group["ranks"], group["page_size"]) == ("prefill", 2, ["tp1/pp0"], 4)
            out = subprocess.run(
                [sys.executable, "-m", "kvbroker", "fleet", "--etcd", etcd.url], capture_output=True, text=True, timeout=60
            )
            assert out.returncode == 0 and broker.address in out.stdout and "prefill-0: prefill tp2 pp1  ranks tp1/pp0" in out.stdout, out
            listed = json.loads(subprocess.run(
                [sys.executable, "-m", "kvbroker", "fleet", "--etcd", etcd.url, "--json"], capture_output=True, text=True, timeout=60
            ).stdout)
            assert [r["broker_id"] for r in listed] == [broker.broker_id]
            engine.close()
        memory.close()
        eventually(lambda: _records(etcd)[0]["groups"] == {}, 10)
        assert broker.stop() == 0
        assert _records(etcd) == [], "a clean stop revokes the lease at once"
    finally:
        broker.kill()


def test_a_killed_brokers_record_goes_within_the_ttl(tmp_path: Path, etcd: Etcd) -> None:
    broker = _broker(tmp_path, etcd, "b", ttl=2)
    try:
        eventually(lambda: len(_records(etcd)) == 1, 10)
        killed = time.monotonic()
        os.kill(broker.process.pid, signal.SIGKILL)
        eventually(lambda: _records(etcd) == [], 10)
        assert time.monotonic() - killed < 2 + 3, "the lease expired about when its TTL said"
    finally:
        broker.kill()


def test_etcd_down_then_back_the_broker_serves_and_registers_again(tmp_path: Path, etcd: Etcd) -> None:
    broker = _broker(tmp_path, etcd, "c", ttl=2)
    try:
        eventually(lambda: len(_records(etcd)) == 1, 10)
        etcd.stop()
        eventually(lambda: "etcd_unreachable" in broker.log_tail(20000), 15)
        assert broker.stats().engines == 0  # still serving operators and engines
        etcd.start()
        # etcd keeps keys and leases over a restart: the broker's new registration is what counts.
        eventually(lambda: broker.log_tail(20000).count("etcd_registered") >= 2, 20)
        eventually(lambda: [r["broker_id"] for r in _records(etcd)] == [broker.broker_id], 20)
    finally:
        broker.stop()

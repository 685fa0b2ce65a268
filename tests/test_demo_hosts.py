"""``kvbroker demo --hosts``: each broker, with its engine ranks, on a host of its own.

The demo makes two hosts (network namespaces on a bridge, kvbroker.testing.hosts),
runs the prefill broker on 10.77.0.1 and the decode broker on 10.77.0.2 with
UCX over TCP on eth0, and removes the hosts at the end, also on Ctrl-C. Where
namespaces cannot be made, ``--hosts`` is an error, never a run on loopback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from kvbroker.cli import main
from kvbroker.testing import eventually
from kvbroker.testing.hosts import unavailable

DEMO = [sys.executable, "-m", "kvbroker", "demo", "--hosts", "--no-progress"]


def _hosts_or_skip() -> None:
    """Skip with the one-line reason where hosts cannot be made, unless KVBROKER_REQUIRE_HOSTS=1."""
    reason = unavailable()
    if reason:
        if os.environ.get("KVBROKER_REQUIRE_HOSTS") == "1":
            pytest.fail(f"KVBROKER_REQUIRE_HOSTS=1 but {reason}")
        pytest.skip(reason)


def _namespaces(pid: int) -> list[str]:
    """The network namespaces the demo process ``pid`` made (Network names them kvb<its pid>-...)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"kvb{pid}-")]


def _pids(netns: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30).stdout.split()


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _tidy(demo: subprocess.Popen[str]) -> None:
    """Whatever the test saw: stop the demo's process group and remove any host it left."""
    if demo.poll() is None:
        os.killpg(demo.pid, signal.SIGINT)
        try:
            demo.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    if not _group_gone(demo.pid):
        os.killpg(demo.pid, signal.SIGKILL)
    demo.wait()
    for netns in _namespaces(demo.pid):
        for pid in _pids(netns):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)


@pytest.mark.nixl
@pytest.mark.slow
def _demo(*args: str) -> subprocess.Popen[str]:
    """``kvbroker demo --hosts`` with ``args``, in a process group of its own."""
    return subprocess.Popen([*DEMO, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_demo_moves_the_kv_between_hosts_of_their_own() -> None:
    """The demo verifies every room byte-exact, names the brokers' 10.77.0.x addresses, the
    prefill host's eth0 sent at least the KV bytes (and the decode host's received them),
    and no namespace of the demo is left."""
    _hosts_or_skip()
    demo = _demo("--rooms", "6", "--layers", "3", "--pages", "10")
    try:
        output, _ = demo.communicate(timeout=90)
        left = _namespaces(demo.pid)
    finally:
        _tidy(demo)
    assert demo.returncode == 0, output
    assert "kvbroker demo: OK" in output.splitlines(), output
    assert re.search(r"^  rooms +6/6 verified byte-exact, 0 failed, 0 mismatched$", output, re.M), output
    kv = re.search(r"^  bytes +(\d+) ", output, re.M)
    assert kv, output
    hosts = {
        m["name"]: (m["address"], int(m["sent"]), int(m["received"]))
        for m in re.finditer(
            r"^  (?P<name>prefill|decode) host +broker (?P<address>\S+), eth0 sent (?P<sent>\d+) B, received (?P<received>\d+) B$",
            output,
            re.M,
        )
    }
    assert hosts.keys() == {"prefill", "decode"}, output
    assert hosts["prefill"][0] == "10.77.0.1:50051" and hosts["decode"][0] == "10.77.0.2:50051", output
    # Every KV byte crossed the veth: out of the prefill host, into the decode host.
    assert hosts["prefill"][1] >= int(kv[1]) > 0, output
    assert hosts["decode"][2] >= int(kv[1]), output
    assert left == [], f"the demo left its hosts: {left}"


@pytest.mark.nixl
@pytest.mark.slow
def test_ctrl_c_removes_the_hosts() -> None:
    """Ctrl-C (SIGINT to the demo's process group) while the engines move rooms on the hosts:
    the demo exits, with no namespace and no process of it left."""
    _hosts_or_skip()
    demo = _demo("--rooms", "1000000", "--layers", "2", "--pages", "4")
    try:

        def engines_on_hosts() -> bool:
            hosts = [ns for ns in _namespaces(demo.pid) if ns.endswith(("-prefill", "-decode"))]
            # A broker and an engine process on each host.
            return demo.poll() is not None or (len(hosts) == 2 and all(len(_pids(ns)) >= 2 for ns in hosts))

        eventually(engines_on_hosts, 60, interval_seconds=0.2)
        assert demo.poll() is None, demo.communicate()[0]
        os.killpg(demo.pid, signal.SIGINT)
        output, _ = demo.communicate(timeout=30)
        left = _namespaces(demo.pid)
        eventually(lambda: _group_gone(demo.pid), 15, interval_seconds=0.1)
    finally:
        _tidy(demo)
    assert demo.returncode != 0, output
    assert left == [], f"the demo left its hosts after Ctrl-C: {left}\n{output}"


def test_hosts_where_namespaces_cannot_be_made_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    """No namespaces here: ``--hosts`` exits 2 with the one-line reason (no run on loopback)."""
    reason = unavailable()
    if reason is None:
        pytest.skip("network namespaces can be made here")
    assert main(["demo", "--hosts", "--rooms", "1"]) == 2
    assert capsys.readouterr().err == f"kvbroker demo: --hosts: {reason}\n"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--prefill-broker", "127.0.0.1:1", "--decode-broker", "127.0.0.1:2"], "leave out --prefill-broker and --decode-broker"),
        (["--single-broker"], "leave out --single-broker"),
        (["--device", "cuda"], "leave out --device cuda"),
    ],
    ids=["external-brokers", "single-broker", "cuda"],
)
def test_hosts_refuses_what_it_cannot_mean(extra: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--hosts`` starts two brokers on two hosts and moves host memory over TCP: with given
    brokers, one broker or VRAM it exits 2 saying which option to leave out."""
    assert main(["demo", "--hosts", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbroker demo: --hosts ") and says in err, err

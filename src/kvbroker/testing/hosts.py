"""Hosts of their own on one machine: network namespaces joined by a switch.

Every multi-broker test on loopback sees a peer that vanishes send a reset
(a killed process) or keep its connection (a stopped one), lets every broker
dial every address, and moves UCX's bytes over ``lo``. :class:`Network` makes
hosts that behave like separate machines instead (root and iproute2 needed):

- a *switch* namespace holds a Linux bridge; each :class:`Host` is a network
  namespace of its own with one interface, ``eth0``, a veth whose other end
  is a port of that bridge, and its own address (``10.77.0.1`` onwards, a
  /24 that exists only inside these namespaces: nothing leaves them);
- :meth:`Host.cut` takes the host's port off the bridge: the host's link
  stays up and nothing is reset, frames are dropped silently, as a failed
  switch or cable does on a fleet; :meth:`Host.mend` puts it back;
- :meth:`Host.command` runs a program on the host (``ip netns exec``), and
  :meth:`Host.enter` moves the calling (single-threaded, not yet networked)
  process onto it, for engines in child processes;
- :meth:`Host.env` is the environment of a NIXL process there: UCX on
  ``eth0`` over TCP only. (UCX's shared-memory lanes would reach a process of
  another namespace through this machine's memory, as they do not between
  real hosts.)

Processes on a host reach the files of this machine as before: a broker's
unix sockets (its engine socket and fd socket) serve this process, which is
how a test reaches its brokers' Admin service and registers engines on their
"own host".

:func:`unavailable` says, in one line, why hosts cannot be made here (the
tests skip with it); :meth:`Network.close` removes every namespace, and with
them every veth and the processes still in them, whatever the test did.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbroker.brokerproc import BrokerProcess

__all__ = ["SUBNET", "Host", "Network", "unavailable"]

#: The first three octets of every host's address: 10.77.0.1, 10.77.0.2, ...
SUBNET = "10.77.0"
_CLONE_NEWNET = 0x40000000
_BRIDGE = "br0"
_HOST_IF = "eth0"


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


@functools.cache
def unavailable() -> str | None:
    """Why hosts of their own cannot be made on this machine, in one line; None if they can
    (found once a process)."""
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's ip (Debian: iproute2), not found"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root, as .ci/run does"
    probe = f"kvbprobe-{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", probe)
    except OSError as exc:
        return f"cannot make a network namespace here: {exc}"
    try:
        _ip("-n", probe, "link", "add", "probebr0", "type", "bridge")
    except OSError as exc:
        return f"cannot make a bridge in a network namespace here: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@dataclass
class Host:
    """One host: a network namespace with one interface on the switch."""

    name: str
    netns: str
    address: str
    #: The host's port on the switch (the veth end in the switch namespace).
    port: str
    switch: str
    cut_now: bool = field(default=False, init=False)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a NIXL process on this host: UCX over TCP on ``eth0``."""
        env = dict(os.environ if base is None else base)
        env["UCX_NET_DEVICES"] = _HOST_IF
        env["UCX_TLS"] = "tcp"
        return env

    def broker(self, workdir: Path, extra_args: Sequence[str] = (), *, port: int = 50051, name: str = "") -> BrokerProcess:
        """``kvbroker serve`` on this host, on its address (each host has its own
        ports, so a fixed one serves); call ``wait_ready``. Its ``local_address``
        (the engine socket) reaches it from this machine."""
        from kvbroker.brokerproc import BrokerProcess

        return BrokerProcess.launch(
            name or self.name, workdir, extra_args, env=self.env(), listen=f"{self.address}:{port}", wrapper=self.command([])
        )

    def link_bytes(self) -> tuple[int, int]:
        """(bytes sent, bytes received) on the host's ``eth0`` so far."""
        done = subprocess.run(["ip", "-j", "-s", "-n", self.netns, "link", "show", _HOST_IF], capture_output=True, text=True, timeout=30)
        if done.returncode:
            raise OSError(f"ip -n {self.netns} -s link show {_HOST_IF}: {done.stderr.strip() or done.returncode}")
        stats = json.loads(done.stdout)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def enter(self) -> None:
        """Move this process onto the host (setns): call it first thing in a
        child process, before anything opens a socket or starts a thread."""
        fd = os.open(f"/var/run/netns/{self.netns}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.netns}")
        finally:
            os.close(fd)
        os.environ.update(self.env({}))

    def cut(self) -> None:
        """A silent partition: the switch drops every frame to and from this
        host. Its link stays up and no connection is reset."""
        _ip("-n", self.switch, "link", "set", self.port, "nomaster")
        self.cut_now = True

    def mend(self) -> None:
        """Put the host back on the switch."""
        _ip("-n", self.switch, "link", "set", self.port, "master", _BRIDGE)
        self.cut_now = False


class Network:
    """Hosts joined by one switch, made on ``__enter__`` (or :meth:`open`), all
    removed on :meth:`close`, with every process still running in them."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not 0 < len(names) < 250:
            raise ValueError(f"host names must be distinct, 1 to 249 of them: {names}")
        tag = f"kvb{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.switch = f"{tag}-sw"
        self.hosts = {
            name: Host(name, f"{tag}-{name}", f"{SUBNET}.{i + 1}", f"p{i + 1}", self.switch)
            for i, name in enumerate(names)
        }
        self._made: list[str] = []

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def open(self) -> Network:
        try:
            _ip("netns", "add", self.switch)
            self._made.append(self.switch)
            _ip("-n", self.switch, "link", "add", _BRIDGE, "type", "bridge")
            _ip("-n", self.switch, "link", "set", _BRIDGE, "up")
            for host in self.hosts.values():
                _ip("netns", "add", host.netns)
                self._made.append(host.netns)
                _ip("-n", self.switch, "link", "add", host.port, "type", "veth", "peer", "name", _HOST_IF, "netns", host.netns)
                _ip("-n", self.switch, "link", "set", host.port, "master", _BRIDGE)
                _ip("-n", self.switch, "link", "set", host.port, "up")
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", _HOST_IF)
                _ip("-n", host.netns, "link", "set", _HOST_IF, "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def brokers(self, names: Sequence[str], workdir: Path, extra_args: Sequence[str] = (), timeout_seconds: float = 60.0) -> list[BrokerProcess]:
        """A broker on each named host, started in parallel; returns once all serve."""
        from kvbroker.brokerproc import BrokerProcess

        return BrokerProcess.all_ready([self.hosts[name].broker(workdir, extra_args) for name in names], timeout_seconds)

    def __enter__(self) -> Network:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill what still runs on the hosts and remove every namespace (and so every veth)."""
        for netns in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=30)
        self._made.clear()

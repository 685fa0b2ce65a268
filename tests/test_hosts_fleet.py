"""Brokers on hosts of their own (kvbroker.testing.hosts): the fleet in etcd and mutual TLS
as they behave between machines, not on loopback.

- etcd runs on a third host; the brokers on "p" and "d" keep their records there and the
  operator reads the fleet from a host (``kvbroker fleet`` run there). Receivers name their
  sender by group alone. etcd's host cut off silently (frames dropped, nothing reset): the
  brokers keep serving, rooms between known peers go on (the brokers' last view of the
  fleet), ``Stats.etcd`` says ``unreachable``; mended, both register again and rooms move,
  and a room left open across the outage finishes ("an etcd outage loses no peer").
  A broker's host cut off: its record lapses by its lease; mended, it registers again.
- Mutual TLS where each broker's certificate names only its host's address: rooms move; a
  broker whose certificate names another host's address is refused by its peers, and the
  room's cause says why, within the bootstrap timeout.

Engines run in this process and reach their brokers through the engine socket (a file,
which every namespace sees). Bounds are "not forever" on a loaded 2-core machine: the
documented bound plus ``SLACK_S``.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbroker.client import RoomState, SenderRef
from kvbroker.testing import BrokerProcess, Cleanup, eventually, scratch_dir, wait_until_idle
from kvbroker.testing.hosts import Host, Network
from kvbroker.testing.pattern import write_aux
from kvbroker.testing.scenario import (
    Scenario,
    ScenarioResult,
    close_ranks,
    move_rooms,
    register_group,
    room_plans,
    send_room,
    verify_rooms,
)
from kvbroker.v1 import admin_pb2, admin_pb2_grpc, common_pb2

from .test_tls import _ca, _leaf

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (.ci/run installs etcd-server)")

#: The brokers' etcd lease (``--etcd-ttl``), and the slack a loaded 2-core machine needs on
#: top of a documented bound ("within the bound" here means "not forever", not a speed).
TTL_S = 2
SLACK_S = 10.0
#: How long a receiving room looks for its sender (``--bootstrap-timeout``): in the TLS test,
#: where it bounds the refusal; with etcd, where a room waits for a cut-off host to come back.
TLS_BOOTSTRAP_S = 3.0
ETCD_BOOTSTRAP_S = 20.0
#: What gRPC says when a peer's certificate does not name the address dialled.
VERIFY_FAILED = "Hostname Verification Check failed"
#: Fast peer liveness, prompt eviction of finished rooms (so the brokers go idle at the end).
FAST = [
    "--log-level", "info",
    "--peer-heartbeat", "0.2", "--peer-dead-after", "1", "--peer-timeout", "3",
    "--finished-room-ttl", "1", "--tombstone-ttl", "2",
]  # fmt: skip
SMALL = Scenario(rooms=2, pages=4, chunks=2)


# -- etcd on a host, and the operator's view from a host ---------------------------------------


class HostEtcd:
    """One etcd member on ``host`` (client port 2379, peer port 2380 on its address), its data
    in ``workdir``; started at once, answering after :meth:`wait_ready`."""

    def __init__(self, host: Host, workdir: Path) -> None:
        self.host = host
        self.workdir = workdir
        self.url = f"http://{host.address}:2379"
        self.log = workdir / "etcd.log"
        peer = f"http://{host.address}:2380"
        argv = [
            "etcd", "--name", "kvb-hosts", "--data-dir", str(workdir / "etcd-data"),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvb-hosts={peer}",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(host.command(argv), stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        """Until ``kvbroker fleet`` on the host reads it."""
        eventually(
            lambda: self.process.poll() is None and fleet_cli(self.host, self.url, "--no-probe", "--json", check=False).returncode == 0,
            30,
            interval_seconds=0.5,
            describe=lambda: self.log.read_text(errors="replace")[-2000:],
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def fleet_cli(host: Host, url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``kvbroker fleet --etcd url ...`` run on ``host``, as an operator there would."""
    argv = host.command([sys.executable, "-m", "kvbroker", "fleet", "--etcd", url, *args])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert not check or done.returncode == 0, done
    return done


def records(host: Host, url: str, *, probe: bool = False) -> list[dict[str, Any]]:
    """The broker records in etcd as ``kvbroker fleet --json`` prints them on ``host``
    (``probe``: with what each broker says of itself)."""
    out = fleet_cli(host, url, "--json", *(() if probe else ("--no-probe",)))
    listed: list[dict[str, Any]] = json.loads(out.stdout)
    return listed


def listed_ids(host: Host, url: str) -> list[str]:
    return sorted(r["broker_id"] for r in records(host, url))


# -- the brokers' own views, through their engine sockets --------------------------------------


def _admin(broker: BrokerProcess, call: str, **request: Any) -> Any:
    """``Admin.<call>`` of ``broker`` through its engine socket."""
    with grpc.insecure_channel(broker.local_address) as channel:
        return getattr(admin_pb2_grpc.AdminStub(channel), call)(getattr(admin_pb2, f"{call}Request")(**request), timeout=10)


def _health(broker: BrokerProcess, service: str = "") -> str:
    with grpc.insecure_channel(broker.local_address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def _events(broker: BrokerProcess, event: str) -> list[dict[str, Any]]:
    """The broker's JSON log records of ``event``."""
    return [r for r in broker.log_records() if r.get("event") == event]


def _rooms(prefill: list[Any], decode: list[Any], ref: SenderRef, scenario: Scenario = SMALL) -> ScenarioResult:
    """Move a batch of rooms between registered ranks and check every byte against the reference."""
    plans = room_plans(scenario)
    result = ScenarioResult()
    move_rooms(prefill, decode, plans, ref, result, timeout_seconds=30)
    verify_rooms(scenario, decode, plans, result)
    assert result.bytes > 0 or result.problems
    return result


@dataclass
class EtcdFleet:
    """etcd on host "e", a broker with a prefill group on "p" and one with a decode group on "d"."""

    net: Network
    etcd: HostEtcd
    p: BrokerProcess
    d: BrokerProcess
    group: str = "prefill-hosts"
    prefill: list[Any] = field(default_factory=list)
    decode: list[Any] = field(default_factory=list)

    @property
    def brokers(self) -> tuple[BrokerProcess, BrokerProcess]:
        return self.p, self.d

    def listed(self) -> list[str]:
        """Broker ids etcd lists, read on host "e"."""
        return listed_ids(self.net["e"], self.etcd.url)

    def both_listed(self) -> bool:
        return self.listed() == sorted(b.broker_id for b in self.brokers)

    def describe(self) -> str:
        """The end of every log, for a failed wait."""
        tails = [f"--- etcd\n{self.etcd.log.read_text(errors='replace')[-1500:]}"]
        tails += [f"--- broker {b.name}\n{b.log_tail(3000)}" for b in self.brokers]
        return "\n".join(tails)


@pytest.fixture
def etcd_fleet(network: Callable[..., Network]) -> Iterator[EtcdFleet]:
    net = network("p", "d", "e")
    with scratch_dir("kvb-hf-") as workdir:
        etcd = HostEtcd(net["e"], workdir)
        started: list[BrokerProcess] = []
        fleet: EtcdFleet | None = None
        try:
            etcd.wait_ready()
            flags = [*FAST, "--etcd", etcd.url, "--etcd-ttl", str(TTL_S), "--bootstrap-timeout", str(ETCD_BOOTSTRAP_S)]
            p, d = net.brokers(["p", "d"], workdir, flags)
            started += [p, d]
            fleet = EtcdFleet(net, etcd, p, d)
            fleet.prefill = register_group(SMALL, "prefill", fleet.group, p.local_address)
            fleet.decode = register_group(SMALL, "decode", "decode-hosts", d.local_address)
            yield fleet
        finally:
            with Cleanup() as cleanup:
                for host in net.hosts.values():
                    if host.cut_now:
                        cleanup.run(host.mend)
                if fleet is not None:
                    cleanup.run(lambda: close_ranks(fleet.decode))
                    cleanup.run(lambda: close_ranks(fleet.prefill))
                for broker in started:
                    cleanup.run(broker.stop)
                cleanup.run(etcd.stop)


# -- 1. etcd on a third host ---------------------------------------------------------------------


@needs_etcd
def test_an_operator_on_a_host_sees_the_fleet_and_receivers_find_senders_by_group(etcd_fleet: EtcdFleet) -> None:
    """Both brokers keep their records in etcd on host "e", with their hosts' addresses and groups;
    ``kvbroker fleet`` on host "d" lists them and what each says of itself; a decode room naming
    its sender by group alone moves byte-exact from p to d."""
    f = etcd_fleet
    p, d = f.brokers
    assert (p.address, d.address) == ("10.77.0.1:50051", "10.77.0.2:50051")
    eventually(
        lambda: all(b.stats().etcd == "ok" for b in f.brokers) and f.group in {g for r in records(f.net["e"], f.etcd.url) for g in r["groups"]},
        15,
        interval_seconds=0.5,
        describe=f.describe,
    )
    # The operator, on another host than etcd's: every record, and each broker's own answer over TCP.
    listed = {r["address"]: r for r in records(f.net["d"], f.etcd.url, probe=True)}
    assert set(listed) == {p.address, d.address}, listed
    assert listed[p.address]["broker_id"] == p.broker_id and listed[d.address]["broker_id"] == d.broker_id
    assert set(listed[p.address]["groups"]) == {f.group} and set(listed[d.address]["groups"]) == {"decode-hosts"}
    for record in listed.values():
        assert record["health"] == "SERVING" and record["etcd"] == "ok" and record["lease_granted"] == TTL_S, record
    text = fleet_cli(f.net["d"], f.etcd.url, "--group", f.group).stdout
    (line,) = [x for x in text.splitlines() if not x.startswith(" ")]
    assert line.startswith(p.address) and "SERVING" in line, text
    # By group alone: the decode broker finds the group's broker in its view of etcd.
    result = _rooms(f.prefill, f.decode, SenderRef(group=f.group))
    assert result.ok, result.problems
    assert {peer.address for peer in _admin(d, "ListPeers").peers} == {p.address}, "d reached p at p's host address"
    fleet = {b.address: b for b in _admin(d, "ListPeers").fleet}
    assert set(fleet) == {p.address, d.address} and all(b.usable for b in fleet.values()), fleet
    wait_until_idle(p, d)


@needs_etcd
def test_etcd_cut_off_silently_rooms_go_on_and_both_brokers_register_again(etcd_fleet: EtcdFleet) -> None:
    """Host "e" cut off (etcd unreachable, nothing reset): both brokers keep serving; rooms by
    group go on through their last view of the fleet, and by address; ``Stats.etcd`` says
    ``unreachable``, the health service ``kvbroker.etcd`` NOT_SERVING, and the log
    ``etcd_unreachable``; etcd itself lets the records lapse meanwhile. Mended: both
    brokers register again, the operator lists both, and rooms by group move."""
    f = etcd_fleet
    p, d = f.brokers
    e = f.net["e"]
    ref = SenderRef(group=f.group)
    cut = _moving_then_etcd_cut(f, ref)
    # The lease's refresh (every third of the TTL) times out after the TTL: etcd is unreachable.
    for broker in f.brokers:
        eventually(lambda b=broker: b.stats().etcd == "unreachable", TTL_S + SLACK_S, describe=f.describe)
        # The health service follows Stats.etcd (it looks every 0.2 s); the broker's own stays SERVING.
        eventually(lambda b=broker: _health(b, "kvbroker.etcd") == "NOT_SERVING", SLACK_S)
        assert _health(broker) == "SERVING"
        eventually(lambda b=broker: len(_events(b, "etcd_unreachable")) == 1, SLACK_S, describe=f.describe)
    noticed = time.time() - cut
    assert noticed < TTL_S + SLACK_S
    # etcd, on its host, heard no refresh: both records lapse by their leases.
    eventually(lambda: listed_ids(e, f.etcd.url) == [], TTL_S + SLACK_S, interval_seconds=0.5, describe=f.describe)
    # The brokers still serve, and rooms between them go on: by group (the last view) and by address.
    for sender in (ref, SenderRef(p.address, f.group)):
        result = _rooms(f.prefill, f.decode, sender)
        assert result.ok, (sender, result.problems)
    assert all(b.stats().etcd == "unreachable" for b in f.brokers), "still cut off"
    e.mend()
    mended = time.time()
    for broker in f.brokers:
        eventually(lambda b=broker: b.stats().etcd == "ok" and _health(b, "kvbroker.etcd") == "SERVING", 3 * TTL_S + SLACK_S, describe=f.describe)
        assert len(_events(broker, "etcd_registered")) >= 2, "a new lease: the old one lapsed"
    eventually(f.both_listed, SLACK_S, interval_seconds=0.5, describe=f.describe)
    back = time.time() - mended
    listed = {r["address"]: r for r in records(e, f.etcd.url, probe=True)}
    assert set(listed) == {p.address, d.address} and all(r["health"] == "SERVING" for r in listed.values()), listed
    result = _rooms(f.prefill, f.decode, ref)
    assert result.ok, result.problems
    wait_until_idle(p, d)
    print(f"etcd cut noticed after {noticed:.1f} s; both listed again {back:.1f} s after the mend")
    print(_timeline(f.brokers, cut=cut, mended=mended))


@needs_etcd
def test_a_room_open_across_an_etcd_outage_longer_than_the_ttl_moves(etcd_fleet: EtcdFleet) -> None:
    """docs/failures.md: "An etcd outage loses no peer". etcd's host cut off for longer than the
    TTL: etcd lets both records lapse. A room by group opened during the outage, half sent, is
    still open when the host is mended: the brokers register again, and the room finishes
    byte-exact (neither broker takes the other for lost when it hears of the lapsed records)."""
    f = etcd_fleet
    p, d = f.brokers
    e = f.net["e"]
    ref = SenderRef(group=f.group)
    cut = _moving_then_etcd_cut(f, ref)
    for broker in f.brokers:
        eventually(lambda b=broker: b.stats().etcd == "unreachable", TTL_S + SLACK_S, describe=f.describe)
    eventually(lambda: listed_ids(e, f.etcd.url) == [], TTL_S + SLACK_S, interval_seconds=0.5, describe=f.describe)
    # Open by group through the last view; the first chunk lands; the last waits for the mend.
    (plan,) = room_plans(SMALL)[:1]
    receiver = f.decode[0].engine.receiver(plan.room, ref)
    receiver.init(plan.dst_pages, aux_row=plan.slot)
    sender = f.prefill[0].engine.sender(plan.room)
    sender.init(num_pages=len(plan.src_pages), aux_row=plan.slot)
    (first, *rest) = plan.chunks
    sender.send(np.asarray(plan.src_pages[first[0] : first[1]]), is_last=False)
    eventually(lambda: receiver.status().chunks == 1, SLACK_S, describe=lambda: str(receiver.status()))
    e.mend()
    mended = time.time()
    for broker in f.brokers:
        eventually(lambda b=broker: b.stats().etcd == "ok", 3 * TTL_S + SLACK_S, describe=f.describe)
    eventually(f.both_listed, SLACK_S, interval_seconds=0.5, describe=f.describe)
    write_aux(f.prefill[0].memory, plan.room, plan.slot)
    for a, b in rest:
        sender.send(np.asarray(plan.src_pages[a:b]), is_last=b == len(plan.src_pages))
    status = receiver.wait(30)
    said = f"{RoomState(status.state).name}: {status.cause.message}; the brokers logged:\n{_timeline(f.brokers, cut=cut, mended=mended)}"
    assert RoomState(status.state) is RoomState.SUCCESS, said
    checked = ScenarioResult()
    verify_rooms(SMALL, f.decode, [plan], checked)
    assert checked.ok, checked.problems
    assert not any(_events(b, "peer_lost") for b in f.brokers), _timeline(f.brokers, cut=cut, mended=mended)
    wait_until_idle(p, d)


@needs_etcd
def test_a_cut_off_brokers_record_lapses_by_its_lease_and_comes_back_when_mended(etcd_fleet: EtcdFleet) -> None:
    """Host "p" cut off (its broker partitioned, still running): its record leaves etcd within
    the TTL (and slack), the decode broker's view drops it (``etcd_broker_left``), and a room
    naming its group waits for it, saying so. Mended: p registers again, and the waiting room
    moves from it."""
    f = etcd_fleet
    p, d = f.brokers
    ref = SenderRef(group=f.group)
    eventually(lambda: f.both_listed() and f.group in _served(d), 15, interval_seconds=0.5, describe=f.describe)
    result = _rooms(f.prefill, f.decode, ref)
    assert result.ok, result.problems
    f.net["p"].cut()
    cut = time.time()
    eventually(lambda: f.listed() == [d.broker_id], TTL_S + SLACK_S, interval_seconds=0.5, describe=f.describe)
    lapsed = time.time() - cut
    assert lapsed < TTL_S + SLACK_S
    eventually(lambda: f.group not in _served(d), SLACK_S, describe=f.describe)
    assert [x["broker"] for x in _events(d, "etcd_broker_left")] == [p.broker_id]
    eventually(lambda: p.stats().etcd == "unreachable", TTL_S + SLACK_S, describe=f.describe)  # p still answers
    # A room opened now by group waits for the group (up to the bootstrap timeout) and says why.
    (plan,) = room_plans(Scenario(rooms=1, pages=4, chunks=2))
    receiver = f.decode[0].engine.receiver(plan.room, ref)
    receiver.init(plan.dst_pages, aux_row=plan.slot)
    waiting = f"no broker in etcd under /kvbroker/brokers/ serves engine group {f.group!r} yet (brokers there: {d.address})"
    eventually(lambda: receiver.status().waiting_for == waiting, SLACK_S, describe=lambda: str(receiver.status()))
    assert receiver.poll() is RoomState.BOOTSTRAPPING
    f.net["p"].mend()
    mended = time.time()
    eventually(f.both_listed, TTL_S + SLACK_S, interval_seconds=0.5, describe=f.describe)
    back = time.time() - mended
    assert len(_events(p, "etcd_registered")) >= 2, "p registered again, with a new lease"
    eventually(lambda: p.stats().etcd == "ok", SLACK_S, describe=f.describe)
    send_room(f.prefill, plan)
    status = receiver.wait(30)
    assert RoomState(status.state) is RoomState.SUCCESS, status
    problems = ScenarioResult()
    verify_rooms(SMALL, f.decode, [plan], problems)
    assert problems.ok, problems.problems
    wait_until_idle(p, d)
    print(f"p's record lapsed {lapsed:.1f} s after the cut; listed again {back:.1f} s after the mend")
    print(_timeline(f.brokers, cut=cut, mended=mended))


def _moving_then_etcd_cut(f: EtcdFleet, ref: SenderRef) -> float:
    """Both brokers registered and rooms by group moving; then etcd's host cut. When (time.time())."""
    eventually(lambda: all(b.stats().etcd == "ok" for b in f.brokers) and f.both_listed(), 15, interval_seconds=0.5, describe=f.describe)
    result = _rooms(f.prefill, f.decode, ref)
    assert result.ok, result.problems
    f.net["e"].cut()
    return time.time()


def _timeline(brokers: tuple[BrokerProcess, ...], *, cut: float, mended: float) -> str:
    """The brokers' etcd and peer-loss log records, in order, seconds since the cut."""
    lines = [(0.0, "test", "cut", ""), (mended - cut, "test", "mended", "")]
    for broker in brokers:
        for r in broker.log_records():
            event = str(r.get("event", ""))
            if event.startswith("etcd") or event in ("peer_lost", "peer_dropped"):
                at = datetime.datetime.fromisoformat(str(r["timestamp"]).replace("Z", "+00:00")).timestamp() - cut
                detail = {k: v for k, v in r.items() if k in ("error", "reason", "address", "brokers", "receivers_failed")}
                lines.append((at, broker.name, event, json.dumps(detail)))
    return "\n".join(f"  {at:+7.2f} s  {who:4} {event} {detail}" for at, who, event, detail in sorted(lines))


def _served(broker: BrokerProcess) -> set[str]:
    """The engine groups of the fleet as ``broker`` sees it (Admin ListEngines.fleet_groups)."""
    return {g.group for g in _admin(broker, "ListEngines").fleet_groups}


# -- 2. mutual TLS with the hosts' own addresses -------------------------------------------------


def _pki(workdir: Path, net: Network, names: dict[str, str]) -> dict[str, list[str]]:
    """A CA, and for each broker name a leaf whose only SAN is the address of the host ``names``
    gives for it; the serve flags of each."""
    ca_key, ca, ca_path = _ca(workdir, "hosts")
    flags = {}
    for name, host in names.items():
        cert, key = _leaf(workdir, name, ca_key, ca, [x509.IPAddress(ipaddress.ip_address(net[host].address))])
        flags[name] = ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca_path)]
    return flags


def test_mutual_tls_with_host_addresses_rooms_move_and_a_misnamed_peer_is_refused(network: Callable[..., Network]) -> None:
    """Each broker's certificate names only its host's address: a room moves p -> d byte-exact.
    The broker on "q" has a certificate naming p's address: the decode broker refuses it when it
    dials q, and a room from q to d fails within the bootstrap timeout (and slack) with a cause
    naming the mismatch; q's sending side fails too rather than wait."""
    net = network("p", "d", "q")
    with scratch_dir("kvb-ht-") as workdir:
        tls = _pki(workdir, net, {"p": "p", "d": "d", "q": "p"})
        timeouts = ["--bootstrap-timeout", str(TLS_BOOTSTRAP_S), "--sender-info-timeout", "5"]
        brokers = BrokerProcess.all_ready([net[n].broker(workdir, [*FAST, *timeouts, *tls[n]]) for n in ("p", "d", "q")])
        p, d, q = brokers
        ranks: list[list[Any]] = []
        try:
            ranks.append(prefill := register_group(SMALL, "prefill", "prefill-p", p.local_address))
            ranks.append(decode := register_group(SMALL, "decode", "decode-d", d.local_address))
            ranks.append(misnamed := register_group(SMALL, "prefill", "prefill-q", q.local_address))
            result = _rooms(prefill, decode, SenderRef(p.address, "prefill-p"))
            assert result.ok, result.problems
            assert {peer.address for peer in _admin(d, "ListPeers").peers} == {p.address}
            # q: a certificate the CA signed, naming 10.77.0.1, at 10.77.0.3.
            (plan,) = room_plans(Scenario(rooms=1, pages=4, chunks=2))
            receiver = decode[0].engine.receiver(plan.room, SenderRef(q.address, "prefill-q"))
            receiver.init(plan.dst_pages, aux_row=plan.slot)
            opened = time.monotonic()
            send_room(misnamed, plan)
            status = receiver.wait(TLS_BOOTSTRAP_S + SLACK_S)
            took = time.monotonic() - opened
            message = status.cause.message
            print(f"refused after {took:.1f} s: {common_pb2.FailureKind.Name(status.cause.kind)} {message}")
            assert RoomState(status.state) is RoomState.FAILED, status
            assert status.cause.kind in (common_pb2.FAILURE_KIND_PEER, common_pb2.FAILURE_KIND_TIMEOUT), status
            assert f"handshake with the broker at {q.address} failed" in message and VERIFY_FAILED in message, message
            assert took < TLS_BOOTSTRAP_S + SLACK_S
            # d cannot tell q either: q's side ends at its --sender-info-timeout (5 s here).
            told = misnamed[0].engine.wait([plan.room], timeout_seconds=5 + SLACK_S)[plan.room]
            print(f"q's side: {told.cause.message}")
            assert RoomState(told.state) is RoomState.FAILED and "--sender-info-timeout" in told.cause.message, told
            peers = {peer.address: peer for peer in _admin(d, "ListPeers").peers}
            assert peers[p.address].handshaken and not peers[q.address].handshaken, peers
            # The other way: q dials d (whose certificate is right), and d dials q back.
            ranks.append(decode_q := register_group(SMALL, "decode", "decode-q", q.local_address))
            ranks.append(prefill_d := register_group(SMALL, "prefill", "prefill-d", d.local_address))
            (plan,) = room_plans(Scenario(rooms=1, pages=4, chunks=2))
            receiver = decode_q[0].engine.receiver(plan.room, SenderRef(d.address, "prefill-d"))
            receiver.init(plan.dst_pages, aux_row=plan.slot)
            opened = time.monotonic()
            send_room(prefill_d, plan)
            status = receiver.wait(TLS_BOOTSTRAP_S + SLACK_S)
            took = time.monotonic() - opened
            message = status.cause.message
            print(f"reverse: {took:.1f} s: {common_pb2.FailureKind.Name(status.cause.kind)} {message}")
            assert RoomState(status.state) is RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_PEER, status
            assert f"broker {q.broker_id} says it listens at {q.address}" in message, message
            assert "cannot reach it there" in message and VERIFY_FAILED in message, message
            assert took < TLS_BOOTSTRAP_S + SLACK_S
            told = prefill_d[0].engine.wait([plan.room], timeout_seconds=5 + SLACK_S)[plan.room]
            print(f"reverse, d's side: {RoomState(told.state).name} {told.cause.message}")
            assert RoomState(told.state) is RoomState.FAILED and "--sender-info-timeout" in told.cause.message, told
            wait_until_idle(*brokers)
        finally:
            with Cleanup() as cleanup:
                for group in reversed(ranks):
                    cleanup.run(lambda group=group: close_ranks(group))
                for broker in brokers:
                    cleanup.run(broker.stop)

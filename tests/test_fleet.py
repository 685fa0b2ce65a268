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

from kvbroker.broker.peers import etcd_client, parse_endpoint, read_fleet
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.testing import BrokerProcess, eventually
from kvbroker.testing.scenario import (
    Scenario,
    ScenarioResult,
    close_ranks,
    collect_rooms,
    move_rooms,
    register_group,
    room_plans,
    run_scenario,
    send_room,
    verify_rooms,
)
from kvbroker.v1 import common_pb2

from .conftest import SMALL_MODEL
from .test_grpcurl import grpcurl

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
    (broker,) = _brokers(tmp_path, etcd, [name], ttl=ttl)
    return broker


def test_a_broker_keeps_its_record_with_its_groups_and_removes_it_on_stop(tmp_path: Path, etcd: Etcd) -> None:
    """A broker keeps its etcd record, with the groups registered on it (as ``kvbroker fleet`` lists them), and a
    clean stop removes it at once."""
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
            out = _fleet_cli(etcd)
            assert broker.address in out and "prefill-0: prefill tp2 pp1  ranks tp1/pp0" in out, out
            listed = json.loads(_fleet_cli(etcd, "--json"))
            assert [r["broker_id"] for r in listed] == [broker.broker_id]
            engine.close()
        memory.close()
        eventually(lambda: _records(etcd)[0]["groups"] == {}, 10)
        assert broker.stop() == 0
        assert _records(etcd) == [], "a clean stop revokes the lease at once"
    finally:
        broker.kill()


def test_a_killed_brokers_record_goes_within_the_ttl(tmp_path: Path, etcd: Etcd) -> None:
    """A SIGKILLed broker's etcd record goes when its lease expires, about its TTL after the kill."""
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
    """With etcd down the broker serves on and says etcd is unreachable; once etcd is back it registers again."""
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


# -- finding senders by group -------------------------------------------------------------------

SMALL = Scenario(rooms=2, pages=4, chunks=2)


def _brokers(tmp_path: Path, etcd: Etcd, names: list[str], *args: str, ttl: float = 2) -> list[BrokerProcess]:
    flags = ["--etcd", etcd.url, "--etcd-ttl", str(ttl), "--log-level", "info", "--bootstrap-timeout", "15", *args]
    return BrokerProcess.start_many(names, tmp_path, flags)


def _serving(etcd: Etcd, group: str) -> list[str]:
    """Addresses of the brokers whose record lists ``group``."""
    return [r["address"] for r in _records(etcd) if group in r["groups"]]


def test_receivers_name_senders_by_group_alone_across_three_brokers(tmp_path: Path, etcd: Etcd) -> None:
    """Prefill groups on two brokers, decode on a third: SenderRef(group=...) finds each one."""
    brokers = _brokers(tmp_path, etcd, ["p1", "p2", "d"])
    try:
        eventually(lambda: len(_records(etcd)) == 3, 15)
        for prefill in brokers[:2]:
            result = run_scenario(prefill.address, brokers[2].address, SMALL, sender_address="")
            assert result.ok, result.problems
            assert result.bytes > 0
        peers = {p.address for p in _list_peers(brokers[2])}
        assert {brokers[0].address, brokers[1].address} <= peers, "the decode broker handshook with both prefill brokers"
    finally:
        for broker in brokers:
            broker.stop()


@pytest.mark.parametrize(
    "split",
    [
        # Each decode rank's one source is on one host: decode rank i reads from broker i.
        Scenario(prefill_tp=2, decode_tp=2, rooms=2, pages=4, chunks=2),
        # One decode rank reads head halves from both hosts.
        Scenario(prefill_tp=2, decode_tp=1, rooms=2, pages=4, chunks=2),
        # A pp2 prefill group spread over two hosts: the decode rank reads layers from both.
        Scenario(prefill_pp=2, decode_pp=1, rooms=2, pages=4, chunks=2),
    ],
    ids=lambda s: s.label,
)
def test_a_group_split_over_two_brokers_resolves_per_rank(tmp_path: Path, etcd: Etcd, split: Scenario) -> None:
    """A prefill group with one rank per broker: each decode rank reads from the broker(s) holding its sources."""
    brokers = _brokers(tmp_path, etcd, ["p1", "p2", "d"])
    try:
        result = run_scenario([b.address for b in brokers[:2]], brokers[2].address, split, sender_address="")
        assert result.ok, result.problems
        assert {p.address for p in _list_peers(brokers[2])} >= {b.address for b in brokers[:2]}
    finally:
        for broker in brokers:
            broker.stop()


def _admin(broker: BrokerProcess, call: str, **request: Any) -> Any:
    """``Admin.<call>`` of ``broker`` (the request's fields as keywords)."""
    import grpc

    from kvbroker.v1 import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(broker.address) as channel:
        return getattr(admin_pb2_grpc.AdminStub(channel), call)(getattr(admin_pb2, f"{call}Request")(**request), timeout=30)


def _list_peers(broker: BrokerProcess) -> list[Any]:
    return list(_admin(broker, "ListPeers").peers)


def _rooms(prefill: list[Any], decode: list[Any], ref: SenderRef, scenario: Scenario = SMALL) -> ScenarioResult:
    """Move a batch of rooms between registered ranks and verify every byte."""
    plans = room_plans(scenario)
    result = ScenarioResult()
    move_rooms(prefill, decode, plans, ref, result, timeout_seconds=30)
    verify_rooms(scenario, decode, plans, result)
    return result


def test_a_killed_prefill_brokers_rooms_fail_by_its_lease_and_a_new_broker_takes_the_group(tmp_path: Path, etcd: Etcd) -> None:
    """A SIGKILLed prefill broker's open room fails PEER on the decode side when its etcd lease expires (long before
    the heartbeat would tell), naming the lease; the group registered on a new broker takes the next rooms, nothing
    changed on the decode side."""
    # The decode broker's heartbeat would call the prefill broker dead after 120 s only: the lease tells it first.
    old, decode_broker = _brokers(tmp_path, etcd, ["old", "d"], "--peer-dead-after", "120")
    group, ref = "prefill-moving", SenderRef(group="prefill-moving")
    prefill = register_group(SMALL, "prefill", group, old.address)
    decode = register_group(SMALL, "decode", "decode-0", decode_broker.address)
    new: BrokerProcess | None = None
    try:
        result = _rooms(prefill, decode, ref)
        assert result.ok, result.problems
        plan = room_plans(SMALL)[0]
        receiver = decode[0].engine.receiver(plan.room, ref)
        receiver.init(plan.dst_pages, aux_row=plan.slot)
        eventually(lambda: receiver.poll() is RoomState.WAITING_FOR_INPUT, 15)
        os.kill(old.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        status = receiver.wait(15)
        assert RoomState(status.state) is RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_PEER, status
        assert old.broker_id in status.cause.message and "etcd lease" in status.cause.message, status.cause.message
        assert time.monotonic() - killed < 2 + 5, "the room failed about when the lease expired"
        assert _serving(etcd, group) == []
        close_ranks(prefill, broker_gone=True)
        prefill = []
        # The group comes back on another broker: the next rooms go there, with no change on the decode side.
        (new,) = _brokers(tmp_path, etcd, ["new"])
        prefill = register_group(SMALL, "prefill", group, new.address)
        eventually(lambda: _serving(etcd, group) == [new.address], 10)
        result = _rooms(prefill, decode, ref)
        assert result.ok, result.problems
    finally:
        close_ranks(decode)
        close_ranks(prefill, broker_gone=True)
        for broker in (old, decode_broker, new):
            if broker is not None:
                broker.stop()


def test_losing_one_host_of_a_split_group_fails_the_room_on_every_side(tmp_path: Path, etcd: Etcd) -> None:
    """A decode rank reading layers from two prefill brokers: one is killed; the room fails with a cause
    naming it, and the prefill rank on the other broker hears of it instead of waiting."""
    scenario = Scenario(prefill_pp=2, rooms=1, pages=4, chunks=1)
    brokers = _brokers(tmp_path, etcd, ["p1", "p2", "d"], "--peer-dead-after", "120")
    group, ref = "prefill-split", SenderRef(group="prefill-split")
    prefill = register_group(scenario, "prefill", group, [b.address for b in brokers[:2]])
    decode = register_group(scenario, "decode", "decode-0", brokers[2].address)
    try:
        eventually(lambda: sorted(_serving(etcd, group)) == sorted(b.address for b in brokers[:2]), 10)
        (plan,) = room_plans(scenario)
        receiver = decode[0].engine.receiver(plan.room, ref)
        receiver.init(plan.dst_pages, aux_row=plan.slot)
        survivor = prefill[0].engine.sender(plan.room)
        survivor.init(num_pages=len(plan.src_pages), aux_row=plan.slot)
        eventually(lambda: receiver.poll() is RoomState.WAITING_FOR_INPUT, 15)
        room = _admin(brokers[2], "ListRooms").rooms[0]
        assert set(room.peer.split(",")) == {brokers[0].broker_id, brokers[1].broker_id}, room
        os.kill(brokers[1].process.pid, signal.SIGKILL)
        status = receiver.wait(15)
        assert status.cause.kind == common_pb2.FAILURE_KIND_PEER and brokers[1].broker_id in status.cause.message, status
        told = prefill[0].engine.wait([plan.room], timeout_seconds=15)[plan.room]
        assert RoomState(told.state) is RoomState.FAILED and brokers[1].broker_id in told.cause.message, told
        eventually(lambda: receiver.status().pages_settled, 10)
    finally:
        close_ranks(decode)
        close_ranks(prefill, broker_gone=True)
        for broker in brokers:
            broker.stop()


def test_a_broker_etcd_still_lists_but_that_does_not_answer_is_passed_over(tmp_path: Path, etcd: Etcd) -> None:
    """The newest broker of a group is killed; until its (long) lease expires, rooms go to the older one."""
    older, decode_broker = _brokers(tmp_path, etcd, ["older", "d"])
    (newer,) = _brokers(tmp_path, etcd, ["newer"], ttl=60)
    group, ref = "prefill-twice", SenderRef(group="prefill-twice")
    prefill = register_group(SMALL, "prefill", group, older.address)
    doomed = register_group(SMALL, "prefill", group, newer.address)
    decode = register_group(SMALL, "decode", "decode-0", decode_broker.address)
    try:
        eventually(lambda: sorted(_serving(etcd, group)) == sorted([older.address, newer.address]), 10)
        os.kill(newer.process.pid, signal.SIGKILL)
        result = _rooms(prefill, decode, ref)
        assert result.ok, result.problems
        assert newer.address in _serving(etcd, group), "the killed broker's lease has not expired yet"
        assert "etcd_broker_unreachable" in decode_broker.log_tail(50000)
    finally:
        close_ranks(decode)
        close_ranks(prefill)
        close_ranks(doomed, broker_gone=True)
        for broker in (older, newer, decode_broker):
            broker.stop()


def test_a_broker_of_another_protocol_version_is_not_used(tmp_path: Path, etcd: Etcd) -> None:
    """A broker in etcd that speaks another protocol version is skipped though it is newer: rooms go to the one that
    speaks ours, and with only it left a room fails, naming its address."""
    prefill_broker, decode_broker = _brokers(tmp_path, etcd, ["p", "d"], "--bootstrap-timeout", "3")
    group, ref = "prefill-proto", SenderRef(group="prefill-proto")
    # A newer broker of another protocol version that claims the group (nothing listens at its address).
    alien = {
        "broker_id": "alien", "address": "127.0.0.1:9", "protocol": PROTOCOL_VERSION + 1, "version": "99",
        "started_at": time.time() + 1000, "groups": {group: {"role": "prefill", "tp_size": 1, "pp_size": 1, "ranks": ["tp0/pp0"]}},
    }
    asyncio.run(_put(etcd, "/kvbroker/brokers/alien", json.dumps(alien)))
    prefill = register_group(SMALL, "prefill", group, prefill_broker.address)
    decode = register_group(SMALL, "decode", "decode-0", decode_broker.address)
    try:
        eventually(lambda: len(_serving(etcd, group)) == 2, 10)
        result = _rooms(prefill, decode, ref)
        assert result.ok, result.problems
        assert "etcd_broker_skipped" in decode_broker.log_tail(50000)
        close_ranks(prefill)
        prefill = []
        eventually(lambda: _serving(etcd, group) == ["127.0.0.1:9"], 10)
        plan = room_plans(SMALL)[0]
        receiver = decode[0].engine.receiver(plan.room, ref)
        receiver.init(plan.dst_pages, aux_row=plan.slot)
        status = receiver.wait(20)
        assert RoomState(status.state) is RoomState.FAILED, status
        assert "another protocol version: 127.0.0.1:9" in status.cause.message, status.cause.message
    finally:
        close_ranks(decode)
        close_ranks(prefill)
        prefill_broker.stop()
        decode_broker.stop()


def test_etcd_stopped_and_restarted_rooms_go_on_and_brokers_register_again(tmp_path: Path, etcd: Etcd) -> None:
    """The fleet as operators see it (the fleet CLI, ListPeers, ListEngines, the etcd health service); with etcd
    stopped the brokers say so and rooms between known peers go on, by group and by address; once etcd is back they
    register again."""
    brokers = _brokers(tmp_path, etcd, ["p", "d"])
    prefill_broker, decode_broker = brokers
    group = "prefill-etcd"
    prefill = register_group(SMALL, "prefill", group, prefill_broker.address)
    decode = register_group(SMALL, "decode", "decode-0", decode_broker.address)
    try:
        eventually(lambda: _serving(etcd, group) == [prefill_broker.address], 10)
        eventually(lambda: all(_etcd_health(b) == "SERVING" and b.stats().etcd == "ok" for b in brokers), 10)
        result = _rooms(prefill, decode, SenderRef(group=group))
        assert result.ok, result.problems
        # Which broker serves the group, is it healthy, how many rooms are open on it.
        (line,) = [x for x in _fleet_cli(etcd, "--group", group).splitlines() if not x.startswith(" ")]
        assert line.startswith(prefill_broker.address) and "SERVING" in line and "open rooms 0" in line, line
        # The decode broker's own view of the fleet (Admin ListPeers / ListEngines).
        fleet = {b.broker_id: b for b in _admin(decode_broker, "ListPeers").fleet}
        assert set(fleet) == {b.broker_id for b in brokers} and all(b.usable and b.lease_granted_seconds == 2 for b in fleet.values())
        assert [g.group for g in fleet[prefill_broker.broker_id].groups] == [group]
        placed = {(g.group, g.address, tuple(g.ranks)) for g in _admin(decode_broker, "ListEngines").fleet_groups}
        assert (group, prefill_broker.address, ("tp0/pp0",)) in placed and ("decode-0", decode_broker.address, ("tp0/pp0",)) in placed
        # The grpcurl recipes of docs/operations.md.
        listed = json.loads(grpcurl("-d", "{}", decode_broker.address, "kvbroker.v1.Admin/ListEngines"))
        assert "fleet_groups" in listed, listed
        assert {(g["group"], g["address"]) for g in listed["fleet_groups"]} >= {(group, prefill_broker.address)}
        health = json.loads(grpcurl("-d", '{"service": "kvbroker.etcd"}', decode_broker.address, "grpc.health.v1.Health/Check"))
        assert health == {"status": "SERVING"}
        etcd.stop()
        for broker in brokers:
            eventually(lambda b=broker: b.stats().etcd == "unreachable" and _etcd_health(b) == "NOT_SERVING", 15)
            assert "etcd_watch_lost" in broker.log_tail(50000)
        # Between known peers rooms go on: by group (the last view) and by address.
        for ref in (SenderRef(group=group), SenderRef(prefill_broker.address, group)):
            result = _rooms(prefill, decode, ref)
            assert result.ok, (ref, result.problems)
        for broker in brokers:
            eventually(lambda b=broker: '"etcd_unreachable"' in b.log_tail(50000), 15)
        etcd.start()
        for broker in brokers:
            eventually(lambda b=broker: b.stats().etcd == "ok" and _etcd_health(b) == "SERVING", 20)
            assert broker.log_tail(50000).count('"etcd_registered"') >= 2
        eventually(lambda: sorted(r["broker_id"] for r in _records(etcd)) == sorted(b.broker_id for b in brokers), 20)
        result = _rooms(prefill, decode, SenderRef(group=group))
        assert result.ok, result.problems
    finally:
        close_ranks(decode)
        close_ranks(prefill, broker_gone=True)
        for broker in brokers:
            broker.stop()


def test_a_rolling_restart_loses_no_room_that_had_not_started(tmp_path: Path, etcd: Etcd) -> None:
    """Drain, wait, stop, start (docs/operations.md): rooms open at the drain finish; rooms the decode side
    opens meanwhile wait for the group and move once it is back, on the new process."""
    old, decode_broker = _brokers(tmp_path, etcd, ["old", "d"])
    group, ref = "prefill-rolling", SenderRef(group="prefill-rolling")
    prefill = register_group(SMALL, "prefill", group, old.address)
    decode = register_group(SMALL, "decode", "decode-0", decode_broker.address)
    new: BrokerProcess | None = None
    try:
        eventually(lambda: _serving(etcd, group) == [old.address], 10)
        # Batch A is open on both sides when the drain starts; its chunks come after.
        batch_a = room_plans(SMALL)
        senders = {}
        for plan in batch_a:
            decode[0].engine.receiver(plan.room, ref).init(plan.dst_pages, aux_row=plan.slot)
            senders[plan.room] = [prefill[0].engine.sender(plan.room)]
            senders[plan.room][0].init(num_pages=len(plan.src_pages), aux_row=plan.slot)
        eventually(lambda: all(decode[0].engine.receiver(p.room, ref).poll() is RoomState.WAITING_FOR_INPUT for p in batch_a), 15)
        assert _admin(old, "Drain", wait=False).draining
        eventually(lambda: json.loads(_fleet_cli(etcd, "--group", group, "--json"))[0]["draining"] is True, 10)
        # Batch B opens on the decode side during the drain: it waits for the group (the draining broker is not chosen).
        batch_b = room_plans(SMALL)
        for plan in batch_b:
            decode[0].engine.receiver(plan.room, ref).init(plan.dst_pages, aux_row=plan.slot)
        # A new room on the draining broker's engine side is refused at once (the engine sends it after the restart).
        refused = room_plans(SMALL)[0]
        prefill[0].engine.sender(refused.room).init(num_pages=len(refused.src_pages), aux_row=refused.slot)
        status = prefill[0].engine.wait([refused.room], timeout_seconds=10)[refused.room]
        assert RoomState(status.state) is RoomState.FAILED and "draining" in status.cause.message, status
        result = ScenarioResult()
        for plan in batch_a:
            send_room(prefill, plan, senders[plan.room])
        collect_rooms(decode, prefill, batch_a, 30, result)
        verify_rooms(SMALL, decode, batch_a, result)  # (batch B reuses its slots)
        assert _admin(old, "Drain", wait=True, timeout_seconds=20).drained
        assert old.stop() == 0
        close_ranks(prefill, broker_gone=True)
        prefill = []
        (new,) = _brokers(tmp_path, etcd, ["new"])
        prefill = register_group(SMALL, "prefill", group, new.address)
        for plan in batch_b:
            send_room(prefill, plan)
        collect_rooms(decode, [], batch_b, 30, result)
        verify_rooms(SMALL, decode, batch_b, result)
        assert result.ok, result.problems
    finally:
        close_ranks(decode)
        close_ranks(prefill, broker_gone=True)
        for broker in (old, decode_broker, new):
            if broker is not None:
                broker.stop()


def _etcd_health(broker: BrokerProcess) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(broker.address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvbroker.etcd"), timeout=10)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def _fleet_cli(etcd: Etcd, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "kvbroker", "fleet", "--etcd", etcd.url, *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out
    return out.stdout


async def _put(etcd: Etcd, key: str, value: str) -> None:
    async with etcd_client(*parse_endpoint(etcd.url), 5) as client:
        await client.put(key.encode(), value.encode())


def test_a_receiver_waiting_for_a_group_nobody_holds_says_so(tmp_path: Path, etcd: Etcd) -> None:
    """Issue 21 item 3: a receiver that names a group no broker in etcd holds says, in its status and
    in GetRoom, what it waits for; when the bootstrap timeout ends it, the cause names the group and
    the brokers etcd listed. A broker that registers the group meanwhile ends the wait."""
    flags = ["--etcd", etcd.url, "--etcd-ttl", "2", "--log-level", "info", "--bootstrap-timeout", "4"]
    (d,) = BrokerProcess.start_many(["d"], tmp_path, flags)
    rank = RankSpec(group="waiting-decode", role="decode")
    memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8, aux_rows=2, aux_row_bytes=[16])
    try:
        with BrokerClient(d.address) as client:
            engine = client.register_engine(rank, memory)
            receiver = engine.receiver(1, SenderRef(group="nobody-serves-this"))
            receiver.init([0, 1], aux_row=0)
            expected = f"no broker in etcd under /kvbroker/brokers/ serves engine group 'nobody-serves-this' yet (brokers there: {d.address})"
            eventually(lambda: receiver.status().waiting_for == expected, 10)
            assert receiver.status().state == RoomState.BOOTSTRAPPING
            (side,) = _admin(d, "GetRoom", room=1).sides
            assert side.waiting_for == expected
            status = receiver.wait(15)
            assert status.state == RoomState.FAILED and not status.waiting_for
            assert expected in status.cause.message and "the bootstrap timeout is 4 s, the broker's --bootstrap-timeout" in status.cause.message
            engine.close()
    finally:
        memory.close()
        d.stop()

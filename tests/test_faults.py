"""Fault injection with real processes: killed brokers and engines, restarts, racing aborts.

Brokers run as ``kvbroker serve`` processes with fast liveness settings; the
decode (and most prefill) engine ranks run in the test process. After each
fault: the affected rooms fail with a useful cause within the configured
bound, unaffected rooms complete byte-exact, and the surviving brokers'
per-room tables return to zero once rooms are evicted.
"""

from __future__ import annotations

import multiprocessing
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvbroker import errors
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.testing import BrokerProcess, Cleanup, eventually, wait_until_idle
from kvbroker.testing.engine_child import MODEL, hold_rooms
from kvbroker.v1 import common_pb2

from .conftest import fill_regions, page_bytes

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

FAST = [
    "--peer-heartbeat", "0.2",
    "--peer-dead-after", "1.0",
    "--finished-room-ttl", "1.0",
    "--tombstone-ttl", "1.0",
    "--unregister-settle-timeout", "2",
    "--log-level", "warning",
]
#: Dead-after + a heartbeat + slack for a loaded 2-core machine.
BOUND_SECONDS = 6.0
#: How often waits poll the brokers.
POLL_SECONDS = 0.05


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvb-fault-") as d:
        yield Path(d)


@pytest.fixture
def brokers(workdir: Path) -> Iterator[Callable[..., list[BrokerProcess]]]:
    """Start brokers (FAST settings plus ``extra``); every one is stopped at the end."""
    started: list[BrokerProcess] = []

    def start(*names: str, extra: tuple[str, ...] = ()) -> list[BrokerProcess]:
        new = BrokerProcess.start_many(list(names), workdir, [*FAST, *extra])
        started.extend(new)
        return new

    yield start
    with Cleanup() as cleanup:
        for broker in started:
            cleanup.run(broker.stop)


class Rank:
    """An engine rank in the test process."""

    def __init__(self, address: str, role: str, group: str, seed: int = 0) -> None:
        self.spec = RankSpec(group=group, role=role)  # type: ignore[arg-type]
        self.memory = EngineMemory.allocate(self.spec, MODEL, num_pages=64, aux_rows=4, aux_row_bytes=[16])
        if role == "prefill":
            fill_regions(self.memory, seed)
        self.client = BrokerClient(address)
        self.engine = self.client.register_engine(self.spec, self.memory)

    def close(self, *, broker_killed: bool = False) -> None:
        """Unregister, disconnect, and check the guards around the memory. With
        ``broker_killed`` the test killed this rank's broker on purpose, so the
        unregister may fail as ``Unavailable`` (and only so)."""
        overwritten = self.memory.check_guards()

        def guards_intact() -> None:
            assert not overwritten, overwritten

        with Cleanup() as cleanup:
            cleanup.run(self.engine.close, expect=errors.Unavailable if broker_killed else ())
            cleanup.run(self.client.close)
            cleanup.run(guards_intact)


def _all_failed(seen: dict[int, dict[int, common_pb2.RoomStatus]], statuses: dict[int, common_pb2.RoomStatus]) -> bool:
    """Whether every room has been seen FAILED; keeps each room's first FAILED status in
    ``seen[0]`` (rooms are evicted soon after they end)."""
    first = seen.setdefault(0, {})
    for room, status in statuses.items():
        if status.state == RoomState.FAILED and room not in first:
            assert status.cause.kind != common_pb2.FAILURE_KIND_UNKNOWN_ROOM, f"room {room} was evicted before it was seen failed"
            first[room] = status
    return len(first) == len(statuses)


def _room(prefill: Rank, decode: Rank, address: str, room: int, src: list[int], dst: list[int], *, last: bool = True) -> None:
    decode.engine.receiver(room, SenderRef(address, prefill.spec.group)).init(dst, aux_row=0)
    sender = prefill.engine.sender(room)
    sender.init(num_pages=len(src), aux_row=1)
    half = len(src) // 2
    sender.send(src[:half], is_last=False)
    if last:
        sender.send(src[half:], is_last=True)


def _same_pages(prefill: Rank, decode: Rank, src: list[int], dst: list[int]) -> bool:
    return all(
        torch.equal(a, b)
        for layer in range(MODEL.num_layers)
        for a, b in zip(page_bytes(prefill.memory, layer, src), page_bytes(decode.memory, layer, dst))
    )


def test_killed_decode_broker_fails_prefill_rooms_and_spares_the_others(brokers) -> None:
    """SIGKILL a decode broker mid-room: the prefill side fails those rooms naming it within the
    bound; rooms with another decode broker complete byte-exact; tables return to zero."""
    p, d1, d2 = brokers("p", "d1", "d2")
    prefill = Rank(p.address, "prefill", "pg", seed=1)
    doomed = Rank(d1.address, "decode", "dg1")
    spared = Rank(d2.address, "decode", "dg2")
    try:
        for i in range(4):
            _room(prefill, doomed, p.address, 100 + i, [i * 4, i * 4 + 1, i * 4 + 2, i * 4 + 3], [i, 10 + i, 20 + i, 30 + i], last=False)
        statuses = lambda: prefill.engine.poll([100 + i for i in range(4)])  # noqa: E731
        eventually(lambda: all(s.state == RoomState.TRANSFERRING for s in statuses().values()), BOUND_SECONDS, interval_seconds=POLL_SECONDS)
        d1.kill()
        seen: dict[int, dict[int, common_pb2.RoomStatus]] = {}
        took = eventually(lambda: _all_failed(seen, statuses()), BOUND_SECONDS, interval_seconds=POLL_SECONDS)
        for status in seen[0].values():
            # The heartbeat or the data path (a failed write) notices first.
            assert status.cause.kind in (common_pb2.FAILURE_KIND_PEER, common_pb2.FAILURE_KIND_TRANSFER), status
            assert d1.address in status.cause.message
        src, dst = [40, 41, 45], [3, 4, 5]
        _room(prefill, spared, p.address, 200, src, dst)
        assert spared.engine.wait([200], timeout_seconds=20)[200].state == RoomState.SUCCESS
        assert _same_pages(prefill, spared, src, dst)
        assert took < BOUND_SECONDS
    finally:
        with Cleanup() as cleanup:
            cleanup.run(prefill.close)
            cleanup.run(spared.close)
            cleanup.run(lambda: doomed.close(broker_killed=True))
    wait_until_idle(p, d2)
    for b in (p, d2):
        assert b.stop() == 0, b.log_tail()


def test_killed_prefill_engine_fails_decode_rooms_and_releases_its_memory(brokers) -> None:
    """SIGKILL a prefill engine process holding open rooms: decode rooms fail (ENGINE_LOST) within
    the bound with their pages settled, and the prefill broker deregisters the engine's memory."""
    p, d = brokers("p", "d")
    decode = Rank(d.address, "decode", "dg")
    rooms = [300 + i for i in range(3)]
    for i, room in enumerate(rooms):
        decode.engine.receiver(room, SenderRef(p.address, "child")).init([i * 8 + j for j in range(8)], aux_row=0)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=hold_rooms, args=(p.address, "child", rooms, 8, child), daemon=True)
    proc.start()
    try:
        assert parent.poll(60) and parent.recv() == "ready"
        eventually(lambda: all(s.state == RoomState.TRANSFERRING for s in decode.engine.poll(rooms).values()), 20, interval_seconds=POLL_SECONDS)
        assert p.stats().engines == 1
        proc.kill()
        seen: dict[int, dict[int, common_pb2.RoomStatus]] = {}
        took = eventually(lambda: _all_failed(seen, decode.engine.poll(rooms)), BOUND_SECONDS, interval_seconds=POLL_SECONDS)
        for status in seen[0].values():
            assert status.cause.kind == common_pb2.FAILURE_KIND_ENGINE_LOST, status
        eventually(lambda: all(s.pages_settled for s in decode.engine.poll(rooms).values()), BOUND_SECONDS, interval_seconds=POLL_SECONDS)
        eventually(lambda: p.stats().engines == 0, BOUND_SECONDS, interval_seconds=POLL_SECONDS)
        assert took < BOUND_SECONDS
    finally:
        with Cleanup() as cleanup:
            cleanup.run(proc.kill)
            cleanup.run(decode.close)
    wait_until_idle(p, d)
    for b in (p, d):
        assert b.stop() == 0, b.log_tail()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_restarted_prefill_broker_is_handshaken_afresh(brokers) -> None:
    """A prefill broker killed and restarted on the same address: the decode side fails the rooms
    with the old one and tells the new one, and new rooms work after a fresh handshake."""
    port = _free_port()
    fixed = ["--listen", f"127.0.0.1:{port}"]
    (d,) = brokers("d")
    (p,) = brokers("p", extra=fixed)
    decode = Rank(d.address, "decode", "dg")
    prefill = Rank(p.address, "prefill", "pg", seed=2)
    try:
        _room(prefill, decode, p.address, 400, [1, 2], [5, 6])
        assert decode.engine.wait([400], timeout_seconds=20)[400].state == RoomState.SUCCESS
        decode.engine.receiver(401, SenderRef(p.address, "pg")).init([7, 8], aux_row=0)
        eventually(lambda: decode.engine.poll([401])[401].state == RoomState.WAITING_FOR_INPUT, BOUND_SECONDS, interval_seconds=POLL_SECONDS)
        old_id = p.broker_id
        p.kill()
        prefill.close(broker_killed=True)
        seen: dict[int, dict[int, common_pb2.RoomStatus]] = {}
        took = eventually(lambda: _all_failed(seen, decode.engine.poll([401])), BOUND_SECONDS, interval_seconds=POLL_SECONDS)
        status = seen[0][401]
        assert status.cause.kind == common_pb2.FAILURE_KIND_PEER and old_id in status.cause.message
        assert took < BOUND_SECONDS
        (p,) = brokers("p", extra=fixed)
        assert p.broker_id != old_id
        prefill = Rank(p.address, "prefill", "pg", seed=3)
        # The engine opens room 401 again on the new process: the decode broker told it
        # that room failed, so the source fails at once instead of waiting for a transfer info.
        prefill.engine.sender(401).init(num_pages=2, aux_row=1)
        late = prefill.engine.wait([401], timeout_seconds=BOUND_SECONDS)[401]
        assert late.state == RoomState.FAILED and late.cause.kind == common_pb2.FAILURE_KIND_PEER, late
        assert f"the receiving broker {d.broker_id} failed the room" in late.cause.message and old_id in late.cause.message
        _room(prefill, decode, p.address, 402, [3, 4, 9], [10, 11, 12])
        assert decode.engine.wait([402], timeout_seconds=20)[402].state == RoomState.SUCCESS
        assert _same_pages(prefill, decode, [3, 4, 9], [10, 11, 12])
    finally:
        with Cleanup() as cleanup:
            cleanup.run(prefill.close)
            cleanup.run(decode.close)
    wait_until_idle(p, d)
    for b in (p, d):
        assert b.stop() == 0, b.log_tail()


def test_restart_noticed_only_by_the_next_room(brokers) -> None:
    """A prefill broker restarted while the decode broker had no room with it (so no heartbeat saw it):
    the next room still succeeds, with a fresh handshake, and its pages settle."""
    port = _free_port()
    fixed = ("--listen", f"127.0.0.1:{port}")
    (d,) = brokers("d")
    (p,) = brokers("p", extra=fixed)
    decode = Rank(d.address, "decode", "dg")
    prefill = Rank(p.address, "prefill", "pg", seed=6)
    try:
        _room(prefill, decode, p.address, 450, [1, 2], [5, 6])
        assert decode.engine.wait([450], timeout_seconds=20)[450].state == RoomState.SUCCESS
        p.kill()
        prefill.close(broker_killed=True)
        (p,) = brokers("p", extra=fixed)
        prefill = Rank(p.address, "prefill", "pg", seed=7)
        _room(prefill, decode, p.address, 451, [3, 4, 9], [10, 11, 12])
        status = decode.engine.wait([451], timeout_seconds=20)[451]
        assert status.state == RoomState.SUCCESS and status.pages_settled, status
        assert _same_pages(prefill, decode, [3, 4, 9], [10, 11, 12])
    finally:
        with Cleanup() as cleanup:
            cleanup.run(prefill.close)
            cleanup.run(decode.close)
    wait_until_idle(p, d)


def test_abort_racing_the_last_chunk(brokers) -> None:
    """Decode aborts while prefill sends the last chunk: every room ends on both sides, the receiver's
    pages settle, a room that still succeeded is byte-exact, and the tables return to zero."""
    p, d = brokers("p", "d")
    prefill = Rank(p.address, "prefill", "pg", seed=4)
    decode = Rank(d.address, "decode", "dg")
    rng = random.Random(7)
    rooms: dict[int, RoomState] = {}
    try:
        for i in range(12):
            room = 500 + i
            src = [(i * 4 + j) % 64 for j in range(4)]
            dst = [(i * 4 + j + 13) % 64 for j in range(4)]
            receiver = decode.engine.receiver(room, SenderRef(p.address, "pg"))
            receiver.init(dst, aux_row=i % 4)
            sender = prefill.engine.sender(room)
            sender.init(num_pages=4, aux_row=1)
            sender.send(src[:2], is_last=False)
            delay = rng.uniform(0, 0.004)

            def abort(receiver=receiver, delay=delay) -> None:
                time.sleep(delay)
                receiver.abort("racing the last chunk")

            racer = threading.Thread(target=abort)
            racer.start()
            try:
                # A last chunk for a room the abort already failed is accepted and dropped.
                sender.send(src[2:], is_last=True)
            finally:
                racer.join()
            # Reuse of the destination pages waits for settling, as an engine would.
            eventually(
                lambda room=room: decode.engine.poll([room])[room].pages_settled,
                20,
                interval_seconds=POLL_SECONDS,
                describe=lambda room=room: (decode.engine.poll([room]), prefill.engine.poll([room]), d.log_tail(3000)),
            )
            final = decode.engine.poll([room])[room]
            sent = prefill.engine.wait([room], timeout_seconds=20)[room]
            assert RoomState(sent.state) in (RoomState.SUCCESS, RoomState.FAILED)
            if final.state == RoomState.FAILED:
                assert final.cause.kind == common_pb2.FAILURE_KIND_ABORTED, final
            else:
                assert final.state == RoomState.SUCCESS and _same_pages(prefill, decode, src, dst)
            rooms[room] = RoomState(final.state)
        assert len(rooms) == 12
    finally:
        with Cleanup() as cleanup:
            cleanup.run(prefill.close)
            cleanup.run(decode.close)
    wait_until_idle(p, d)
    for b in (p, d):
        assert b.stop() == 0, b.log_tail()


def test_broker_exits_with_the_process_that_started_it(workdir: Path) -> None:
    """``BrokerProcess`` starts brokers with ``--exit-with-parent``: when the harness dies
    (here a child that launched a broker and was then SIGKILLed), its broker gets
    SIGTERM and exits instead of staying behind. Set after exec, not in a
    ``preexec_fn``, which ran Python in the forked child of a process with gRPC threads."""
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from kvbroker.testing import BrokerProcess\n"
        "b = BrokerProcess.launch('orphan', Path(sys.argv[1]), ['--log-level', 'warning'])\n"
        "b.wait_ready()\n"
        "print(b.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    with subprocess.Popen([sys.executable, "-c", script, str(workdir)], stdout=subprocess.PIPE, text=True) as harness:
        try:
            assert harness.stdout is not None
            broker_pid = int(harness.stdout.readline())
        finally:
            harness.kill()
    eventually(lambda: not _alive(broker_pid), BOUND_SECONDS, interval_seconds=POLL_SECONDS)


def test_broker_refuses_to_start_for_a_parent_that_is_gone(workdir: Path) -> None:
    """``--exit-with-parent`` naming a process that is not the parent: exit 1 at once."""
    done = subprocess.run(
        [sys.executable, "-m", "kvbroker", "serve", "--listen", "127.0.0.1:0", "--uds", str(workdir / "x.sock"),
         "--exit-with-parent", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 1 and "parent process 1 is gone" in done.stderr


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, reaped by init later, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_sending_room_larger_than_the_pool_is_refused_at_once(brokers) -> None:
    """Issue 21 item 4, against a real broker process: ``KVSender.init(num_pages)`` beyond the rank's
    pool raises InvalidArgument in the caller (the client knows the pool), and nothing is queued:
    the broker never hears of the room."""
    (p,) = brokers("p")
    prefill = Rank(p.address, "prefill", "pg")
    try:
        queued = prefill.engine.session._next_seq
        with pytest.raises(errors.InvalidArgument, match="num_pages 65 exceeds the engine's 64 pages"):
            prefill.engine.sender(1).init(num_pages=65, aux_row=1)
        assert prefill.engine.session._next_seq == queued
        prefill.engine.flush()
        assert p.stats().open_rooms == 0
        prefill.engine.sender(2).init(num_pages=64, aux_row=1)  # the pool's size itself is fine
        prefill.engine.flush()
        assert p.stats().open_rooms == 1
    finally:
        prefill.close()

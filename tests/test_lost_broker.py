"""An engine whose own broker goes away: its rooms fail within the client's bound, never wait forever.

Real broker processes; the engines in this process, their clients with a short
``broker_lost_after_seconds``. The decode engine's broker is killed (and not
restarted), or stopped (SIGSTOP) for longer than the bound and then resumed.
``pages_settled`` follows what the client can tell: a killed broker's process
is gone (its end of the engine's fd connection closed), so nothing can write
into the pages; a stopped one may still, so they settle only once it answers
again and has dropped the rooms' transfers. (Killed and restarted within the
bound: ``test_session.py``.)
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbroker import errors
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.testing import BrokerProcess, Cleanup, eventually, scratch_dir
from kvbroker.v1 import common_pb2

from .conftest import SMALL_MODEL, fill_regions, page_bytes

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

#: The decode engine's bound (under the client's default, 5 s, so a client that ignored it shows),
#: and the slack a loaded 2-core machine needs on top of it (the next probe of the broker, a
#: keepalive that notices a stopped one: about 3 s; the rest is for a loaded machine: "within the
#: bound" here means "not forever", not a speed).
BOUND_S = 2.0
SLACK_S = 10.0
#: How far past the bound the client's own count (the seconds its cause names, from the stream's
#: break to the failed probe) may go: the last probe (0.5 s at most) and a loaded machine; well
#: under the 3 s that separate the bound from the client's default.
PROBE_SLACK_S = 2.0
FAST = ["--log-level", "warning", "--peer-heartbeat", "0.2", "--peer-dead-after", "1", "--finished-room-ttl", "60"]
SRC, DST = np.array([3, 4, 5, 6]), np.array([10, 11, 12, 13])


class _Rank:
    def __init__(self, address: str, role: str, group: str, bound: float) -> None:
        self.spec = RankSpec(group=group, role=role)  # type: ignore[arg-type]
        self.memory = EngineMemory.allocate(self.spec, SMALL_MODEL, num_pages=32, aux_rows=4, aux_row_bytes=[16])
        if role == "prefill":
            fill_regions(self.memory, 5)
        self.client = BrokerClient(address, broker_lost_after_seconds=bound)
        self.engine = self.client.register_engine(self.spec, self.memory)

    def close(self, *, broker_gone: bool = False) -> None:
        with Cleanup() as cleanup:
            cleanup.run(self.engine.close, expect=errors.Unavailable if broker_gone else ())
            cleanup.run(self.client.close)


@pytest.fixture
def pair() -> Iterator[tuple[BrokerProcess, BrokerProcess, _Rank, _Rank]]:
    with scratch_dir("kvb-lost-") as workdir:
        p, d = BrokerProcess.start_many(["p", "d"], Path(workdir), FAST)
        prefill = _Rank(p.address, "prefill", "pg", bound=30)
        decode = _Rank(d.address, "decode", "dg", bound=BOUND_S)
        try:
            yield p, d, prefill, decode
        finally:
            with Cleanup() as cleanup:
                for process in (p, d):
                    if process.process.poll() is None:
                        cleanup.run(lambda process=process: os.kill(process.process.pid, signal.SIGCONT))
                cleanup.run(lambda: prefill.close())
                cleanup.run(lambda: decode.close(broker_gone=d.process.poll() is not None))
                cleanup.run(p.stop)
                cleanup.run(d.stop)


def _open_and_land_half(p: BrokerProcess, prefill: _Rank, decode: _Rank, room: int):  # type: ignore[no-untyped-def]
    """Room ``room``: the decode rank expects DST, the first two pages land; (receiver, sender)."""
    receiver = decode.engine.receiver(room, SenderRef(p.address, "pg"))
    receiver.init(DST, aux_row=0)
    sender = prefill.engine.sender(room)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC[:2], is_last=False)
    eventually(lambda: receiver.status().chunks == 1, 20)
    return receiver, sender


def _assert_lost_at_the_bound(status, d: BrokerProcess, decode: _Rank, elapsed: float) -> None:  # type: ignore[no-untyped-def]
    """The room failed BROKER_LOST naming the decode engine's broker (its address and id), after
    the client's bound (``elapsed``: since the broker was killed or stopped) and not far past it:
    the seconds the cause names (the client's count since the stream broke) lie within
    ``PROBE_SLACK_S`` above ``BOUND_S``, which a client with another bound does not meet."""
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_BROKER_LOST, status
    message = status.cause.message
    assert f"broker at {d.address} ({decode.engine.broker_id})" in message, message
    found = re.search(r"did not answer for ([0-9.]+) s", message)
    assert found, message
    waited = float(found.group(1))
    assert BOUND_S <= waited <= BOUND_S + PROBE_SLACK_S, f"failed after {waited} s, the bound is {BOUND_S} s: {message}"
    assert BOUND_S <= elapsed < BOUND_S + SLACK_S, f"failed {elapsed:.1f} s after the broker went, the bound is {BOUND_S} s"


def _snapshot(rank: _Rank, pages: np.ndarray) -> list[torch.Tensor]:
    return [t.clone() for layer in range(SMALL_MODEL.num_layers) for t in page_bytes(rank.memory, layer, pages)]


def test_a_killed_broker_fails_its_engines_rooms_within_the_bound_pages_settled(pair) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL of the decode engine's broker, not restarted: its open room fails BROKER_LOST within
    the bound, naming the broker, with its pages settled (the process is gone); a new command raises
    Unavailable at once; nothing writes into the engine's pages afterwards."""
    p, d, prefill, decode = pair
    receiver, sender = _open_and_land_half(p, prefill, decode, 1)
    before = _snapshot(decode, DST[2:])
    d.kill()
    killed = time.monotonic()
    status = receiver.wait(BOUND_S + SLACK_S)
    _assert_lost_at_the_bound(status, d, decode, time.monotonic() - killed)
    assert "its process is gone" in status.cause.message
    assert status.pages_settled
    start = time.monotonic()
    with pytest.raises(errors.Unavailable, match="is unreachable"):
        decode.engine.receiver(2, SenderRef(p.address, "pg")).init(DST, aux_row=0)
    assert time.monotonic() - start < 1.0
    sender.send(SRC[2:], is_last=True)  # the prefill side goes on: its writes cannot land any more
    assert sender.wait(10).state == RoomState.FAILED
    time.sleep(1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(decode, DST[2:]))), "written after the broker died"


def test_a_stopped_broker_fails_the_rooms_unsettled_and_settles_them_once_it_answers(pair) -> None:  # type: ignore[no-untyped-def]
    """SIGSTOP of the decode engine's broker for longer than the bound: the open room fails
    BROKER_LOST with its pages not settled (the process may still write); new commands raise
    Unavailable. After SIGCONT the session resumes, the broker hears the room failed here, drops
    its transfers and reports the pages settled; pages reused then stay as the engine wrote them;
    new rooms move byte-exact."""
    p, d, prefill, decode = pair
    receiver, sender = _open_and_land_half(p, prefill, decode, 1)
    os.kill(d.process.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        status = receiver.wait(BOUND_S + SLACK_S)
        _assert_lost_at_the_bound(status, d, decode, time.monotonic() - stopped)
        assert "may still be running" in status.cause.message and not status.pages_settled
        with pytest.raises(errors.Unavailable, match="is unreachable"):
            decode.engine.receiver(2, SenderRef(p.address, "pg")).init(DST, aux_row=0)
        sender.send(SRC[2:], is_last=True)  # a write may reach the stopped broker's memory
    finally:
        os.kill(d.process.pid, signal.SIGCONT)
    eventually(lambda: receiver.status().pages_settled, 20)
    assert receiver.status().cause.kind == common_pb2.FAILURE_KIND_BROKER_LOST, "the first cause stays"
    for layer in range(SMALL_MODEL.num_layers):  # the engine reuses the pages now
        for tensor in decode.memory.kv_tensors(layer):
            tensor.view(torch.uint8)[torch.as_tensor(DST)] = 0x5A
    reused = _snapshot(decode, DST)
    eventually(lambda: _new_room_moves(p, prefill, decode, 3), 20)
    time.sleep(1.0)
    assert all(torch.equal(a, b) for a, b in zip(reused, _snapshot(decode, DST))), "a transfer landed in reused pages"


def _new_room_moves(p: BrokerProcess, prefill: _Rank, decode: _Rank, room: int) -> bool:
    """A new room through the resumed session: False (to try again) if the session is not back yet."""
    dst = np.array([20, 21])
    try:
        decode.engine.receiver(room, SenderRef(p.address, "pg")).init(dst, aux_row=2)
    except errors.Unavailable:
        return False
    sender = prefill.engine.sender(room)
    sender.init(2, aux_row=1)
    sender.send(np.array([7, 8]))
    assert decode.engine.wait([room], timeout_seconds=20)[room].state == RoomState.SUCCESS
    for layer in range(SMALL_MODEL.num_layers):
        for a, b in zip(page_bytes(prefill.memory, layer, [7, 8]), page_bytes(decode.memory, layer, dst)):
            assert torch.equal(a, b)
    return True


def _children(pid: int, needle: str) -> list[int]:
    """Processes whose parent is ``pid`` and whose command line has ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and needle in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize(("brokers", "victim"), [("external", "d"), ("external", "p"), ("its-own", "d")])
def test_the_demo_stops_within_seconds_when_a_broker_dies_and_says_which(brokers: str, victim: str) -> None:
    """``kvbroker demo`` moving many rooms; the decode (or prefill) broker is SIGKILLed: the demo exits
    1 within the client's bound and a few seconds, naming the broker (not after the run's timeout)."""
    import subprocess
    import sys

    with scratch_dir("kvb-lost-demo-") as workdir:
        external: list[BrokerProcess] = []
        args = [sys.executable, "-m", "kvbroker", "demo", "--rooms", "20000", "--pages", "64", "--no-progress"]
        if brokers == "external":
            external = BrokerProcess.start_many(["p", "d"], Path(workdir), ["--log-level", "warning"])
            args += ["--prefill-broker", external[0].address, "--decode-broker", external[1].address]
        demo = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            if external:
                # Rooms are moving once the decode broker saw one succeed (under load the engines'
                # start can take longer than any fixed sleep: a broker killed while they still
                # register fails the demo another way).
                eventually(
                    lambda: demo.poll() is not None or external[1].stats().rooms_succeeded > 0,
                    60,
                    interval_seconds=0.2,
                )
            else:
                time.sleep(8)  # rooms are moving
            assert demo.poll() is None, demo.communicate()[0]
            if external:
                dead = external[0 if victim == "p" else 1]
                pid, address = dead.process.pid, dead.address
            else:
                [pid] = _children(demo.pid, "decode.sock")
                address = "decode"
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            output, _ = demo.communicate(timeout=60)
            took = time.monotonic() - killed
        finally:
            if demo.poll() is None:
                demo.kill()
            for broker in external:
                broker.stop()
        assert demo.returncode == 1, output
        assert took < 5.0 + 15.0, f"the demo took {took:.1f} s to stop"
        assert "kvbroker demo: FAILED" in output and address in output, output

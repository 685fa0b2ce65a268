"""The NIXL data-plane thread, with the scripted fake agent: ``kvbroker.broker.dataplane``."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvbroker.broker.dataplane import DataPlane, Event, Notices, Posting, Settled, XferState
from kvbroker.broker.memory import array_at, map_anonymous, unmap
from kvbroker.broker.scheduling import Priority, Ticket
from kvbroker.errors import NixlError, TransferTimeout
from kvbroker.testing import FakeAgent, FakeFabric, XferScript

DRAM = 1
SIZE = 1 << 16


class Plane:
    """A data plane over two fake agents (a sender and a receiver) on a private loop."""

    def __init__(self, transfer_timeout_seconds: float = 30.0) -> None:
        fabric = FakeFabric()
        self.sender, self.receiver = FakeAgent("dp_sender", fabric), FakeAgent("dp_receiver", fabric)
        self.src, self.dst = map_anonymous(SIZE), map_anonymous(SIZE)
        array_at(self.src, SIZE)[:] = np.arange(SIZE, dtype=np.uint8)
        self.sender.register(self.src, SIZE, DRAM, 0)
        self.receiver.register(self.dst, SIZE, DRAM, 0)
        self.sender.add_remote(self.receiver.metadata())
        self.receiver.add_remote(self.sender.metadata())
        self.events: list[Event] = []
        #: The tokens in the order the thread posted them.
        self.posted: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.plane = DataPlane(self.sender, on_events=self.events.extend, take_notice=None, transfer_timeout_seconds=transfer_timeout_seconds)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.run(self._start())

    async def _start(self) -> None:
        self.plane.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def post(self, token: str, nbytes: int = 4096, notif: bytes = b"", ticket: Ticket | None = None) -> None:
        def make(agent: Any) -> Any:
            self.posted.append(token)
            local = np.array([[self.src, nbytes, 0]], dtype=np.uint64)
            remote = np.array([[self.dst, nbytes, 0]], dtype=np.uint64)
            return agent.post_write_descs(local, DRAM, remote, DRAM, "dp_receiver", notif)

        self.loop.call_soon_threadsafe(self.plane.post, Posting(token, make, "dp_receiver", nbytes, ticket))

    def settled(self) -> dict[str, Settled]:
        return {e.token: e for e in list(self.events) if isinstance(e, Settled)}

    def close(self) -> None:
        self.run(self.plane.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
        unmap(self.src, SIZE)
        unmap(self.dst, SIZE)


@pytest.fixture
def plane() -> Any:
    p = Plane(transfer_timeout_seconds=0.3)
    yield p
    p.close()


def _wait(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_a_posted_transfer_settles_once_and_its_bytes_land(plane: Plane) -> None:
    """A post comes back as one Settled DONE event on the loop; the fake agent copied the bytes."""
    plane.post("a", 4096)
    _wait(lambda: "a" in plane.settled())
    event = plane.settled()["a"]
    assert event.state is XferState.DONE and event.error is None
    assert np.array_equal(array_at(plane.dst, 4096), array_at(plane.src, 4096))
    time.sleep(0.05)
    assert [e.token for e in plane.events if isinstance(e, Settled)] == ["a"]


def test_posts_queued_together_go_by_ticket_and_never_before_a_job_queued_ahead_of_them(plane: Plane) -> None:
    """While the thread is busy, posts queue up: an interactive one queued after two bulk ones is
    posted first; a call queued between posts keeps its place (posts before it go before it)."""
    release = threading.Event()
    ran: list[str] = []

    def hold(agent: Any) -> None:
        release.wait(5)

    def job(agent: Any) -> None:
        ran.append(f"job after {list(plane.posted)}")

    plane.loop.call_soon_threadsafe(plane.plane.call, hold)
    time.sleep(0.05)
    plane.post("bulk-1", ticket=Ticket(Priority.BULK, "a", 4096))
    plane.post("bulk-2", ticket=Ticket(Priority.BULK, "a", 4096))
    plane.post("chat-1", ticket=Ticket(Priority.INTERACTIVE, "b", 4096))
    plane.loop.call_soon_threadsafe(plane.plane.call, job)
    plane.post("chat-2", ticket=Ticket(Priority.INTERACTIVE, "b", 4096))
    time.sleep(0.05)
    release.set()
    _wait(lambda: len(plane.settled()) == 4)
    assert plane.posted == ["chat-1", "bulk-1", "bulk-2", "chat-2"]
    assert ran == ["job after ['chat-1', 'bulk-1', 'bulk-2']"]


def test_a_rejected_post_settles_as_an_error(plane: Plane) -> None:
    """A post NIXL refuses settles ERR with the error (nothing stays in flight)."""
    plane.sender.script(XferScript(fail_post=True))
    plane.post("rejected")
    _wait(lambda: "rejected" in plane.settled())
    event = plane.settled()["rejected"]
    assert event.state is XferState.ERR and isinstance(event.error, NixlError) and plane.plane.inflight == 0


def test_notifications_come_back_as_events_while_listening(plane: Plane) -> None:
    """With rooms waiting for data the plane polls for notifications and hands them to the loop."""
    plane.loop.call_soon_threadsafe(setattr, plane.plane, "listening", True)
    plane.receiver.send_notif("dp_sender", b"hello")  # the receiver's agent tells the sender's
    _wait(lambda: any(isinstance(e, Notices) for e in plane.events))
    (notices,) = [e for e in plane.events if isinstance(e, Notices)]
    assert notices.items == [("dp_receiver", b"hello")]


def test_a_hung_transfer_is_cancelled_at_the_timeout_without_burning_a_core(plane: Plane) -> None:
    """A transfer that never finishes settles ERR (TransferTimeout) after the transfer timeout; meanwhile
    the thread backs off instead of spinning: a few hundred passes a second at most."""
    plane.sender.script(XferScript(outcome="HANG"))
    before = plane.plane.passes
    plane.post("hung")
    _wait(lambda: "hung" in plane.settled())
    event = plane.settled()["hung"]
    assert event.state is XferState.ERR and isinstance(event.error, TransferTimeout) and event.elapsed_s >= 0.3
    assert plane.plane.passes - before < 2000 * event.elapsed_s, "the thread spun"


def test_a_held_peers_hung_transfer_outlives_the_timeout_and_times_out_once_let_go(plane: Plane) -> None:
    """A silent peer's transfers are held (``DataPlane.hold``): a write queued in a cut link lands
    when the link returns, so the transfer timeout cancels none of them. A hung one is still in
    flight after three timeouts; let go, it gets a whole timeout from then, and settles ERR."""
    plane.sender.script(XferScript(outcome="HANG"))
    plane.loop.call_soon_threadsafe(plane.plane.hold, "dp_receiver", True)
    plane.post("held")
    time.sleep(0.9)
    assert "held" not in plane.settled() and plane.plane.inflight == 1
    let_go = time.monotonic()
    plane.loop.call_soon_threadsafe(plane.plane.hold, "dp_receiver", False)
    _wait(lambda: "held" in plane.settled())
    assert time.monotonic() - let_go >= 0.3
    event = plane.settled()["held"]
    assert event.state is XferState.ERR and isinstance(event.error, TransferTimeout)


def test_an_idle_plane_sleeps(plane: Plane) -> None:
    """Nothing in flight, no room waiting for data: the thread wakes about once a second."""
    time.sleep(0.2)
    before = plane.plane.passes
    time.sleep(1.5)
    assert plane.plane.passes - before <= 3


def test_calls_run_on_the_plane_thread_and_return_their_result(plane: Plane) -> None:
    """call() runs a function of the agent on the data-plane thread; its exception reaches the caller."""
    names: list[str] = []

    def where(agent: Any) -> str:
        names.append(threading.current_thread().name)
        return str(agent.name)

    async def ask() -> str:
        return await plane.plane.call(where)

    assert plane.run(ask()) == "dp_sender" and names == ["kvbroker-nixl"]

    async def fail() -> None:
        await plane.plane.call(lambda agent: agent.prep_dlist("nobody", np.zeros((1, 5), dtype=np.uint64), DRAM))

    with pytest.raises(NixlError):
        plane.run(fail())


def test_the_backoff_stays_short_while_a_young_transfer_is_in_flight() -> None:
    """A part holds its slots until its write is seen DONE: while a transfer younger than 100 ms is
    in flight the plane polls at most 200 us apart, whatever the backoff grew to (it was 1 ms, up
    to a millisecond added to every part); once every transfer in flight is old, 5 ms apart. While
    packed parts are in flight (``busy``) or a device copy is watched, every 100 us, with no backoff;
    with nothing to wait for, once a second."""
    from types import SimpleNamespace

    from kvbroker.broker.dataplane import MAX_WAIT_S, MIN_WAIT_S, Pacing

    pacing = Pacing(lambda: None)
    young, old = [SimpleNamespace(posted_at=time.monotonic())], [SimpleNamespace(posted_at=time.monotonic() - 1.0)]
    assert pacing.wait(MAX_WAIT_S, young, False) <= 200e-6
    assert pacing.wait(MIN_WAIT_S, young, False) == MIN_WAIT_S
    assert pacing.wait(MAX_WAIT_S, old, False) == 5e-3
    assert pacing.wait(MAX_WAIT_S, [], False) == 1.0, "idle: nothing to wait for"
    pacing.listening = True
    assert pacing.wait(MAX_WAIT_S, [], False) == MAX_WAIT_S, "listening: the backoff grows"
    assert pacing.wait(MAX_WAIT_S, [], True) == pacing.wait(MAX_WAIT_S, old, True) <= 100e-6, "a device copy watched"
    pacing.busy = True
    assert pacing.wait(MAX_WAIT_S, old, False) <= 100e-6, "packed parts in flight: no backoff"

"""The data plane: the one thread that owns the NIXL agent.

NIXL is not guaranteed thread-safe, so every call on the agent runs on this
thread: registering and deregistering memory, preparing and releasing
descriptor lists, loading and dropping peers' metadata, posting transfers,
checking them, sending and reading notifications. The control loop (the
asyncio thread that runs gRPC and the room state machines) never calls NIXL:
it hands work to this thread through a queue and gets the outcome back as
events, delivered on the loop in batches.

Two kinds of work:

- calls (:meth:`DataPlane.call`): run a function of the agent here and
  resolve a future with its result (registration, descriptor lists, peers'
  metadata). The loop awaits the future; a multi-GiB registration or a
  descriptor list of millions of items never stalls it.
- transfers (:meth:`DataPlane.post`, :meth:`DataPlane.notify`): post here,
  then poll until DONE or ERR; each settles exactly once with a
  :class:`Settled` event. UCX copies host memory inside ``transfer()`` on
  copy-based transports (cma, tcp); NIXL releases the GIL for it, so the copy
  overlaps the loop's gRPC handling.

How closely the thread polls: ``_pacing`` (:class:`Pacing`).

A transfer in flight longer than the transfer timeout is cancelled (its
handle released) and settles as ERR with :class:`TransferTimeout`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from kvbroker.broker.dataplane._agent import Agent, XferState
from kvbroker.broker.dataplane._pacing import MAX_WAIT_S, MIN_WAIT_S, Pacing
from kvbroker.broker.dataplane._workers import IN_ORDER, LoopInbox, name_thread
from kvbroker.broker.scheduling import FairQueue, Priority, Ticket
from kvbroker.broker.telemetry import QueueStats
from kvbroker.errors import KvBrokerError, NixlError, TransferTimeout, Unavailable

__all__ = ["DataPlane", "Notices", "Posting", "Settled"]

log = structlog.get_logger(__name__)

T = TypeVar("T")

@dataclass(frozen=True)
class Posting:
    """A transfer to post: ``make(agent)`` builds and posts it, returning the
    NIXL handle (or raising ``KvBrokerError`` if nothing was posted).
    ``token`` comes back in the :class:`Settled` event."""

    token: Any
    make: Callable[[Agent], Any]
    remote_agent: str
    nbytes: int
    #: Its place among the posts queued together (None: STANDARD, first come first served).
    ticket: Ticket | None = None


@dataclass(frozen=True)
class Settled:
    """A posted transfer (or notification) finished: DONE, or ERR with ``error``
    set when the broker knows why (a rejected post, a cancel, a timeout)."""

    token: Any
    state: XferState
    descriptors: int | None
    error: KvBrokerError | None
    elapsed_s: float
    #: When the data plane saw it settle (monotonic seconds).
    settled_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Notices:
    """Notifications that arrived: (sending agent, payload), oldest first."""

    items: list[tuple[str, bytes]]
    #: When the data plane read them (monotonic seconds).
    at: float = field(default_factory=time.monotonic)


Event = Settled | Notices


@dataclass(eq=False)
class _InFlight:
    posting: Posting
    handle: Any
    posted_at: float = field(default_factory=time.monotonic)


class _PostJob:
    """A post queued for the thread (a job the thread may reorder among posts)."""

    __slots__ = ("_plane", "posting")

    def __init__(self, plane: DataPlane, posting: Posting) -> None:
        self._plane = plane
        self.posting = posting

    def __call__(self) -> None:
        self._plane._post(self.posting)

    @property
    def ticket(self) -> Ticket:
        return self.posting.ticket or Ticket(Priority.STANDARD, "", self.posting.nbytes)


class _Launch:
    """A device copy to launch on the thread (ordered among posts and launches by its ticket)."""

    __slots__ = ("fn", "ticket")

    def __init__(self, fn: Callable[[], None], ticket: Ticket | None) -> None:
        self.fn = fn
        self.ticket = ticket or IN_ORDER

    def __call__(self) -> None:
        self.fn()


class DataPlane:
    """The NIXL owner thread. Start it with :meth:`start`, stop with :meth:`stop`."""

    def __init__(
        self,
        agent: Agent,
        *,
        on_events: Callable[[list[Event]], None],
        take_notice: Callable[[str, bytes], bool] | None,
        transfer_timeout_seconds: float,
        queues: QueueStats | None = None,
    ) -> None:
        self._agent = agent
        self._on_events = on_events
        #: ``take_notice(agent, payload)`` sees each notification here as it is
        #: read; one it takes (True) is not delivered to the loop, one it
        #: declines (or raises on) is. None: every one goes to the loop.
        self.take_notice = take_notice
        self._timeout_s = transfer_timeout_seconds
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        #: Posts queued together, reordered by ticket (``queues``: their waits in GetStats).
        self._posts_observer = queues.observer("data_plane") if queues is not None else None
        self._inflight: list[_InFlight] = []
        #: Remote agents of silent peers: transfers to them are not cancelled by
        #: the timeout (see :meth:`hold`).
        self._held: set[str] = set()
        self._events: list[Event] = []
        #: Events handed over by the thread, not yet delivered on the loop.
        self._pending: list[Event] = []
        self._lock = threading.Lock()
        self._delivery_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        #: What this thread's continuations and the lanes' tell the control loop, in
        #: batches (its loop set when the data plane starts).
        self.inbox = LoopInbox()
        self._thread: threading.Thread | None = None
        self._pacing = Pacing(self._wake)
        #: Device copies launched here whose completion each pass checks: (done?, then).
        self._watches: list[tuple[Callable[[], bool], Callable[[BaseException | None], None]]] = []
        #: Passes over the agent (for tests and the idle-CPU benchmark).
        self.passes = 0

    # -- lifecycle (control loop) ---------------------------------------
    def start(self) -> None:
        self._loop = self.inbox.loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvbroker-nixl", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop after the work queued so far; transfers still in flight are released."""
        if self._thread is None:
            return
        self._jobs.put(None)
        thread = self._thread
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        self._thread = None

    @property
    def pacing(self) -> Pacing:
        """How closely the thread polls (the control loop sets what it waits for)."""
        return self._pacing

    @property
    def inflight(self) -> int:
        """Transfers posted and not yet settled (a racy read: for tests and stats)."""
        return len(self._inflight)

    # -- work (control loop) ----------------------------------------------
    def call(self, fn: Callable[[Agent], T]) -> asyncio.Future[T]:
        """Run ``fn(agent)`` on the data-plane thread; await the result."""
        future: Future[T] = Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self._agent))
            except BaseException as exc:  # handed to the awaiting caller
                future.set_exception(exc)

        self._submit(job)
        return asyncio.wrap_future(future)

    def post(self, posting: Posting) -> None:
        """Post a transfer; it settles exactly once with a :class:`Settled` event.
        Posts queued together go out in the order of their tickets (after the
        jobs queued before them, before those queued after). Any thread; on this
        one (a device copy's completion), it is posted at once."""
        if threading.current_thread() is self._thread:
            self._post(posting)
            return
        self._submit(_PostJob(self, posting))

    def launch(self, fn: Callable[[], None], ticket: Ticket | None = None) -> None:
        """Run ``fn`` on this thread, in the order of ``ticket`` among the posts and
        launches queued with it (any thread): the device lanes launch their copies
        here, and :meth:`watch` their completion, so that a gather's completion
        posts its write, and a scatter's returns its credit, in the same pass."""
        self._submit(_Launch(fn, ticket))

    def watch(self, done: Callable[[], bool], then: Callable[[BaseException | None], None]) -> None:
        """Check ``done()`` every pass (this thread only: from a :meth:`launch`),
        and call ``then(None)`` once it is true (``then(error)`` if it raised).
        While anything is watched the thread polls closely (``_pacing``)."""
        self._watches.append((done, then))

    def notify(self, token: Any, remote_agent: str, payload: bytes) -> None:
        """Send a notification; settles (DONE, or ERR if NIXL refused) like a transfer."""

        def job() -> None:
            start = time.monotonic()
            try:
                self._agent.send_notif(remote_agent, payload)
            except KvBrokerError as exc:
                self._emit(Settled(token, XferState.ERR, None, exc, time.monotonic() - start))
                return
            self._emit(Settled(token, XferState.DONE, 0, None, time.monotonic() - start))

        self._submit(job)

    def send(self, remote_agent: str, payload: bytes) -> None:
        """Send a notification and forget it (a refused one is logged): for
        messages nothing waits on, such as credit returns. Any thread; on this
        one (a scatter's completion), it is sent at once."""

        def job() -> None:
            try:
                self._agent.send_notif(remote_agent, payload)
            except KvBrokerError as exc:
                log.warning("notification_not_sent", remote=remote_agent, error=exc.message)

        if threading.current_thread() is self._thread:
            job()
            return
        self._submit(job)

    def cancel(self, remote_agent: str, why: Callable[[], KvBrokerError]) -> None:
        """Cancel every transfer in flight to ``remote_agent`` (a lost peer).

        NIXL cancels a transfer when its handle is released; one it cannot
        cancel stays in flight and is tried again with the next cancel or the
        transfer timeout."""
        def job() -> None:
            self._cancel(lambda t: t.posting.remote_agent == remote_agent, lambda _t: why())

        self._submit(job)

    def hold(self, remote_agent: str, held: bool) -> None:
        """Hold (or let go) the transfers to ``remote_agent``, a silent peer's:
        a write queued in a cut link lands when the link returns, whatever NIXL
        was told, so while held the transfer timeout cancels none of them and
        they stay until NIXL finishes them. Let go (the peer answers again, or
        is found gone), those in flight get a whole timeout from then."""

        def job() -> None:
            if held:
                self._held.add(remote_agent)
                return
            self._held.discard(remote_agent)
            now = time.monotonic()
            for transfer in self._inflight:
                if transfer.posting.remote_agent == remote_agent:
                    transfer.posted_at = now

        self._submit(job)

    def _wake(self) -> None:
        """Wake the thread (asleep in a longer wait than it should now be)."""
        if self._thread is not None:
            self._jobs.put(_noop)

    def _submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            raise Unavailable("the broker's data plane is not running")
        self._jobs.put(job)

    # -- the thread ---------------------------------------------------------
    def _run(self) -> None:
        name_thread("kvb-nixl")
        wait = MIN_WAIT_S
        running = True
        while running:
            busy = False
            try:
                job = self._jobs.get(timeout=self._pacing.wait(wait, self._inflight, bool(self._watches)))
            except queue.Empty:
                job = _NO_JOB
            posts: FairQueue[_PostJob | _Launch] = FairQueue(observer=self._posts_observer)
            while job is not _NO_JOB:
                if job is None:
                    running = False
                    break
                busy = True
                if isinstance(job, _PostJob | _Launch):
                    posts.push(job, job.ticket)
                else:
                    self._run_posts(posts)  # those queued before it go first
                    self._run_job(job)
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    job = _NO_JOB
            self._run_posts(posts)
            busy = self._poll() or busy
            self._flush()
            wait = MIN_WAIT_S if busy else min(wait * 2, MAX_WAIT_S)
        self._cancel(lambda _t: True, lambda _t: Unavailable("the broker is stopping"))
        watches, self._watches = self._watches, []
        for _, then in watches:
            then(Unavailable("the broker is stopping"))
        self._flush()

    def _run_posts(self, posts: FairQueue[_PostJob | _Launch]) -> None:
        while posts:
            self._run_job(posts.pop())

    def _run_job(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:
            log.exception("data_plane_job_failed")

    def _post(self, posting: Posting) -> None:
        start = time.monotonic()
        try:
            handle = posting.make(self._agent)
        except KvBrokerError as exc:
            self._emit(Settled(posting.token, XferState.ERR, None, exc, time.monotonic() - start))
            return
        except Exception as exc:  # a bug building the transfer: the room fails, the thread goes on
            log.exception("post_failed", remote=posting.remote_agent)
            error = NixlError(f"posting failed inside the broker: {exc!r}")
            self._emit(Settled(posting.token, XferState.ERR, None, error, time.monotonic() - start))
            return
        self._inflight.append(_InFlight(posting, handle, start))

    def _poll(self) -> bool:
        """One pass over device copies, transfers and notifications; True if anything happened."""
        self.passes += 1
        active = self._check_watches()
        if self._inflight:
            now = time.monotonic()
            still: list[_InFlight] = []
            for transfer in self._inflight:
                state = self._agent.check(transfer.handle)
                if state is XferState.PROC:
                    still.append(transfer)
                    continue
                active = True
                descs = self._agent.descriptor_count(transfer.handle)
                try:
                    self._agent.release_xfer(transfer.handle)
                except KvBrokerError as exc:
                    log.warning("transfer_release_failed", remote=transfer.posting.remote_agent, error=exc.message)
                self._emit(Settled(transfer.posting.token, state, descs, None, now - transfer.posted_at))
            self._inflight = still
            timeout = self._timeout_s

            def overdue(t: _InFlight) -> bool:
                return now - t.posted_at > timeout and t.posting.remote_agent not in self._held

            if any(overdue(t) for t in still):
                active = self._cancel(
                    overdue,
                    lambda t: TransferTimeout(
                        f"a NIXL write of {t.posting.nbytes} bytes to {t.posting.remote_agent or 'a peer'} did not "
                        f"finish in {timeout:g} s"
                    ),
                ) or active
        try:
            notices = self._agent.get_notifs()
        except KvBrokerError as exc:
            log.warning("notifications_unreadable", error=exc.message)
            notices = []
        if notices:
            active = True
            notices = _untaken(self.take_notice, notices) if self.take_notice is not None else notices
            if notices:
                self._emit(Notices(notices))
        return active

    def _check_watches(self) -> bool:
        """Tell each watched device copy that completed (in order); True if one did."""
        if not self._watches:
            return False
        watches, self._watches = self._watches, []
        still = []
        for done, then in watches:
            try:
                if not done():
                    still.append((done, then))
                    continue
                error: BaseException | None = None
            except Exception as exc:  # the copy's error, told to whoever waits for it
                error = exc
            try:
                then(error)
            except Exception:
                log.exception("device_copy_continuation_failed")
        self._watches = still + self._watches  # (those a continuation added go after)
        return len(still) < len(watches)

    def _cancel(self, match: Callable[[_InFlight], bool], why: Callable[[_InFlight], KvBrokerError]) -> bool:
        cancelled = False
        for transfer in [t for t in self._inflight if match(t)]:
            try:
                self._agent.release_xfer(transfer.handle)
            except KvBrokerError as exc:
                log.warning("transfer_cancel_failed", remote=transfer.posting.remote_agent, error=exc.message)
                continue
            self._inflight.remove(transfer)
            self._emit(Settled(transfer.posting.token, XferState.ERR, None, why(transfer), time.monotonic() - transfer.posted_at))
            cancelled = True
        return cancelled

    # -- events to the loop -------------------------------------------------
    def _emit(self, event: Event) -> None:
        self._events.append(event)

    def _flush(self) -> None:
        if not self._events:
            return
        with self._lock:
            pending = self._events
            self._events = []
            self._pending.extend(pending)
            schedule = not self._delivery_scheduled
            self._delivery_scheduled = True
        if schedule:
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop closed under us (process exit)
                pass

    def _deliver(self) -> None:
        with self._lock:
            batch = self._pending
            self._pending = []
            self._delivery_scheduled = False
        if batch:
            self._on_events(batch)


_NO_JOB: Any = object()


def _untaken(take: Callable[[str, bytes], bool], notices: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The notifications ``take`` did not take (one it raised on, a bug, goes to the loop)."""
    left = []
    for agent, payload in notices:
        try:
            if take(agent, payload):
                continue
        except Exception:
            log.exception("notice_not_taken", agent=agent)
        left.append((agent, payload))
    return left


def _noop() -> None:
    """A job that only wakes the thread."""

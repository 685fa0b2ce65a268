"""The broker's worker threads: blocking work that must not run on the control loop.

- ``copy``: staging gather and scatter (numpy or torch copies, which release
  the GIL while they copy);
- ``memory``: mapping engine buffers, unmapping them, allocating staging
  buffers;
- ``warm``: faulting engines' host memory in after their registration
  (``memory.populate``: about 0.7 s of CPU per GiB of fresh pages), at a
  lower CPU priority (nice ``WARM_NICE``): where the CPUs are busy it takes
  a tenth of a core's share beside the broker's other threads, and all of
  an idle one. Not idle priority (``SCHED_IDLE``): a fault that waits for a
  page this thread is filling would wait for it to get a CPU, which a busy
  host may not give it for seconds.

One thread each, so a long mapping never delays a scatter. NIXL calls do
not run here: they belong to the data-plane thread (``dataplane``).

Jobs are handed over on a queue, those asked for in one pass of the loop
together; the thread takes them in the order of their tickets
(``scheduling.FairQueue``: a scatter of an interactive room passes the
bulk rooms' copies queued before it; no ticket: first come, first served),
and their outcomes come back on the loop in batches (one ``call_soon_threadsafe`` for every outcome ready by then), not
through ``run_in_executor``: its ``concurrent.futures.Future`` (two
``threading.Condition`` each) and one wake-up of the loop per job were a
tenth of the control loop's time per packed part (py-spy, issue 28).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from kvbroker.broker.scheduling import FairQueue, Priority, Ticket
from kvbroker.broker.telemetry import QueueObserver, QueueStats

__all__ = ["IN_ORDER", "WARM_NICE", "LoopInbox", "Workers", "name_thread", "settle", "settle_later"]

log = structlog.get_logger(__name__)

T = TypeVar("T")

_PR_SET_NAME = 15
#: The nice value of the warming thread (the broker's others run at its own).
WARM_NICE = 10
#: A job without a ticket: STANDARD, one engine: the order of arrival.
IN_ORDER = Ticket(Priority.STANDARD, "", 0)
#: Within a batch of jobs, outcomes are told to the loop at least this often.
_TELL_AFTER_S = 200e-6


def name_thread(name: str) -> None:
    """Give the calling thread an OS-level name (``top -H``, ``/proc/PID/task/*/comm``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: names are cosmetic
        pass


def settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Resolve ``future`` with a worker's outcome (on the loop), unless its awaiter gave up."""
    if future.done():  # the awaiting task was cancelled (the broker is stopping)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def settle_later(future: asyncio.Future[Any]) -> Callable[[Any, BaseException | None], None]:
    """What a thread calls with an outcome, ``(result, error)``, to have ``future``
    settled with it on its loop."""
    loop = future.get_loop()

    def then(result: Any, error: BaseException | None) -> None:
        try:
            loop.call_soon_threadsafe(settle, future, result, error)
        except RuntimeError:  # the loop closed under us (process exit)
            pass

    return then


class LoopInbox:
    """What threads tell the control loop, in batches: any thread :meth:`put` s a
    call, and the loop runs every call put since its last batch in one callback
    (one ``call_soon_threadsafe`` per batch, not per call). ``loop``: that loop
    (set before any thread puts: the data plane sets its inbox's when it starts)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._calls: list[Callable[[], None]] = []
        self._scheduled = False
        #: Batches delivered (for tests: how often the loop was woken).
        self.batches = 0

    def put(self, call: Callable[[], None]) -> None:
        """Have the loop run ``call`` with the next batch (any thread)."""
        with self._lock:
            self._calls.append(call)
            if self._scheduled:
                return
            self._scheduled = True
        assert self.loop is not None, "a LoopInbox put into before its loop was set"
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop closed under us (process exit)
            pass

    def _deliver(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
            self._scheduled = False
        self.batches += 1
        for call in calls:
            try:
                call()
            except Exception:
                log.exception("loop_inbox_call_failed")


class _Job:
    """A job for a worker thread: the call and the future its outcome goes to
    (None: the call tells whoever needs it itself)."""

    __slots__ = ("fn", "future", "ticket")

    def __init__(self, fn: Callable[[], Any], future: asyncio.Future[Any] | None, ticket: Ticket) -> None:
        self.fn, self.future, self.ticket = fn, future, ticket


class _Worker:
    """One thread running jobs in the order of their tickets. Jobs asked for
    in one pass of the loop go to the thread together, and outcomes come
    back in batches: a notification that lands sixteen packed parts hands
    their scatters over once, where one hand-over each made the copy thread
    and the loop trade the GIL per part (issue 28)."""

    def __init__(self, name: str, os_name: str, observer: QueueObserver | None = None, nice: int = 0) -> None:
        self._nice = nice
        #: Jobs handed over, waiting for the thread (under ``_ready``).
        self._jobs: FairQueue[_Job] = FairQueue(observer=observer)
        self._ready = threading.Condition(threading.Lock())
        self._stopping = False
        #: Jobs asked for in this pass of the loop, handed over at its end (loop only).
        self._asked: list[_Job] = []
        self._lock = threading.Lock()
        self._done: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        #: A delivery of ``_done`` is scheduled on the loop (under the lock).
        self._telling = False
        self._os_name = os_name
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T], ticket: Ticket | None = None) -> asyncio.Future[T]:
        """Run ``fn`` on the thread; its outcome in the future (on the loop).
        ``ticket``: its place among the jobs waiting (None: STANDARD, in order)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._ask(_Job(fn, future, ticket or IN_ORDER))
        return future

    def run(self, fn: Callable[[], None], ticket: Ticket | None = None) -> None:
        """Run ``fn`` on the thread, which tells whoever needs its outcome itself:
        nothing comes back to the loop (an exception it lets out is logged). Any
        thread may call this (a lane's waiter hands the next copy on so)."""
        with self._ready:
            self._jobs.push(_Job(fn, None, ticket or IN_ORDER), ticket or IN_ORDER)
            self._ready.notify()

    def _ask(self, job: _Job) -> None:
        self._asked.append(job)
        if len(self._asked) == 1:
            asyncio.get_running_loop().call_soon(self._hand_over)

    def _hand_over(self) -> None:
        asked, self._asked = self._asked, []
        with self._ready:
            for job in asked:
                self._jobs.push(job, job.ticket)
            self._ready.notify()

    def _next(self) -> tuple[_Job | None, bool]:
        """The next job (None once stopping and nothing is left), and whether it is the last waiting now."""
        with self._ready:
            while not self._jobs and not self._stopping:
                self._ready.wait()
            if not self._jobs:
                return None, True
            job = self._jobs.pop()
            return job, not self._jobs

    def _run(self) -> None:
        name_thread(self._os_name)
        if self._nice:
            try:  # this thread only (a thread is a task to setpriority)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except OSError as exc:
                log.warning("worker_priority_unchanged", thread=self._os_name, nice=self._nice, error=str(exc))
        told = time.monotonic()
        while True:
            job, last = self._next()
            if job is None:
                return
            try:
                outcome: tuple[Any, BaseException | None] = (job.fn(), None)
            except BaseException as exc:  # handed to the awaiting task
                outcome = (None, exc)
            if job.future is None:
                if outcome[1] is not None:
                    log.error("worker_job_failed", thread=self._os_name, exc_info=outcome[1])
                if not last:
                    continue
            # Tell the loop when nothing else waits, or sooner where jobs
            # take long (a large host copy: its part goes on meanwhile).
            now = time.monotonic()
            with self._lock:
                if job.future is not None:
                    self._done.append((job.future, *outcome))
                tell = bool(self._done) and not self._telling and (last or now - told > _TELL_AFTER_S)
                self._telling = self._telling or tell
                loop = self._done[0][0].get_loop() if tell else None
            if loop is not None:
                told = now
                try:
                    loop.call_soon_threadsafe(self._deliver)
                except RuntimeError:  # the loop closed under us (process exit)
                    pass

    def _deliver(self) -> None:
        with self._lock:
            done, self._done = self._done, []
            self._telling = False
        for future, result, error in done:
            settle(future, result, error)

    def shutdown(self) -> None:
        """Finish the jobs queued so far, then stop."""
        if self._asked:
            self._hand_over()
        with self._ready:
            self._stopping = True
            self._ready.notify()
        self._thread.join()


class Workers:
    """The copy, memory and warming threads. Await their work from the control loop."""

    def __init__(self, queues: QueueStats | None = None) -> None:
        self._copy = _Worker("kvbroker-copy", "kvb-copy", queues.observer("copy") if queues is not None else None)
        self._memory = _Worker("kvbroker-memory", "kvb-memory")
        self._warm = _Worker("kvbroker-warm", "kvb-warm", nice=WARM_NICE)

    async def copy(self, fn: Callable[[], T], ticket: Ticket | None = None) -> T:
        """Run ``fn`` on the copy thread (``ticket``: its place among the copies waiting)."""
        return await self._copy.submit(fn, ticket)

    def copy_soon(self, fn: Callable[[], T], ticket: Ticket | None = None) -> asyncio.Future[T]:
        """Run ``fn`` on the copy thread; its outcome in the future (no task to await it)."""
        return self._copy.submit(fn, ticket)

    def copy_detached(self, fn: Callable[[], None], ticket: Ticket | None = None) -> None:
        """Run ``fn`` on the copy thread; nothing comes back to the loop (``fn``
        tells whoever needs its outcome). Any thread may call this."""
        self._copy.run(fn, ticket)

    async def memory(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the memory thread."""
        return await self._memory.submit(fn)

    async def warm(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the warming thread. Cancelled, the call still waits
        until ``fn`` has ended (what it touches may be unmapped once it returns)."""
        job = self._warm.submit(fn)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            while not job.done():
                try:
                    await asyncio.wait([job])
                except asyncio.CancelledError:  # cancelled again: the job still runs
                    continue
            raise

    def shutdown(self) -> None:
        """Finish queued work, then stop the threads."""
        self._copy.shutdown()
        self._memory.shutdown()
        self._warm.shutdown()

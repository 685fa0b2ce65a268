"""The broker's worker threads: blocking work that must not run on the control loop.

- ``copy``: staging gather and scatter (numpy or torch copies, which release
  the GIL while they copy);
- ``memory``: mapping engine buffers and faulting their pages in
  (``memory.populate``: gigabytes take seconds), unmapping them, allocating
  staging buffers.

One thread each, so a long mapping never delays a scatter. NIXL calls do
not run here: they belong to the data-plane thread (``dataplane``).

Jobs are handed over on a queue, those asked for in one pass of the loop
together, and their outcomes come back on the loop in batches (one ``call_soon_threadsafe`` for every outcome ready by then), not
through ``run_in_executor``: its ``concurrent.futures.Future`` (two
``threading.Condition`` each) and one wake-up of the loop per job were a
tenth of the control loop's time per packed part (py-spy, issue 28).
"""

from __future__ import annotations

import asyncio
import ctypes
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Workers", "name_thread", "settle"]

T = TypeVar("T")

_PR_SET_NAME = 15
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


class _Worker:
    """One thread running jobs in order. Jobs asked for in one pass of the
    loop go to the thread together, and outcomes come back in batches: a
    notification that lands sixteen packed parts hands their scatters over
    once, where one hand-over each made the copy thread and the loop trade
    the GIL per part (issue 28)."""

    def __init__(self, name: str, os_name: str) -> None:
        self._jobs: queue.SimpleQueue[list[tuple[Callable[[], Any], asyncio.Future[Any]]] | None] = queue.SimpleQueue()
        #: Jobs asked for in this pass of the loop, handed over at its end (loop only).
        self._asked: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self._lock = threading.Lock()
        self._done: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        #: A delivery of ``_done`` is scheduled on the loop (under the lock).
        self._telling = False
        self._os_name = os_name
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``fn`` on the thread; its outcome in the future (on the loop)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._asked.append((fn, future))
        if len(self._asked) == 1:
            loop.call_soon(self._hand_over)
        return future

    def _hand_over(self) -> None:
        asked, self._asked = self._asked, []
        self._jobs.put(asked)

    def _run(self) -> None:
        name_thread(self._os_name)
        while (batch := self._jobs.get()) is not None:
            told = time.monotonic()
            for i, (fn, future) in enumerate(batch):
                try:
                    outcome: tuple[Any, BaseException | None] = (fn(), None)
                except BaseException as exc:  # handed to the awaiting task
                    outcome = (None, exc)
                # Tell the loop at the end of the batch, or sooner where jobs
                # take long (a large host copy: its part goes on meanwhile).
                now = time.monotonic()
                with self._lock:
                    self._done.append((future, *outcome))
                    tell = not self._telling and (i == len(batch) - 1 or now - told > _TELL_AFTER_S)
                    self._telling = self._telling or tell
                if tell:
                    told = now
                    try:
                        future.get_loop().call_soon_threadsafe(self._deliver)
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
        self._jobs.put(None)
        self._thread.join()


class Workers:
    """The copy and memory threads. Await their work from the control loop."""

    def __init__(self) -> None:
        self._copy = _Worker("kvbroker-copy", "kvb-copy")
        self._memory = _Worker("kvbroker-memory", "kvb-memory")

    async def copy(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the copy thread."""
        return await self._copy.submit(fn)

    def copy_soon(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``fn`` on the copy thread; its outcome in the future (no task to await it)."""
        return self._copy.submit(fn)

    async def memory(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the memory thread."""
        return await self._memory.submit(fn)

    def shutdown(self) -> None:
        """Finish queued work, then stop both threads."""
        self._copy.shutdown()
        self._memory.shutdown()

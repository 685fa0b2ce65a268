"""The broker's worker threads: blocking work that must not run on the control loop.

- ``copy``: staging gather and scatter (numpy or torch copies, which release
  the GIL while they copy);
- ``memory``: mapping engine buffers and faulting their pages in
  (``memory.populate``: gigabytes take seconds), unmapping them, allocating
  staging buffers.

One thread each, so a long mapping never delays a scatter. NIXL calls do
not run here: they belong to the data-plane thread (``dataplane``).

A job is handed over on a queue and its outcome comes back on the loop in
batches (one ``call_soon_threadsafe`` for every outcome ready by then), not
through ``run_in_executor``: its ``concurrent.futures.Future`` (two
``threading.Condition`` each) and one wake-up of the loop per job were a
tenth of the control loop's time per packed part (py-spy, issue 28).
"""

from __future__ import annotations

import asyncio
import ctypes
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Workers", "name_thread", "settle"]

T = TypeVar("T")

_PR_SET_NAME = 15


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
    """One thread running jobs in order; outcomes go back to the loop in batches."""

    def __init__(self, name: str, os_name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        self._os_name = os_name
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[[], T]) -> T:
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._jobs.put((fn, future))
        return await future

    def _run(self) -> None:
        name_thread(self._os_name)
        while (item := self._jobs.get()) is not None:
            fn, future = item
            try:
                outcome: tuple[Any, BaseException | None] = (fn(), None)
            except BaseException as exc:  # handed to the awaiting task
                outcome = (None, exc)
            with self._lock:
                self._done.append((future, *outcome))
                first = len(self._done) == 1
            if first:
                try:
                    future.get_loop().call_soon_threadsafe(self._deliver)
                except RuntimeError:  # the loop closed under us (process exit)
                    pass

    def _deliver(self) -> None:
        with self._lock:
            done, self._done = self._done, []
        for future, result, error in done:
            settle(future, result, error)

    def shutdown(self) -> None:
        """Finish the jobs queued so far, then stop."""
        self._jobs.put(None)
        self._thread.join()


class Workers:
    """The copy and memory threads. Await their work from the control loop."""

    def __init__(self) -> None:
        self._copy = _Worker("kvbroker-copy", "kvb-copy")
        self._memory = _Worker("kvbroker-memory", "kvb-memory")

    async def copy(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the copy thread."""
        return await self._copy.run(fn)

    async def memory(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the memory thread."""
        return await self._memory.run(fn)

    def shutdown(self) -> None:
        """Finish queued work, then stop both threads."""
        self._copy.shutdown()
        self._memory.shutdown()

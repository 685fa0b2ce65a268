"""The broker's worker threads: blocking work that must not run on the control loop.

- ``copy``: staging gather and scatter (numpy or torch copies, which release
  the GIL while they copy);
- ``memory``: mapping engine buffers and faulting their pages in
  (``memory.populate``: gigabytes take seconds), unmapping them, allocating
  staging buffers.

One thread each, so a long mapping never delays a scatter. NIXL calls do
not run here: they belong to the data-plane thread (``dataplane``).
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["Workers", "name_thread"]

T = TypeVar("T")

_PR_SET_NAME = 15


def name_thread(name: str) -> None:
    """Give the calling thread an OS-level name (``top -H``, ``/proc/PID/task/*/comm``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: names are cosmetic
        pass


class Workers:
    """The copy and memory threads. Await their work from the control loop."""

    def __init__(self) -> None:
        self._copy = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvbroker-copy", initializer=name_thread, initargs=("kvb-copy",)
        )
        self._memory = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvbroker-memory", initializer=name_thread, initargs=("kvb-memory",)
        )

    async def copy(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the copy thread."""
        return await asyncio.get_running_loop().run_in_executor(self._copy, fn)

    async def memory(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the memory thread."""
        return await asyncio.get_running_loop().run_in_executor(self._memory, fn)

    def shutdown(self) -> None:
        """Finish queued work, then stop both threads."""
        self._copy.shutdown(wait=True)
        self._memory.shutdown(wait=True)

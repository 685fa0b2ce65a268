"""Stopping the broker's own asyncio tasks, for good; waiting for a grant with a deadline.

On Python 3.11, ``asyncio.wait_for`` swallows a cancellation that lands
just as what it awaits completes (CPython gh-86296, fixed in 3.12): a task
looping over ``wait_for`` (the etcd lease keeper, the fleet watch,
housekeeping) then runs on, and a stop that awaits it waits forever (a
broker that never exits on SIGTERM). :func:`cancel_and_wait` cancels
again until every task has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import structlog

__all__ = ["await_grant", "cancel_and_wait"]

T = TypeVar("T")

log = structlog.get_logger(__name__)

#: How long a cancelled task may take to end before it is cancelled again.
_AGAIN_AFTER_S = 1.0


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until each has ended (its outcome is dropped),
    cancelling again any that is still running after a second."""
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _done, pending = await asyncio.wait(pending, timeout=_AGAIN_AFTER_S)
        for task in pending:
            log.warning("task_ignored_cancel", task=task.get_name())
            task.cancel()


async def await_grant(
    future: asyncio.Future[T], timeout_seconds: float, *, give_up: Callable[[], None], undo: Callable[[T], None]
) -> T | None:
    """Wait for ``future``, which whoever grants a queued request resolves,
    for at most ``timeout_seconds``: its result, or None when the time ran
    out (``give_up`` has taken the request out of its queue). A caller
    cancelled meanwhile gives up too, or ``undo``es a grant that came just
    before. One timer and the future itself: ``asyncio.wait`` made a waiter,
    callbacks and a timeout per call, a few percent of the control loop per
    packed part (py-spy, issue 28). ``give_up`` must be idempotent."""
    expired = False

    def expire() -> None:
        nonlocal expired
        if not future.done():
            expired = True
            give_up()
            future.cancel()

    timer = asyncio.get_running_loop().call_later(timeout_seconds, expire)
    try:
        return await future
    except asyncio.CancelledError:
        if expired:
            return None
        if future.done() and not future.cancelled():
            undo(future.result())
        else:
            give_up()
        raise
    finally:
        timer.cancel()

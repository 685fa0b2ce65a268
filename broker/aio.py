"""Stopping the broker's own asyncio tasks, for good.

On Python 3.11, ``asyncio.wait_for`` swallows a cancellation that lands
just as what it awaits completes (CPython gh-86296, fixed in 3.12): a task
looping over ``wait_for`` (the etcd lease keeper, the fleet watch,
housekeeping) then runs on, and a stop that awaits it waits forever (a
broker that never exits on SIGTERM). :func:`cancel_and_wait` cancels
again until every task has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import structlog

__all__ = ["cancel_and_wait"]

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

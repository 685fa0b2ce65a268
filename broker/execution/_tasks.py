"""Background tasks with an owner: every task the broker spawns is tracked and
cancelled at shutdown, and a task that fails is logged, never lost."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

from kvbroker.broker.aio import cancel_and_wait

__all__ = ["TaskSet"]

log = structlog.get_logger(__name__)


class TaskSet:
    """Spawns and owns background tasks on the running loop."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def finish(self, timeout_seconds: float) -> None:
        """Wait for running tasks (up to the timeout), then cancel the rest."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_seconds)
        await self.cancel()

    async def cancel(self) -> None:
        await cancel_and_wait(list(self._tasks))

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("background_task_failed", task=task.get_name(), error=repr(exc), exc_info=exc)

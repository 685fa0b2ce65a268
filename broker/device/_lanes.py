"""Where the broker's copies run: the host lane and one lane per GPU.

A copy job (``_block_copies.gather``, ``_block_copies.scatter``,
``_block_copies.checksum``) is a function that queues copies and returns a
function that reads its result once they are done. Where it runs depends on
the slot it fills or empties:

- host memory (and the fake CUDA driver's "VRAM", which is host memory):
  on the copy thread (``workers``), which does the copies itself;
- a GPU: the copy thread launches the job's kernels on this broker's own
  CUDA stream for that device (they return at once) and records a CUDA
  event after them; the lane's waiter thread (``kvb-gpuN``) sleeps on the
  event (a blocking-sync event: no spinning) and then resolves the job on
  the control loop. Jobs on one lane run in stream order; the copy thread
  never waits for the GPU, so the gather of one part, the NIXL write of the
  part before it (on the data-plane thread) and a scatter overlap. There is
  no device-wide synchronize: the engine's own streams are never waited on.

What has not run on a GPU yet: the GPU lane (CI runs the host lane with
the same jobs on CPU tensors). See docs/architecture.md, "The device path".
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kvbroker.broker.dataplane import Workers, name_thread, settle
from kvbroker.broker.device._block_copies import VRAM, ArrayViews, Extent, torch_for_copies
from kvbroker.broker.scheduling import Ticket

__all__ = ["Job", "Lanes"]

T = TypeVar("T")

#: Queues a job's copies; returns what reads its result once they are done.
Job = Callable[[], Callable[[], T]]


class Lanes:
    """The host lane and the GPU lanes. Await from the control loop.

    A GPU's lane is opened (:meth:`open`) when the GPU's transfer buffers
    are made, at the first engine's registration there: torch's CUDA, the
    stream and the waiter thread come up on the memory thread, never on the
    control loop (initialising CUDA after NIXL and UCX took seconds: a stall
    of the loop near ``--peer-dead-after``).
    """

    def __init__(self, workers: Workers, views: ArrayViews) -> None:
        self._workers = workers
        self._views = views
        self._gpus: dict[int, asyncio.Future[_GpuLane]] = {}

    async def open(self, device: int) -> None:
        """Make GPU ``device``'s lane if it has none (on the memory thread);
        nothing where its memory is host memory (the fake CUDA driver's)."""
        if not self._views.on_host(Extent(0, 0, VRAM, device)):
            await self._lane(device)

    async def run(self, slot: Extent, job: Job[T], ticket: Ticket | None = None) -> T:
        """Run ``job`` on the lane of ``slot``'s memory; its result. ``ticket``:
        its place among the copies waiting for the copy thread."""
        return await self.submit(slot, job, ticket)

    def submit(self, slot: Extent, job: Job[T], ticket: Ticket | None = None) -> asyncio.Future[T]:
        """Run ``job`` on the lane of ``slot``'s memory; its result in the future
        (a callback's way to :meth:`run`: no task where the lane is up)."""
        if self._views.on_host(slot):
            return self._workers.copy_soon(lambda: job()(), ticket)
        made = self._gpus.get(slot.device)
        if made is not None and made.done() and not made.cancelled() and made.exception() is None:
            return made.result().submit(self._workers, job, ticket)
        return asyncio.ensure_future(self._run_opening(slot.device, job, ticket))

    async def _run_opening(self, device: int, job: Job[T], ticket: Ticket | None) -> T:
        lane = await self._lane(device)
        return await lane.submit(self._workers, job, ticket)

    async def _lane(self, device: int) -> _GpuLane:
        made = self._gpus.get(device)
        if made is None:
            # Normally made at registration (open); made here on the memory
            # thread all the same if a part comes first.
            made = self._gpus[device] = asyncio.ensure_future(self._workers.memory(lambda: _GpuLane(device)))
        try:
            return await asyncio.shield(made)
        except Exception:
            if self._gpus.get(device) is made:
                del self._gpus[device]  # the next part tries again
            raise

    def close(self) -> None:
        """Stop the waiter threads (after the jobs queued so far)."""
        for made in self._gpus.values():
            if made.done() and not made.cancelled() and made.exception() is None:
                made.result().close()
        self._gpus.clear()


class _GpuLane:
    """One CUDA stream of this broker's on one device, and its waiter thread."""

    def __init__(self, device: int) -> None:
        import torch

        torch_for_copies()  # (one intra-op thread)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # The device CRC's tables (and its Triton kernel, compiled and checked
        # against zlib): here, at registration, not in the first checksum.
        from kvbroker.broker.device._devcrc import prepare

        with torch.cuda.device(device):
            prepare(torch.device("cuda", device))
        self._waiting: queue.SimpleQueue[tuple[Any, Callable[[], Any], asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._wait, name=f"kvbroker-gpu{device}", daemon=True)
        self._thread.start()

    def submit(self, workers: Workers, job: Job[T], ticket: Ticket | None = None) -> asyncio.Future[T]:
        """Launch ``job`` from the copy thread (in its ``ticket``'s turn); its
        result, once the waiter saw its event, in the future."""
        import torch

        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def launch() -> None:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                finish = job()
                event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
                event.record(self.stream)
            self._waiting.put((event, finish, future))

        def launched(done: asyncio.Future[None]) -> None:
            # A launch that raised never reaches the waiter: its error is the job's.
            if not future.done():
                if done.cancelled():
                    future.cancel()
                elif (error := done.exception()) is not None:
                    future.set_exception(error)

        workers.copy_soon(launch, ticket).add_done_callback(launched)
        return future

    def _wait(self) -> None:
        import torch

        name_thread(f"kvb-gpu{self.device}")
        while (item := self._waiting.get()) is not None:
            event, finish, future = item
            loop = future.get_loop()
            try:
                event.synchronize()
                with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                    result = finish()
                outcome: tuple[Any, BaseException | None] = (result, None)
            except BaseException as exc:  # handed to the awaiting task
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(settle, future, *outcome)
            except RuntimeError:  # the loop closed under us (process exit)
                pass

    def close(self) -> None:
        self._waiting.put(None)
        self._thread.join(timeout=10)


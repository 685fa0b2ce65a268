"""Where the broker's copies run: the host lane and one lane per GPU.

A copy job (``_block_copies.gather``, ``_block_copies.scatter``,
``_block_copies.checksum``) is a function that queues copies and returns a
function that reads its result once they are done. Where it runs depends on
the slot it fills or empties:

- host memory (and the fake CUDA driver's "VRAM", which is host memory):
  on the copy thread (``workers``), which does the copies itself;
- a GPU: the data-plane thread (``kvb-nixl``) launches the job's kernels on
  this broker's own CUDA stream for that device (they return at once),
  records a CUDA event after them, and checks the event in each of its
  passes (``cudaEventQuery``: no waiting, no other thread); the job's
  continuation runs there as soon as it completed, so a gather's completion
  posts its write, and a scatter's returns its credit, in the same pass, and
  the control loop hears only outcomes. Jobs on one lane run in stream
  order; nothing waits for the GPU, so the gather of one part, the NIXL
  write of the part before it and a scatter overlap. There is no
  device-wide synchronize: the engine's own streams are never waited on.

How a GPU lane launches and checks is a :class:`Streams`: CUDA's through
torch (:class:`CudaStreams`, the default), or a model of a GPU's timing
(``kvbroker.testing.gpu_model``, tests and benchmarks only): the jobs'
copies then run at once, on CPU tensors, and their events complete when the
model says. Each job says what it moves (:class:`Work`), which the model
times.

What has not run on a GPU yet: the GPU lane's launches and event checks on
the data-plane thread (CI runs the host lane with the same jobs on CPU
tensors, and the GPU lane on a modelled GPU). See docs/architecture.md,
"The device path".
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import structlog

from kvbroker.broker.dataplane import DataPlane, Workers, settle_later
from kvbroker.broker.device._block_copies import VRAM, ArrayViews, Extent, torch_for_copies
from kvbroker.broker.scheduling import Ticket

log = structlog.get_logger(__name__)

__all__ = ["CudaStreams", "Job", "Lanes", "Streams", "Work"]

T = TypeVar("T")

#: Queues a job's copies; returns what reads its result once they are done.
Job = Callable[[], Callable[[], T]]
#: Told a job's outcome on the lane's own thread: (result, None) or (None, error).
Then = Callable[[Any, BaseException | None], None]


@dataclass(frozen=True)
class Work:
    """What one job moves on its lane: ``op`` ("gather", "scatter",
    "checksum") over ``nbytes`` of slots."""

    op: str
    nbytes: int


#: A job of no stated size (a model times it as a launch alone).
NO_WORK = Work("copy", 0)


class Streams(Protocol):
    """How a GPU lane launches jobs and waits for them: CUDA's streams and
    events (:class:`CudaStreams`), or a model of a GPU's timing."""

    def open(self, device: int) -> Any:
        """A stream of this broker's on ``device``, the device made ready
        (on the memory thread, at the first engine's registration there)."""

    def launch(self, stream: Any, job: Job[T], work: Work) -> tuple[Callable[[], T], Any]:
        """Queue ``job``'s copies on ``stream`` (on the data-plane thread) and
        record an event after them: what reads the job's result, and the event."""

    def query(self, stream: Any, event: Any) -> bool:
        """Whether ``event`` completed (without waiting)."""

    def finish(self, stream: Any, read: Callable[[], T]) -> T:
        """Read a job's result once its event completed."""


class CudaStreams:
    """CUDA's streams and blocking-sync events, through torch."""

    def open(self, device: int) -> Any:
        import torch

        torch_for_copies()  # (one intra-op thread)
        stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # The device CRC's tables (and its Triton kernel, compiled and checked
        # against zlib): here, at registration, not in the first checksum.
        from kvbroker.broker.device._devcrc import prepare

        with torch.cuda.device(device):
            prepare(torch.device("cuda", device))
        return stream

    def launch(self, stream: Any, job: Job[T], work: Work) -> tuple[Callable[[], T], Any]:
        import torch

        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            read = job()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return read, event

    def query(self, stream: Any, event: Any) -> bool:
        return bool(event.query())

    def finish(self, stream: Any, read: Callable[[], T]) -> T:
        import torch

        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            return read()


class Lanes:
    """The host lane and the GPU lanes. Await from the control loop.

    A GPU's lane is opened (:meth:`open`) when the GPU's transfer buffers
    are made, at the first engine's registration there: torch's CUDA, the
    stream and the waiter thread come up on the memory thread, never on the
    control loop (initialising CUDA after NIXL and UCX took seconds: a stall
    of the loop near ``--peer-dead-after``).
    """

    def __init__(self, workers: Workers, views: ArrayViews, dataplane: DataPlane, streams: Streams | None) -> None:
        self._workers = workers
        self._views = views
        #: Where GPU lanes launch their copies and check their events.
        self._dataplane = dataplane
        #: How GPU lanes launch and wait (None: CUDA's; given: a model of a GPU,
        #: whose lanes then serve the fake CUDA driver's "VRAM" too).
        self._streams = streams
        self._gpus: dict[int, asyncio.Future[_GpuLane]] = {}

    def _on_host(self, slot: Extent) -> bool:
        """Whether ``slot``'s jobs run on the copy thread (host memory, or the fake
        driver's "VRAM" without a modelled GPU)."""
        return slot.kind != VRAM or (self._streams is None and self._views.on_host(slot))

    async def open(self, device: int) -> None:
        """Make GPU ``device``'s lane if it has none (on the memory thread);
        nothing where its memory is host memory (the fake CUDA driver's)."""
        if not self._on_host(Extent(0, 0, VRAM, device)):
            await self._lane(device)

    async def run(self, slot: Extent, job: Job[T], ticket: Ticket | None = None, work: Work = NO_WORK) -> T:
        """Run ``job`` on the lane of ``slot``'s memory; its result. ``ticket``:
        its place among the copies waiting; ``work``: what it moves."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self.launch(slot, job, settle_later(future), ticket, work)
        return await future

    def launch(
        self, slot: Extent, job: Job[T], then: Then, ticket: Ticket | None = None, work: Work = NO_WORK,
        started: Callable[[], None] = lambda: None,
    ) -> None:
        """Run ``job`` on the lane of ``slot``'s memory, and tell ``then`` its outcome
        on the lane's own thread (the copy thread for host memory, the data-plane
        thread for a GPU) as soon as it is done: nothing comes back to the loop, so
        what follows a copy (a write, a credit's return) can go at once. (A GPU
        whose lane is not open yet is opened first, from the loop.) ``started``
        hears, on that thread, when the job is launched."""
        if self._on_host(slot):

            def run() -> None:
                started()
                _tell(then, lambda: job()())

            self._workers.copy_detached(run, ticket)
            return
        made = self._gpus.get(slot.device)
        if made is not None and made.done() and not made.cancelled() and made.exception() is None:
            made.result().launch(self._workers, job, then, ticket, work, started)
            return

        async def opening() -> None:
            try:
                lane = await self._lane(slot.device)
            except Exception as exc:
                then(None, exc)
                return
            lane.launch(self._workers, job, then, ticket, work, started)

        asyncio.ensure_future(opening())

    async def _lane(self, device: int) -> _GpuLane:
        made = self._gpus.get(device)
        if made is None:
            # Normally made at registration (open); made here on the memory
            # thread all the same if a part comes first.
            streams, dataplane = self._streams or CudaStreams(), self._dataplane
            made = self._gpus[device] = asyncio.ensure_future(self._workers.memory(lambda: _GpuLane(device, streams, dataplane)))
        try:
            return await asyncio.shield(made)
        except Exception:
            if self._gpus.get(device) is made:
                del self._gpus[device]  # the next part tries again
            raise

    def close(self) -> None:
        """Forget the GPU lanes (their streams go with the process)."""
        self._gpus.clear()


class _GpuLane:
    """One CUDA stream of this broker's on one device; its jobs are launched, and
    their events checked, on the data-plane thread."""

    def __init__(self, device: int, streams: Streams, dataplane: DataPlane) -> None:
        self.device = device
        self._streams = streams
        self._dataplane = dataplane
        self.stream = streams.open(device)

    def launch(
        self, workers: Workers, job: Job[T], then: Then, ticket: Ticket | None = None, work: Work = NO_WORK,
        started: Callable[[], None] = lambda: None,
    ) -> None:
        """Launch ``job`` on the data-plane thread (in its ``ticket``'s turn among
        the posts and launches queued with it); ``then`` hears its outcome there,
        in the pass that sees its event complete (or at once, if the launch raised)."""
        streams, stream = self._streams, self.stream

        def launch() -> None:
            started()
            try:
                read, event = streams.launch(stream, job, work)
            except BaseException as exc:  # the job's error: there is nothing to watch
                then(None, exc)
                return

            def completed(error: BaseException | None) -> None:
                if error is not None:
                    then(None, error)
                else:
                    _tell(then, functools.partial(streams.finish, stream, read))

            self._dataplane.watch(functools.partial(streams.query, stream, event), completed)

        self._dataplane.launch(launch, ticket)


def _tell(then: Then, work: Callable[[], Any]) -> None:
    """Run ``work`` and tell ``then`` how it went (an error in ``then`` itself is logged)."""
    try:
        result = work()
    except BaseException as exc:  # the job's error, told to whoever waits for it
        outcome: tuple[Any, BaseException | None] = (None, exc)
    else:
        outcome = (result, None)
    try:
        then(*outcome)
    except Exception:
        log.exception("lane_continuation_failed")

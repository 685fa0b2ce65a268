"""Registered engine ranks: their buffers, layouts and local descriptor lists.

Registration maps every buffer (on the memory thread). Host buffers are
registered with NIXL and get one local descriptor list (on the data-plane
thread, docs/design.md section 10); that is all a registration waits for.
Then the engine's host memory is faulted in, in the background
(:meth:`EngineTable._warm`, on the warming thread at a lower priority;
about 0.7 s of CPU per gigabyte of fresh pages), so its transfers after
the first seconds pay no page faults; an engine whose memory the host
cannot back is reported to ``on_unbacked`` (the runtime unregisters it and
fails its rooms). VRAM buffers never are: the broker maps
them only for its own copy kernels, and what lies in them moves through its
transfer buffers (the device path, ``packing``). Unregistration releases
everything in reverse order, the same way.
The control loop only awaits: other engines' rooms go on meanwhile. Room
bookkeeping lives elsewhere (``rooms``); the runtime fails an engine's
rooms before it releases the engine.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from kvbroker import cudavmm
from kvbroker.broker.aio import cancel_and_wait
from kvbroker.broker.dataplane import Agent, Workers
from kvbroker.broker.memory._importers import ImportedBuffer, importer_for, populate
from kvbroker.errors import (
    AlreadyExists,
    FailedPrecondition,
    KvBrokerError,
    NotFound,
)
from kvbroker.plan import (
    BufferPlacement,
    DescriptorTable,
    Layout,
    RankKey,
    RoomTimeouts,
    build_descriptor_table,
    rank_key,
)
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["Engine", "EngineTable"]

if TYPE_CHECKING:
    from kvbroker.broker.dataplane import DataPlane

log = structlog.get_logger(__name__)

#: Bytes of an engine's host memory faulted in per warming job (``populate``,
#: about 0.7 s/GiB of CPU for fresh pages): about 20 ms each on an idle core,
#: which is as long as an engine let go meanwhile waits to be unmapped.
_WARM_JOB_BYTES = 32 << 20


@dataclass
class Engine:
    """One registered engine rank. Owned by :class:`EngineTable`."""

    engine_id: str
    key: RankKey
    layout: Layout
    layout_proto: common_pb2.EngineLayout
    buffers: list[ImportedBuffer]
    table: DescriptorTable
    session_token: str
    pid: int
    generation: int
    #: NIXL registrations of its host buffers (VRAM never is registered).
    registrations: list[Any] = field(default_factory=list)
    #: The local prepared descriptor list of its host memory (by memory kind: DRAM only).
    dlists: dict[int, Any] = field(default_factory=dict)
    registered_at: float = field(default_factory=time.monotonic)
    #: The last session command applied (``SessionCommand.seq``).
    applied: int = 0
    #: The engine's live Session stream, if any (``sessions.SessionStream``).
    session: Any = None
    #: Its own timeouts for its rooms (unset: the broker's flags).
    timeouts: RoomTimeouts = field(default_factory=RoomTimeouts)
    #: Faulting its host memory in, after registration (None: done, or nothing to do).
    warming: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def role(self) -> int:
        return self.layout.role

    @property
    def label(self) -> str:
        """Public name of this registration (the engine_id is the session's secret)."""
        return f"{self.key}#{self.generation}"

    @property
    def registered_bytes(self) -> int:
        return sum(b.size_bytes for b in self.buffers)

    def region_address(self, index: int) -> tuple[int, int, int, int]:
        """(address, bytes, memory kind, device) of region ``index`` in this broker."""
        region = self.layout.regions[index]
        buf = self.buffers[region.buffer]
        return buf.address + region.offset_bytes, region.length_bytes, buf.kind, buf.device_id

    def descriptor(self) -> peer_pb2.EngineDescriptor:
        """How peers see this rank (handshake)."""
        return peer_pb2.EngineDescriptor(
            rank=self.key.to_proto(),
            layout=self.layout_proto,
            buffers=[
                peer_pb2.RemoteBuffer(address=b.address, size_bytes=b.size_bytes, kind=b.kind, device_id=b.device_id)  # type: ignore[arg-type]
                for b in self.buffers
            ],
            generation=self.generation,
        )


class EngineTable:
    """Engines of this broker, by id and by rank. Control loop only."""

    def __init__(self, dataplane: DataPlane, workers: Workers, cuda_driver: cudavmm.Driver | None) -> None:
        self._dataplane = dataplane
        self._workers = workers
        #: The CUDA driver VRAM imports use (None: libcuda.so.1, loaded on first use).
        self.cuda_driver = cuda_driver
        self.by_id: dict[str, Engine] = {}
        self.by_key: dict[RankKey, Engine] = {}
        #: Ranks whose registration is under way.
        self._pending: set[RankKey] = set()
        #: Bumped on every registration change; peers are re-handshaken when
        #: the epoch they saw is older.
        self.epoch = 0
        self._generations = itertools.count(1)
        #: Called after every registration change (the etcd record follows).
        self.on_change: list[Callable[[], None]] = []
        #: Called with an engine, and why, whose host memory cannot be backed.
        self.on_unbacked: list[Callable[[Engine, str], None]] = []

    def get(self, engine_id: str) -> Engine:
        """The engine with ``engine_id``; ``NotFound`` otherwise."""
        try:
            return self.by_id[engine_id]
        except KeyError:
            raise NotFound(f"engine {engine_id!r} is not registered with this broker") from None

    async def register(
        self,
        *,
        rank: common_pb2.EngineRankId,
        layout_msg: common_pb2.EngineLayout,
        specs: list[common_pb2.BufferSpec],
        fds: list[int],
        session_token: str,
        pid: int,
        timeouts: RoomTimeouts | None = None,
        before_publish: Callable[[DescriptorTable], Awaitable[None]] | None = None,
    ) -> Engine:
        """Map, register and prepare an engine rank's buffers.

        ``before_publish`` is awaited with the rank's descriptor table once
        its buffers are ready and before the rank is listed (and the epoch
        bumped): what peers must learn together with the rank (its GPUs'
        transfer buffers) is made there, so a handshake never announces the
        rank without it. An exception there fails the registration.

        Takes ownership of ``fds`` (one per spec, -1 where the spec names a
        CUDA IPC handle; closed on failure). Raises
        ``AlreadyExists`` for a registered rank and ``InvalidArgument`` for a
        bad layout; nothing stays registered after a failure. The log line
        ``engine_registered`` gives the time of each step.
        """
        key = rank_key(rank)
        buffers: list[ImportedBuffer] = []
        registrations: list[Any] = []
        dlists: dict[int, Any] = {}
        pending = list(fds)
        started = time.monotonic()
        timings: dict[str, float] = {}
        if key in self.by_key or key in self._pending:
            for fd in pending:
                if fd >= 0:
                    os.close(fd)
            holder = f"engine {self.by_key[key].engine_id}" if key in self.by_key else "a registration is under way"
            raise AlreadyExists(f"engine rank {key} is already registered ({holder})")
        self._pending.add(key)
        try:
            layout = Layout.from_proto(layout_msg, rank=key, buffer_sizes=[s.size_bytes for s in specs])
            driver = self.cuda_driver

            def import_all() -> None:
                while pending:
                    fd = pending.pop(0)
                    spec = specs[len(buffers)]
                    buffers.append(importer_for(spec.kind, driver).import_buffer(fd, spec))

            step = time.monotonic()
            await self._workers.memory(import_all)
            timings["import_s"] = time.monotonic() - step
            table = build_descriptor_table(
                layout,
                [BufferPlacement(b.address, b.size_bytes, b.kind, b.device_id) for b in buffers],
            )

            def register_all(agent: Agent) -> None:
                for buf in buffers:
                    if buf.kind == common_pb2.MEMORY_KIND_DRAM:
                        registrations.append(agent.register(buf.address, buf.size_bytes, buf.kind, buf.device_id))

            def prepare_all(agent: Agent) -> None:
                if common_pb2.MEMORY_KIND_DRAM in table.rows:
                    kind = common_pb2.MEMORY_KIND_DRAM
                    dlists[kind] = agent.prep_dlist(None, table.rows[kind], kind)

            step = time.monotonic()
            await self._dataplane.call(register_all)
            timings["register_s"] = time.monotonic() - step
            step = time.monotonic()
            await self._dataplane.call(prepare_all)
            timings["prepare_s"] = time.monotonic() - step
            if before_publish is not None:
                step = time.monotonic()
                await before_publish(table)
                timings["devices_s"] = time.monotonic() - step
        except BaseException:
            self._pending.discard(key)
            await self._release_resources(dlists, registrations, buffers)
            for fd in pending:
                if fd >= 0:
                    os.close(fd)
            raise
        self._pending.discard(key)
        engine = Engine(
            # The engine_id is the capability of the session that registered:
            # unguessable, never listed, required by every room call.
            engine_id=f"eng-{secrets.token_hex(16)}",
            key=key,
            layout=layout,
            layout_proto=layout_msg,
            buffers=buffers,
            table=table,
            session_token=session_token,
            pid=pid,
            generation=next(self._generations),
            registrations=registrations,
            dlists=dlists,
            timeouts=timeouts or RoomTimeouts(),
        )
        self.by_id[engine.engine_id] = engine
        self.by_key[key] = engine
        self.epoch += 1
        for notify in self.on_change:
            notify()
        if any(b.kind == common_pb2.MEMORY_KIND_DRAM for b in buffers):
            engine.warming = asyncio.get_running_loop().create_task(self._warm(engine), name=f"warm-{engine.label}")
        log.info(
            "engine_registered",
            engine=engine.label,
            rank=str(key),
            role=common_pb2.Role.Name(layout.role),
            buffers=len(buffers),
            bytes=engine.registered_bytes,
            regions=len(layout.regions),
            **{k: v for k, v in asdict(engine.timeouts).items() if v is not None},
            total_s=round(time.monotonic() - started, 6),
            **{k: round(v, 6) for k, v in timings.items()},
        )
        return engine

    async def _warm(self, engine: Engine) -> None:
        """Fault in ``engine``'s host buffers on the warming thread
        (``Workers.warm``, nice ``WARM_NICE``), ``_WARM_JOB_BYTES`` a job
        (``populate``: the file's pages allocated, then each mapped). It runs
        in the broker's own process, at a lower priority but never an idle
        one: a helper process at ``SCHED_IDLE`` did the zeroing before, and a
        busy host gave it no CPU while transfers ran, so they faulted every
        page themselves for seconds, at a fifth of their speed (issue 41).
        Stopped by :meth:`release`, which unmaps once the job that runs has
        ended."""
        started = time.monotonic()
        for buf in engine.buffers:
            if buf.kind != common_pb2.MEMORY_KIND_DRAM:
                continue
            for offset in range(0, buf.size_bytes, _WARM_JOB_BYTES):
                length = min(_WARM_JOB_BYTES, buf.size_bytes - offset)
                try:
                    await self._workers.warm(functools.partial(populate, buf.address + offset, length, buf.fd, offset))
                except OSError as exc:
                    why = f"this host cannot back its {buf.size_bytes}-byte buffer with memory ({exc.strerror})"
                    log.error("engine_memory_unbacked", engine=engine.label, error=why)
                    engine.warming = None
                    for notify in self.on_unbacked:
                        notify(engine, why)
                    return
        log.info(
            "engine_memory_warmed",
            engine=engine.label,
            bytes=engine.registered_bytes,
            warm_s=round(time.monotonic() - started, 6),
        )
        engine.warming = None

    async def release(self, engine: Engine) -> None:
        """Forget ``engine`` and release its NIXL resources and mappings (reverse order)."""
        if self.by_id.pop(engine.engine_id, None) is None:
            return
        del self.by_key[engine.key]
        self.epoch += 1
        for notify in self.on_change:
            notify()
        if engine.warming is not None:
            await cancel_and_wait([engine.warming])
            engine.warming = None
        await self._release_resources(engine.dlists, engine.registrations, engine.buffers)
        log.info("engine_released", engine=engine.label, rank=str(engine.key))

    async def _release_resources(self, dlists: dict[int, Any], registrations: list[Any], buffers: list[ImportedBuffer]) -> None:
        """Release descriptor lists and registrations (data plane), then mappings (memory thread)."""
        errors: list[KvBrokerError] = []

        def deregister_all(agent: Agent) -> None:
            for dlist in dlists.values():
                agent.release_dlist(dlist)
            for reg in reversed(registrations):
                try:
                    agent.deregister(reg)
                except KvBrokerError as exc:
                    errors.append(exc)

        if dlists or registrations:
            await self._dataplane.call(deregister_all)
        dlists.clear()
        registrations.clear()
        if buffers:
            def unmap_all() -> None:
                for buf in buffers:
                    buf.release()

            await self._workers.memory(unmap_all)
        if errors:
            raise errors[0]

    def check_role(self, engine: Engine, role: int, action: str) -> None:
        """``FailedPrecondition`` unless ``engine`` has ``role`` (a ROLE_BOTH engine has either)."""
        if engine.role not in (role, common_pb2.ROLE_BOTH):
            raise FailedPrecondition(
                f"engine {engine.engine_id} ({common_pb2.Role.Name(engine.role)}) cannot {action}; "
                f"that needs a {common_pb2.Role.Name(role)} engine"
            )

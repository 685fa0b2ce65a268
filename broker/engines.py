"""Registered engine ranks: their buffers, layouts and local descriptor lists.

Registration maps every buffer, registers it with NIXL and prepares one local
descriptor list per memory kind (DESIGN.md section 10); unregistration
releases them in reverse order. Room bookkeeping lives elsewhere
(``rooms``); the runtime fails an engine's rooms before it releases the engine.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from kvbroker import cudavmm
from kvbroker.broker.descriptors import BufferPlacement, DescriptorTable, build_descriptor_table
from kvbroker.broker.layout import Layout, RankKey, rank_key
from kvbroker.broker.memory import ImportedBuffer, array_at, importer_for
from kvbroker.broker.nixl_agent import Agent
from kvbroker.errors import (
    AlreadyExists,
    FailedPrecondition,
    KvBrokerError,
    NotFound,
    Unimplemented,
)
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["Engine", "EngineTable"]

log = structlog.get_logger(__name__)


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
    registrations: list[Any] = field(default_factory=list)
    #: Local prepared descriptor list per memory kind.
    dlists: dict[int, Any] = field(default_factory=dict)
    registered_at: float = field(default_factory=time.monotonic)

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

    def region_array(self, index: int) -> npt.NDArray[np.uint8]:
        """Region ``index`` as a ``[items, item_bytes]`` uint8 view of the broker's mapping.

        For the broker's own copies (staging gather/scatter). Host memory only.
        """
        region = self.layout.regions[index]
        buf = self.buffers[region.buffer]
        if buf.kind != common_pb2.MEMORY_KIND_DRAM:
            raise Unimplemented(
                "staging copies of VRAM regions are not built (a sender stages only host memory; VRAM head slices "
                "go as per-token descriptors)"
            )
        return array_at(buf.address + region.offset_bytes, region.length_bytes).reshape(region.items, region.item_bytes)

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
    """Engines of this broker, by id and by rank. Event-loop thread only."""

    def __init__(self, agent: Agent, cuda_driver: cudavmm.Driver | None = None) -> None:
        self._agent = agent
        #: The CUDA driver VRAM imports use (None: libcuda.so.1, loaded on first use).
        self.cuda_driver = cuda_driver
        self.by_id: dict[str, Engine] = {}
        self.by_key: dict[RankKey, Engine] = {}
        #: Bumped on every registration change; peers are re-handshaken when
        #: the epoch they saw is older.
        self.epoch = 0
        self._generations = itertools.count(1)

    def get(self, engine_id: str) -> Engine:
        """The engine with ``engine_id``; ``NotFound`` otherwise."""
        try:
            return self.by_id[engine_id]
        except KeyError:
            raise NotFound(f"engine {engine_id!r} is not registered with this broker") from None

    def register(
        self,
        *,
        rank: common_pb2.EngineRankId,
        layout_msg: common_pb2.EngineLayout,
        specs: list[common_pb2.BufferSpec],
        fds: list[int],
        session_token: str,
        pid: int,
    ) -> Engine:
        """Map, register and prepare an engine rank's buffers.

        Takes ownership of ``fds`` (closed on failure). Raises
        ``AlreadyExists`` for a registered rank and ``InvalidArgument`` for a
        bad layout; nothing stays registered after a failure.
        """
        key = rank_key(rank)
        buffers: list[ImportedBuffer] = []
        registrations: list[Any] = []
        dlists: dict[int, Any] = {}
        pending = list(fds)
        try:
            if key in self.by_key:
                raise AlreadyExists(f"engine rank {key} is already registered (engine {self.by_key[key].engine_id})")
            layout = Layout.from_proto(layout_msg, rank=key, buffer_sizes=[s.size_bytes for s in specs])
            while pending:
                fd = pending.pop(0)
                spec = specs[len(buffers)]
                buffers.append(importer_for(spec.kind, self.cuda_driver).import_buffer(fd, spec))
            for buf in buffers:
                registrations.append(self._agent.register(buf.address, buf.size_bytes, buf.kind, buf.device_id))
            table = build_descriptor_table(
                layout,
                [BufferPlacement(b.address, b.size_bytes, b.kind, b.device_id) for b in buffers],
            )
            for kind, descs in table.descs.items():
                dlists[kind] = self._agent.prep_dlist(None, descs, kind)
        except BaseException:
            for dlist in dlists.values():
                self._agent.release_dlist(dlist)
            for reg in reversed(registrations):
                self._agent.deregister(reg)
            for buf in buffers:
                buf.release()
            for fd in pending:
                os.close(fd)
            raise
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
        )
        self.by_id[engine.engine_id] = engine
        self.by_key[key] = engine
        self.epoch += 1
        log.info(
            "engine_registered",
            engine=engine.label,
            rank=str(key),
            role=common_pb2.Role.Name(layout.role),
            buffers=len(buffers),
            bytes=engine.registered_bytes,
            regions=len(layout.regions),
        )
        return engine

    def release(self, engine: Engine) -> None:
        """Forget ``engine`` and release its NIXL resources and mappings (reverse order)."""
        if self.by_id.pop(engine.engine_id, None) is None:
            return
        del self.by_key[engine.key]
        self.epoch += 1
        errors: list[KvBrokerError] = []
        for dlist in engine.dlists.values():
            self._agent.release_dlist(dlist)
        for reg in reversed(engine.registrations):
            try:
                self._agent.deregister(reg)
            except KvBrokerError as exc:
                errors.append(exc)
        for buf in engine.buffers:
            buf.release()
        engine.dlists.clear()
        engine.registrations.clear()
        log.info("engine_released", engine=engine.label, rank=str(engine.key))
        if errors:
            raise errors[0]

    def check_role(self, engine: Engine, role: int, action: str) -> None:
        """``FailedPrecondition`` unless ``engine`` has ``role``."""
        if engine.role != role:
            raise FailedPrecondition(
                f"engine {engine.engine_id} ({common_pb2.Role.Name(engine.role)}) cannot {action}; "
                f"that needs a {common_pb2.Role.Name(role)} engine"
            )

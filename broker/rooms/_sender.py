"""The sender side of rooms, as a state machine without I/O.

A **source** is one prefill engine rank's side of one room. Its life:

1. ``begin`` (BeginSend) opens it; it is BOOTSTRAPPING until every receiver
   rank it serves has registered the room here (their transfer infos,
   ``transfer_info``, may come before or after BeginSend), then
   WAITING_FOR_INPUT (``_send_bootstrap``).
2. ``chunk`` (SendChunk) accepts chunks of source pages, validated against
   the engine's regions; the last one carries the aux row and state.
3. Every accepted chunk is posted to every registered destination, in chunk
   order (``_send_parts``): :func:`~kvbroker.plan.plan_chunk` splits it into
   parts (where it lands and what it carries: ``_send_chunks``), each a NIXL
   write with a ``TransferNotice`` (explicit completion, docs/design.md
   section 4). A staged part first reserves room at the receiver
   (``ReserveStaging`` -> ``staging_reserved``). The source counts its parts
   in flight until each settles (``part_settled``); TRANSFERRING meanwhile.
4. SUCCESS when every destination registered and every part through the
   last chunk settled DONE.
5. Failure (an abort from the engine, the operator or the receiver's broker;
   a NIXL error; a mismatch; a timeout; a lost peer or engine) keeps the
   first cause, stops posting, and tells each receiver's broker with a
   ``CompletionReport``; once no part of the source is in flight any more it
   says so (``settled``), so the receiver knows its pages are safe to reuse.

Transfer infos whose source never opens the room are answered too: when the
source's engine goes away (``engine_gone``) or after the orphan timeout
(``tick``), the receiver is told that source will never come, and that
receiver's info is never attached to that source again (its pages may have
been reused since).

Every method returns nothing but leaves effects (``_effects``) in the
outbox; :meth:`SenderCore.take` hands them to the executor. The records are
in ``_sender_records``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbroker.broker import telemetry
from kvbroker.broker.rooms._records import SenderRoom
from kvbroker.broker.rooms._send_bootstrap import SenderBootstrap
from kvbroker.broker.rooms._send_chunks import room_mismatch
from kvbroker.broker.rooms._sender_records import Chunk, Source
from kvbroker.broker.rooms._sides import FAILED, cause
from kvbroker.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvbroker.plan import IndexArray, check_chunk
from kvbroker.v1 import common_pb2

if TYPE_CHECKING:
    from kvbroker.broker.memory import Engine

__all__ = ["SenderCore"]


class SenderCore(SenderBootstrap):
    """Every source of this broker. No I/O: calls leave effects (:meth:`take`).

    Its state, ``fail`` and the parts in flight (``staging_reserved``,
    ``part_settled``) are :class:`~kvbroker.broker.rooms._send_parts.SenderParts`'s;
    ``begin``, ``transfer_info`` and ``abandon`` are
    :class:`~kvbroker.broker.rooms._send_bootstrap.SenderBootstrap`'s.
    """

    # -- engine calls ----------------------------------------------------
    def chunk(
        self,
        engine: Engine,
        room_id: int,
        pages: IndexArray,
        *,
        is_last: bool,
        aux_row: int | None,
        state: dict[str, IndexArray],
        room_page: int | None = None,
    ) -> tuple[int, Source]:
        """Accept one chunk (SendChunk) and post it to every known destination.

        Returns the chunk index and the source. A chunk for a FAILED source is
        accepted and dropped (the status says why); everything is validated
        before anything is recorded. ``room_page``: the room page the chunk
        starts at; only the first chunk may move it (incremental transfer).
        """
        room = self._rooms.sender.get(room_id)
        source = room.sources.get(engine.key) if room is not None else None
        if source is None:
            raise NotFound(f"room {room_id} is not open for sending on engine {engine.engine_id}; call BeginSend first")
        if source.last_received:
            raise FailedPrecondition(f"room {room_id} already received its last chunk")
        check_chunk(
            source.engine.layout,
            declared=source.num_pages,
            sent=source.cursor,
            pages=pages,
            is_last=is_last,
            aux_row=aux_row,
            state=state,
        )
        first = source.chunks == 0
        if room_page is not None and not first and room_page != source.first_page + source.cursor:
            raise InvalidArgument(
                f"room {room_id}: chunk {source.chunks} starts at room page {room_page}, but it follows on at "
                f"{source.first_page + source.cursor} (only the first chunk may say where it starts)"
            )
        if first and room_page:
            source.first_page = room_page
        if source.state == FAILED:
            # Accepted and dropped: keep counting, so the engine's later
            # chunks validate as they would have.
            source.cursor += int(pages.size)
            source.chunks += 1
            source.last_received = is_last
            return source.chunks - 1, source
        chunk = Chunk(
            index=len(source.chunk_list),
            pages=pages,
            page_offset=source.cursor,
            is_last=is_last,
            aux_row=aux_row,
            state=state,
        )
        source.chunk_list.append(chunk)
        source.cursor += int(pages.size)
        source.chunks += 1
        source.last_received = is_last
        if first:
            # Where the source starts is known now: check it against the receivers that registered.
            for dest in list(source.destinations.values()):
                problem = room_mismatch(source, dest.info) if dest.plan.writes_data else None
                if problem:
                    self.fail(source, cause(common_pb2.FAILURE_KIND_MISMATCH, problem, self._id))
                    return chunk.index, source
        self._pump_all(source)
        return chunk.index, source

    def abort(self, engine: Engine, room_id: int, reason: str, *, by: str = "engine") -> Source | None:
        """Fail the engine's side of the room and tell its receivers. Idempotent."""
        room = self._rooms.sender.get(room_id)
        source = room.sources.get(engine.key) if room is not None else None
        if source is not None:
            why = reason or "aborted by the sending engine"
            self.ensure_span(source)
            telemetry.child_done(source.span, "kvbroker.abort", {"kvbroker.reason": why, "kvbroker.by": by})
            self.fail(source, cause(common_pb2.FAILURE_KIND_ABORTED, why, self._id))
        return source

    def engine_gone(self, engine: Engine, why: common_pb2.FailureCause) -> int:
        """``engine`` unregistered or died: fail its sources, and tell receivers
        waiting for it in rooms it never opened that it never will. Returns the
        sources failed."""
        sources = [s for s in self._rooms.all_sources() if s.engine is engine]
        for source in sources:
            self.fail(source, why)
        self.abandon(engine.key, why)
        return sum(1 for s in sources if s.cause is why)

    # -- peer calls ------------------------------------------------------
    def peer_abort(self, room_id: int, why: common_pb2.FailureCause, from_broker: str | None = None) -> bool:
        """A receiver's broker aborted the room: fail every local source of it.

        The room is remembered as aborted (until evicted), so a source that
        opens it afterwards fails at once with the same cause instead of
        waiting for a transfer info that will never come. Returns whether no
        part of the room is in flight from here any more.
        """
        if self._rooms.is_tombstoned("sender", room_id):
            return True
        room = self._rooms.sender.get(room_id)
        if room is None:
            room = self._rooms.sender[room_id] = SenderRoom(room_id)
        elif from_broker is not None and room.infos and all(i.receiver_broker_id != from_broker for i in room.infos.values()):
            raise PermissionDenied(f"broker {from_broker} has no receiver in room {room_id} here")
        if room.aborted is None:
            room.aborted = why
        for source in room.sources.values():
            telemetry.child_done(source.span, "kvbroker.abort", {"kvbroker.reason": why.message, "kvbroker.by": from_broker or "peer"})
            if source.terminal:
                # Already finished or failed: still tell the receivers whether
                # anything of it can land, so their pages settle.
                for dest in source.destinations.values():
                    if dest.inflight == 0 and not dest.settle_reported:
                        self._report(source, dest)
            else:
                self.fail(source, why)
        return all(source.inflight == 0 for source in room.sources.values())

    def peer_lost(self, broker_id: str, why: common_pb2.FailureCause) -> int:
        """The receivers' broker ``broker_id`` is gone: fail every source serving it."""
        lost = [
            s
            for s in self._rooms.all_sources()
            if not s.terminal and any(d.info.receiver_broker_id == broker_id for d in s.destinations.values())
        ]
        for source in lost:
            self.fail(source, why)
        return len(lost)

    # -- timers ----------------------------------------------------------
    def tick(self, now: float, *, info_timeout_seconds: float, orphan_timeout_seconds: float, orphans_every: float = 0.0) -> None:
        """Time out sources waiting for transfer infos (each engine's own bound,
        else ``info_timeout_seconds``); answer infos whose source never came
        (that scan of every room at most every ``orphans_every`` s)."""
        for source in list(self._open):
            if source.terminal:
                self._open.discard(source)
                continue
            own = source.engine.timeouts.sender_info_seconds
            if source.ready() or now - source.opened_at <= (own or info_timeout_seconds):
                continue
            limit = source.engine.timeouts.limit("sender_info_seconds", info_timeout_seconds)
            want = source.expected_destinations
            self.fail(
                source,
                cause(
                    common_pb2.FAILURE_KIND_TIMEOUT,
                    f"waited {limit} for the receivers' transfer info (ExpectRoom on the decode "
                    f"side); {len(source.destinations)} of {want if want is not None else 'an unknown number of'} "
                    "receivers registered",
                    self._id,
                ),
            )
        if now - self._orphans_checked_at < orphans_every:
            return
        self._orphans_checked_at = now
        self._abandon_orphans(now, orphan_timeout_seconds)

    # -- queries ---------------------------------------------------------
    def has_business(self, broker_id: str) -> bool:
        """Whether a source still serves (or writes to) a receiver at ``broker_id``."""
        return any(
            (not s.terminal or s.inflight) and any(d.info.receiver_broker_id == broker_id for d in s.destinations.values())
            for s in self._rooms.all_sources()
        )

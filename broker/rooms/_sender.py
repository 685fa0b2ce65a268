"""The sender side of rooms, as a state machine without I/O.

A **source** is one prefill engine rank's side of one room. Its life:

1. ``begin`` (BeginSend) opens it; it is BOOTSTRAPPING until every receiver
   rank it serves has registered the room here (their transfer infos,
   ``transfer_info``, may come before or after BeginSend), then
   WAITING_FOR_INPUT (``_send_bootstrap``).
2. ``chunk`` (SendChunk) accepts chunks of source pages, validated against
   the engine's regions; the last one carries the aux row and state
   (``_send_parts``).
3. Every accepted chunk is posted to every registered destination, in chunk
   order (``_send_parts``): :func:`~kvbroker.plan.plan_chunk` splits it into
   parts (where it lands and what it carries: ``_send_chunks``), each a NIXL
   write with a ``TransferNotice`` (explicit completion, docs/design.md
   section 4). A staged part first reserves room at the receiver
   (``ReserveStaging`` -> ``staging_reserved``). The source counts its parts
   in flight until each settles (``part_settled``); TRANSFERRING meanwhile.
4. SUCCESS when every destination registered and every part through the
   last chunk settled DONE (``_send_outcomes``).
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

:class:`SenderCore` is a facade over collaborators that each own their
state, composed at construction around one shared
:class:`~kvbroker.broker.rooms._machine.MachineCore` (room tables, counters,
broker id, outbox):

- ``SourceOutcomes`` (``_send_outcomes``): moves sources forward, fails
  them, reports to their receivers; their spans.
- ``PartLedger`` (``_send_parts``): accepted chunks and the parts in flight
  (pump, post, staging reserved, part settled).
- ``SourceBootstrap`` (``_send_bootstrap``): the open sources, BeginSend,
  transfer infos, their timeouts and the orphaned infos.

The calls that only one collaborator answers are that collaborator's bound
methods (no extra hop); the facade's own methods are the events that cross
them (aborts, lost engines and peers, timers). Every call returns nothing
but leaves effects (``_effects``) in the outbox; :meth:`SenderCore.take`
hands them to the executor. The records are in ``_sender_records``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbroker.broker import telemetry
from kvbroker.broker.rooms._commands import Abort
from kvbroker.broker.rooms._machine import MachineCore
from kvbroker.broker.rooms._records import RoomTables, SenderRoom
from kvbroker.broker.rooms._send_bootstrap import SourceBootstrap
from kvbroker.broker.rooms._send_outcomes import SourceOutcomes
from kvbroker.broker.rooms._send_parts import PartLedger
from kvbroker.broker.rooms._sender_records import PeerView, Source
from kvbroker.broker.rooms._sides import cause
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import PermissionDenied
from kvbroker.v1 import common_pb2

if TYPE_CHECKING:
    from kvbroker.broker.memory import Engine

__all__ = ["SenderCore"]


class SenderCore:
    """Every source of this broker. No I/O: calls leave effects (:meth:`take`).

    The facade over the sender's collaborators: ``take`` is the shared
    outbox's; ``fail`` and ``ensure_span`` are
    :class:`~kvbroker.broker.rooms._send_outcomes.SourceOutcomes`'s;
    ``chunk``, ``staging_reserved`` and ``part_settled`` are
    :class:`~kvbroker.broker.rooms._send_parts.PartLedger`'s; ``begin``,
    ``transfer_info``, ``abandon`` and ``renew_lease`` are
    :class:`~kvbroker.broker.rooms._send_bootstrap.SourceBootstrap`'s (each
    bound here at construction).
    """

    def __init__(
        self,
        *,
        broker_id: str,
        rooms: RoomTables,
        counters: Counters,
        peers: PeerView,
        send_staging_bytes: Callable[[int, int], int],
        part_bytes: int = 64 << 20,
        host_part_bytes: int = 0,
    ) -> None:
        core = MachineCore(broker_id=broker_id, rooms=rooms, counters=counters)
        outcomes = SourceOutcomes(core)
        ledger = PartLedger(
            core, outcomes, peers=peers, send_staging_bytes=send_staging_bytes, part_bytes=part_bytes,
            host_part_bytes=host_part_bytes,
        )
        bootstrap = SourceBootstrap(core, outcomes, ledger, peers=peers)
        self._id = broker_id
        self._rooms = rooms
        self._outcomes = outcomes
        self._bootstrap = bootstrap
        # -- the calls one collaborator answers, bound (no hop) --------------
        self.take = core.take
        self.fail = outcomes.fail
        self.ensure_span = outcomes.ensure_span
        self.chunk = ledger.chunk
        self.staging_reserved = ledger.staging_reserved
        self.part_settled = ledger.part_settled
        self.begin = bootstrap.begin
        self.transfer_info = bootstrap.transfer_info
        self.abandon = bootstrap.abandon
        self.renew_lease = bootstrap.renew_lease

    # -- engine calls ----------------------------------------------------
    def abort(self, command: Abort) -> Source | None:
        """Fail the engine's side of the room and tell its receivers. Idempotent."""
        engine, room_id, reason, by = command.engine, command.room, command.reason, command.by
        room = self._rooms.sender.get(room_id)
        source = room.sources.get(engine.key) if room is not None else None
        if source is not None:
            why = reason or "aborted by the sending engine"
            self._outcomes.ensure_span(source)
            telemetry.child_done(source.span, "kvbroker.abort", {"kvbroker.reason": why, "kvbroker.by": by})
            self._outcomes.fail(source, cause(common_pb2.FAILURE_KIND_ABORTED, why, self._id))
        return source

    def engine_gone(self, engine: Engine, why: common_pb2.FailureCause) -> int:
        """``engine`` unregistered or died: fail its sources, and tell receivers
        waiting for it in rooms it never opened that it never will. Returns the
        sources failed."""
        sources = [s for s in self._rooms.all_sources() if s.engine is engine]
        for source in sources:
            self._outcomes.fail(source, why)
        self._bootstrap.abandon(engine.key, why)
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
                        self._outcomes.report(source, dest)
            else:
                self._outcomes.fail(source, why)
        return all(source.inflight == 0 for source in room.sources.values())

    def peer_lost(self, broker_id: str, why: common_pb2.FailureCause) -> int:
        """The receivers' broker ``broker_id`` is gone: fail every source serving it."""
        lost = [
            s
            for s in self._rooms.all_sources()
            if not s.terminal and any(d.info.receiver_broker_id == broker_id for d in s.destinations.values())
        ]
        for source in lost:
            self._outcomes.fail(source, why)
        return len(lost)

    # -- timers ----------------------------------------------------------
    def tick(self, now: float, *, info_timeout_seconds: float, orphan_timeout_seconds: float, orphans_every: float = 0.0) -> None:
        """Time out sources waiting for transfer infos (each engine's own bound,
        else ``info_timeout_seconds``); answer infos whose source never came
        (that scan of every room at most every ``orphans_every`` s)."""
        self._bootstrap.time_out(now, info_timeout_seconds)
        self._bootstrap.answer_orphans(now, orphan_timeout_seconds, orphans_every)

    # -- queries ---------------------------------------------------------
    def has_business(self, broker_id: str) -> bool:
        """Whether a source still serves (or writes to) a receiver at ``broker_id``."""
        return any(
            (not s.terminal or s.inflight) and any(d.info.receiver_broker_id == broker_id for d in s.destinations.values())
            for s in self._rooms.unfinished_sources()
        )

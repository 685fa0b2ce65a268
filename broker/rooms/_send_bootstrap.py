"""A source meets its receivers: BeginSend and the receivers' transfer infos, in either order.

:class:`SourceBootstrap` opens a source (:meth:`~SourceBootstrap.begin`,
BOOTSTRAPPING) and takes each receiver rank's registration of the room
(:meth:`~SourceBootstrap.transfer_info`), which may come before or after
BeginSend; each pairing of the two becomes a destination of the source, to
which the ``PartLedger`` (``_send_parts``) posts its chunks from then on. It
holds the sources still open, whose wait for transfer infos times out
(:meth:`~SourceBootstrap.time_out`). Transfer infos whose source never opens
the room are answered too (:meth:`~SourceBootstrap.abandon`: when the
source's engine goes away, or after the orphan timeout,
:meth:`~SourceBootstrap.answer_orphans`), and that receiver's info is never
attached to that source again (its pages may have been reused since).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
from opentelemetry import trace

from kvbroker.broker import telemetry
from kvbroker.broker.rooms._commands import BeginSend
from kvbroker.broker.rooms._effects import SendReport
from kvbroker.broker.rooms._machine import MachineCore
from kvbroker.broker.rooms._records import SenderRoom
from kvbroker.broker.rooms._send_chunks import room_mismatch
from kvbroker.broker.rooms._send_outcomes import SourceOutcomes
from kvbroker.broker.rooms._send_parts import PartLedger
from kvbroker.broker.rooms._sender_records import Destination, PeerView, Source, TransferInfo
from kvbroker.broker.rooms._sides import FAILED, cause
from kvbroker.errors import Aborted, AlreadyExists, FailedPrecondition
from kvbroker.plan import RankKey, check_declared_pages, check_room_indices
from kvbroker.v1 import common_pb2, peer_pb2

if TYPE_CHECKING:
    pass

__all__ = ["SourceBootstrap"]

log = structlog.get_logger(__name__)


class SourceBootstrap:
    """The sources still open: opening them and pairing them with the receivers' transfer infos."""

    def __init__(self, core: MachineCore, outcomes: SourceOutcomes, ledger: PartLedger, *, peers: PeerView) -> None:
        self._id = core.broker_id
        self._rooms = core.rooms
        self._emit = core.emit
        self._outcomes = outcomes
        self._ledger = ledger
        self._peers = peers
        #: Sources that were open at the last look (the timeouts scan these, not every record).
        self._open: set[Source] = set()
        self._orphans_checked_at = 0.0

    def begin(self, command: BeginSend) -> Source:
        """Open the command's room for sending from its engine (BeginSend):
        ``num_pages`` over all chunks (0: not said)."""
        engine, room_id, num_pages = command.engine, command.room, command.num_pages
        if self._rooms.is_tombstoned("sender", room_id):
            raise AlreadyExists(f"room {room_id} already ended on this broker; room ids must be unique")
        room = self._rooms.sender.get(room_id)
        if room is not None and engine.key in room.opened:
            raise AlreadyExists(f"engine rank {engine.key} already opened room {room_id}")
        check_declared_pages(engine.layout, num_pages)
        if room is None:
            room = self._rooms.sender[room_id] = SenderRoom(room_id)
        room.opened += (engine.key,)
        source = Source(
            room=room_id,
            engine=engine,
            listener=self._outcomes.changed,
            num_pages=num_pages,
            priority=command.priority,
            deadline=command.deadline,
        )
        source.begin_context = telemetry.current_span()
        source.engine_traced = telemetry.has_remote_parent(trace.get_current_span())
        if source.engine_traced:
            # The engine passed its request's trace: the room joins it.
            self._outcomes.open_span(source, source.begin_context)
        self._rooms.add_source(room, source)
        self._open.add(source)
        log.debug("send_opened", room=room_id, engine=engine.label, num_pages=num_pages)
        if room.aborted is not None:
            self._outcomes.fail(source, room.aborted)
            return source
        gave_up = [(info, room.abandoned[(info.receiver, engine.key)]) for info in room.infos.values()
                   if (info.receiver, engine.key) in room.abandoned]
        if gave_up:
            info, told = gave_up[0]
            self._outcomes.fail(
                source,
                cause(
                    told.kind,
                    f"room {room_id} cannot be opened again: receiver {info.receiver} was told that this source "
                    f"would never open it ({told.message}) and may have reused its pages",
                    self._id,
                ),
            )
        for info in list(room.infos.values()):
            if info.plan_for(engine.key) is not None and (info.receiver, engine.key) not in room.abandoned:
                self._attach(source, info)
        return source

    def transfer_info(self, info: TransferInfo) -> None:
        """A receiver rank's transfer info (RegisterRoom). Idempotent for the same receiver."""
        if self._rooms.is_tombstoned("sender", info.room):
            raise FailedPrecondition(f"room {info.room} already ended on this broker")
        remote = self._peers.remote_engine(info.receiver_broker_id, info.receiver)
        if remote is None or remote.generation != info.receiver_generation:
            raise Aborted(
                f"receiver {info.receiver} generation {info.receiver_generation} is not in this broker's view of "
                f"broker {info.receiver_broker_id}; handshake again"
            )
        # The receiver's broker checked these against its engine; check again
        # against what it announced, so no index outside a region it
        # registered can ever become a descriptor here.
        check_room_indices(
            remote.layout, pages=info.pages, aux_row=info.aux_row, state=info.state, who=f"receiver {info.receiver} "
        )
        room = self._rooms.sender.get(info.room)
        if room is None:
            room = self._rooms.sender[info.room] = SenderRoom(info.room)
        known = room.infos.get(info.receiver)
        if known is not None:
            if (known.receiver_broker_id, known.receiver_generation) == (info.receiver_broker_id, info.receiver_generation):
                return  # the same registration again
            raise FailedPrecondition(
                f"room {info.room} was registered here for receiver {info.receiver} by broker "
                f"{known.receiver_broker_id} (engine generation {known.receiver_generation}); a room is registered once"
            )
        room.infos[info.receiver] = info
        for plan in info.sources:
            source = room.sources.get(plan.rank)
            if source is not None:
                self._attach(source, info)

    def abandon(self, source_key: RankKey, why: common_pb2.FailureCause, *, older_than: float | None = None) -> int:
        """Tell receivers waiting for ``source_key`` in rooms it never opened here that it never will.

        For a source engine that died (or unregistered) before BeginSend, and
        for transfer infos older than the orphan timeout; without this the
        receiver would wait for its data timeout. ``older_than``: only infos
        received before that time. Returns how many receivers were told.
        """
        told = 0
        rooms = self._rooms.sender.values() if older_than is None else self._rooms.sender_rooms_made_by(older_than)
        for room in rooms:
            if source_key in room.opened:
                continue
            for info in room.infos.values():
                pair = (info.receiver, source_key)
                if info.plan_for(source_key) is None or pair in room.abandoned:
                    continue
                if older_than is not None and info.received_at > older_than:
                    continue
                room.abandoned[pair] = why
                report = peer_pb2.CompletionReport(
                    room=room.room,
                    sender_broker_id=self._id,
                    source=source_key.to_proto(),
                    receiver=info.receiver.to_proto(),
                    failure=why,
                    settled=True,
                )
                self._emit(SendReport(info.receiver_broker_id, report))
                told += 1
        return told

    def time_out(self, now: float, info_timeout_seconds: float) -> None:
        """Fail the open sources that waited too long for their receivers'
        transfer infos (each engine's own bound, else ``info_timeout_seconds``)."""
        for source in list(self._open):
            if source.terminal:
                self._open.discard(source)
                continue
            own = source.engine.timeouts.sender_info_seconds
            if source.ready() or now - max(source.opened_at, source.lease_from) <= (own or info_timeout_seconds):
                continue
            limit = source.engine.timeouts.limit("sender_info_seconds", info_timeout_seconds)
            want = source.expected_destinations
            self._outcomes.fail(
                source,
                cause(
                    common_pb2.FAILURE_KIND_TIMEOUT,
                    f"waited {limit} for the receivers' transfer info (ExpectRoom on the decode "
                    f"side){' since the last lease renewal' if source.lease_from > source.opened_at else ''}; "
                    f"{len(source.destinations)} of {want if want is not None else 'an unknown number of'} "
                    "receivers registered",
                    self._id,
                ),
            )

    def renew_lease(self, room_id: int, group: str, now: float) -> list[Source]:
        """A receiver's broker renews the lease of ``room_id``'s sources in
        ``group`` for a decode that announced the room (``RenewLeases``):
        those still waiting for transfer infos wait from ``now`` again.
        The sources renewed (none for a room not opened here yet)."""
        room = self._rooms.sender.get(room_id)
        if room is None:
            return []
        renewed = [
            s for s in room.sources.values() if s.key.group == group and not s.terminal and not s.ready()
        ]
        for source in renewed:
            source.lease_from = max(source.lease_from, now)
        return renewed

    def answer_orphans(self, now: float, orphan_timeout_seconds: float, every: float) -> None:
        """Answer every transfer info whose source did not open the room within
        the orphan timeout (that scan of the rooms older than it at most every
        ``every`` s)."""
        if now - self._orphans_checked_at < every:
            return
        self._orphans_checked_at = now
        for room in self._rooms.sender_rooms_made_by(now - orphan_timeout_seconds):
            for info, rank in list(room.unserved()):
                if now - info.received_at <= orphan_timeout_seconds:
                    continue
                why = cause(
                    common_pb2.FAILURE_KIND_TIMEOUT,
                    f"source rank {rank} did not open the room (BeginSend) within {orphan_timeout_seconds:g} s",
                    self._id,
                )
                self.abandon(rank, why, older_than=now - orphan_timeout_seconds)

    def _attach(self, source: Source, info: TransferInfo) -> None:
        """Make receiver ``info`` a destination of ``source`` and post it what was accepted so far."""
        plan = info.plan_for(source.key)
        if plan is None or info.receiver in source.destinations:
            return
        if source.expected_destinations is None:
            source.expected_destinations = plan.num_destinations
        dest = Destination(info=info, plan=plan)
        source.destinations[info.receiver] = dest
        if info.priority:  # the decode side's class and deadline win
            source.priority, source.deadline = info.priority, info.deadline
        if source.span is None:
            self._outcomes.open_span(source, info.trace_context)
        if source.state == FAILED:
            self._outcomes.report(source, dest)
            return
        problem = room_mismatch(source, info) if plan.writes_data else None
        if problem:
            self._outcomes.fail(source, cause(common_pb2.FAILURE_KIND_MISMATCH, problem, self._id))
            return
        self._ledger.pump(source, dest)
        self._outcomes.advance(source)

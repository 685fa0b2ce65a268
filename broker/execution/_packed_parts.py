"""Packed parts in flight: the sender's side of the device path (``_parts``
hands them here).

A packed part takes a slot of the local send transfer buffer, then a range
of this broker's credits in the receiver's buffer (``_credits``: no call to
the receiver in steady state) while it is gathered into ours
(``_staging_copies``), then goes as one write, slot to slot. Where nothing
must be waited for, all of it starts at once, without a task
(:meth:`PackedParts.reserve`); otherwise a task waits for each in turn.
``PartsInFlight`` keeps the spans of the parts in flight and settles them;
this class reads those and adds to what is sending (:class:`PartsHeld`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.trace import Span

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import Posting
from kvbroker.broker.execution._bundles import Machines, Transport
from kvbroker.broker.execution._credits import Credits
from kvbroker.broker.execution._probes import TransportProbes
from kvbroker.broker.execution._staging_copies import StagingCopies, as_broker_error, slot_of
from kvbroker.broker.execution._tasks import TaskSet
from kvbroker.broker.execution._tickets import part_ticket
from kvbroker.broker.execution._turn import in_turn
from kvbroker.broker.execution._writes import packed_write
from kvbroker.broker.memory import Credit, Reservation, StagingPool
from kvbroker.broker.peers import TransportVerdict
from kvbroker.broker.rooms import FAILED, Part
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import FailedPrecondition, Internal, KvBrokerError
from kvbroker.plan import pool_text
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["PackedParts", "PartsHeld"]

VRAM = common_pb2.MEMORY_KIND_VRAM


@dataclass(frozen=True, eq=False)
class PartsHeld:
    """What ``PartsInFlight`` holds that the packed path reads and adds to."""

    #: Parts handed on and not settled: their span and when they started.
    spans: dict[Part, tuple[Span, float]]
    #: Parts' slots in the local send transfer buffer, until they settle.
    sending: dict[Part, tuple[StagingPool, Reservation]]
    counters: Counters
    #: Settle a part that never reached NIXL, as failed.
    fail: Callable[[Part, KvBrokerError], None]


class PackedParts:
    """The packed parts from their reservations to their write. Control loop only."""

    def __init__(
        self,
        *,
        config: BrokerConfig,
        machines: Machines,
        transport: Transport,
        credits: Credits,
        probes: TransportProbes,
        copies: StagingCopies,
        tasks: TaskSet,
        held: PartsHeld,
    ) -> None:
        self._config = config
        self._sender = machines.sender
        #: Each answer to the sender's state machine is a turn.
        self._turn = machines.turn
        self._dataplane = transport.dataplane
        self._peers = transport.peers
        self._pools = transport.pools
        self._credits = credits
        self._probes = probes
        self._copies = copies
        self._tasks = tasks
        self._held = held
        #: Packed parts' ranges in the receiver's credits, until they settle:
        #: one that never reached the receiver gives its range back here.
        self._credited: dict[Part, Credit] = {}
        #: Packed parts being gathered into a slot of the send transfer buffer
        #: (while the receiver reserves its slot): what the gather gave, or why not.
        self._packing: dict[Part, asyncio.Future[_Packed | KvBrokerError | None]] = {}

    def reserve(self, part: Part) -> None:
        """Room for a packed part: our slot first, then the receiver's (asked for while we gather)."""
        if not self._pack_now(part):
            self._packing[part] = self._tasks.spawn(self._pack(part), name=f"pack-{part.source.room}")

    def post(self, part: Part, agent_name: str) -> None:
        """Post a packed part once its gather is done."""
        packing = self._packing.get(part)
        if packing is None:
            self._held.fail(part, Internal("a packed part was posted without its gather"))
        else:
            packing.add_done_callback(functools.partial(self._post_packed, part, agent_name))

    def settled(self, part: Part, done: bool) -> None:
        """A part settled (``done``: its write reached the receiver): what it still holds goes back."""
        credit = self._credited.pop(part, None)
        if credit is not None and not done:
            # It never reached the receiver: its range is free (a DONE one the receiver hands back).
            self._credits.release(credit)
        packing = self._packing.pop(part, None)
        if packing is not None:
            # It settled before its gather was posted: give the slot back once it is gathered.
            packing.add_done_callback(_release_packed)

    def _pack_now(self, part: Part) -> bool:
        """The steady state of a packed part, without a task: where nothing
        must be waited for (the pair's transport verdict is known, nobody
        waits before it, our send buffer and our credits at the receiver have
        room now), take both ranges and start the gather here. False where
        something must be waited for: ``_pack`` then does it all."""
        spec = part.spec
        local, remote = spec.pools
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        pool = self._pools.pool("send", *local)
        held = self._held.spans.get(part)
        if peer is None or peer.agent_name is None or pool is None or pool.waiting or held is None or part.source.state == FAILED:
            return False
        verdict = self._probes.verdict(peer, local, remote) if VRAM in (local[0], remote[0]) else None
        if verdict is None and VRAM in (local[0], remote[0]):
            return False
        reservation = pool.try_reserve(part.nbytes)
        if reservation is None:
            return False
        got = self._credits.try_acquire(peer, remote, part.nbytes)
        if got is None:
            pool.release(reservation)
            return False
        if verdict is not None:
            self._show_transport(part, verdict)
        self._packing[part] = self._gather_into(part, held[0], pool, reservation)
        self._placed(part, *got)
        return True

    async def _pack(self, part: Part) -> _Packed | KvBrokerError | None:
        """Reserve a slot of the send transfer buffer, then a range of our
        credits in the receiver's buffer, then gather the part (and its
        checksum, if asked for). The order matters: a part that holds a
        receive range already holds its send slot and waits for nothing else,
        so parts waiting for one buffer never hold the other one full (they
        did, deadlocked, when both were asked for at once). A part that gets
        no slot or range fails here (None); past that, the error is returned,
        not raised: ``_post_packed`` or ``settled`` takes the outcome."""
        spec = part.spec
        assert spec.packing is not None
        pool = self._pools.pool("send", *spec.pools[0])
        try:
            await self._transport(part)
            if pool is None:
                raise FailedPrecondition(f"this broker has no send transfer buffer for {pool_text(spec.pools[0])}")
            reservation = await pool.reserve(
                part.nbytes, self._config.staging_wait_seconds, ticket=part_ticket(part, self._config.priorities)
            )
        except Exception as exc:
            self._packing.pop(part, None)
            self._held.fail(part, as_broker_error(exc, "reserving a send slot"))
            return None
        if part not in self._held.spans:  # it settled (failed) while it waited
            pool.release(reservation)
            return None
        if part.source.state == FAILED:
            pool.release(reservation)
            self._packing.pop(part, None)
            self._held.fail(part, FailedPrecondition("the room failed before its packed part was written"))
            return None
        got = await self._credit(part)
        held = self._held.spans.get(part)
        if got is None or held is None:
            pool.release(reservation)
            if got is not None:  # it settled (failed) while it waited
                self._credits.release(got[1])
            return None
        gathering = self._gather_into(part, held[0], pool, reservation)
        self._placed(part, *got)
        return await gathering

    async def _credit(self, part: Part) -> tuple[peer_pb2.RemoteBuffer, Credit] | None:
        """A packed part's range in the receiver's transfer buffer, from this
        broker's credits there (no call to the receiver unless its window must
        grow); None if the part failed (settled) instead."""
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        if peer is None or peer.agent_name is None:
            self._packing.pop(part, None)
            self._held.fail(part, FailedPrecondition(f"broker {part.dest.info.receiver_broker_id} is gone"))
            return None
        try:
            got = await self._credits.acquire(
                peer, part.spec.pools[1], part.nbytes, part_ticket(part, self._config.priorities)
            )
        except KvBrokerError as exc:
            self._packing.pop(part, None)
            self._held.fail(part, exc)
            return None
        if part not in self._held.spans:  # it settled (failed) while it waited
            self._credits.release(got[1])
            return None
        if part.source.state == FAILED:
            self._credits.release(got[1])
            self._packing.pop(part, None)
            self._held.fail(part, FailedPrecondition("the room failed before its packed part was written"))
            return None
        return got

    @in_turn
    def _placed(self, part: Part, buffer: peer_pb2.RemoteBuffer, credit: Credit) -> None:
        """A packed part holds its range in the receiver's buffer: its notice
        names the credit, and the sender's state machine hands it on to be
        posted (once gathered)."""
        self._credited[part] = credit
        part.notice.credit_id = credit.credit_id
        self._sender.staging_reserved(part, buffer, credit.offset)

    def _gather_into(self, part: Part, span: Span, pool: StagingPool, reservation: Reservation) -> asyncio.Future[_Packed | KvBrokerError | None]:
        """Start gathering a packed part into its send slot; what the gather
        gave (or why not: its slot is then given back) in the future."""
        spec = part.spec
        assert spec.packing is not None
        outcome: asyncio.Future[_Packed | KvBrokerError | None] = asyncio.get_running_loop().create_future()

        def gathered(done: asyncio.Future[int | None]) -> None:
            error = Internal("a packed part's gather was cancelled") if done.cancelled() else done.exception()
            if error is not None or outcome.done():
                pool.release(reservation)
            if outcome.done():  # its awaiter gave up (the broker is stopping)
                return
            if error is not None:
                outcome.set_result(as_broker_error(error if isinstance(error, Exception) else Internal(repr(error)), "gathering a packed part"))
            else:
                outcome.set_result(_Packed(pool, reservation, done.result()))

        try:
            slot = slot_of(pool, reservation, part.nbytes)
            self._copies.gather_soon(
                part.source.engine,
                spec.packing.blocks,
                pool.buffer,
                slot,
                span,
                with_checksum=part.dest.info.verify_checksum,
                then=gathered,
                ticket=part_ticket(part, self._config.priorities),
            )
        except Exception as exc:
            pool.release(reservation)
            outcome.set_result(as_broker_error(exc, "gathering a packed part"))
        return outcome

    async def _transport(self, part: Part) -> None:
        """The transport self-test of the part's pair of transfer buffers (the
        first part of a pair waits for its probe); its verdict on the part's
        and the room's spans."""
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        if peer is None or peer.agent_name is None:
            return  # posting it fails it, naming the peer
        local, remote = part.spec.pools
        verdict = await self._probes.ensure(peer, local, remote)
        if verdict is not None:
            self._show_transport(part, verdict)

    def _show_transport(self, part: Part, verdict: TransportVerdict) -> None:
        """The transport verdict on the part's and the room's spans."""
        held = self._held.spans.get(part)
        spans = [span for span in (held[0] if held is not None else None, part.source.span) if span is not None and span.is_recording()]
        if spans:  # (an untraced room's spans record nothing: no text to make per part)
            text = verdict.text()
            for span in spans:
                span.set_attribute("kvbroker.transport", text)

    def _post_packed(self, part: Part, agent_name: str, packing: asyncio.Future[_Packed | KvBrokerError | None]) -> None:
        """Post a packed part once its gather is done (a callback of its
        ``_pack`` task, not a task of its own): one write, slot to slot."""
        if part not in self._held.spans:
            return  # it settled meanwhile; settled() gives its slot back
        self._packing.pop(part, None)
        outcome: _Packed | KvBrokerError | None = None
        if not packing.cancelled():
            try:
                outcome = packing.result()
            except Exception as exc:  # a bug in _pack: the part fails, naming it
                outcome = as_broker_error(exc, "packing a part")
        if not isinstance(outcome, _Packed):
            self._held.fail(part, outcome or Internal("a packed part was posted without its gather"))
            return
        if part.source.state == FAILED:
            outcome.pool.release(outcome.reservation)
            self._held.fail(part, FailedPrecondition("the room failed before its packed part was written"))
            return
        if outcome.checksum is not None:
            part.notice.packed_checksum = outcome.checksum
        self._held.sending[part] = (outcome.pool, outcome.reservation)
        self._held.counters.transfers_packed += 1
        make = packed_write(part, outcome.pool.buffer, outcome.reservation.offset, agent_name, part.notice.SerializeToString())
        self._dataplane.post(Posting(part, make, agent_name, part.nbytes, part_ticket(part, self._config.priorities)))


@dataclass(frozen=True)
class _Packed:
    """A gathered packed part: its slot in the send transfer buffer, and its checksum."""

    pool: StagingPool
    reservation: Reservation
    checksum: int | None


def _release_packed(packing: asyncio.Future[_Packed | KvBrokerError | None]) -> None:
    if not packing.cancelled() and packing.exception() is None and isinstance(outcome := packing.result(), _Packed):
        outcome.pool.release(outcome.reservation)

"""Packed parts on the sender: each one's life, from its slot and credit to the return of its credit.

A packed part (the device path) takes a slot of the local send transfer
buffer, then a range of this broker's credits in the receiver's buffer;
from then on it is a :class:`SendingPart`, which owns both, the span, and
its hops' times. Where nothing must be waited for (the pair's transport
verdict known, room in both buffers: the steady state) it is admitted at
once, in callbacks, no task (:meth:`PackedParts._pack_now`); otherwise a
task waits for each in turn (:meth:`PackedParts._pack`).

Once admitted, the threads that carry it hand it on without the control
loop: its gather runs on its memory's lane, and the lane's own thread (the
GPU's waiter, or the copy thread) posts its write to the data plane as soon
as the gather is done and the sender's state machine handed the part on
(whichever comes second posts). The loop hears the outcome: the write
settled (``PartsInFlight.settled`` gives the slot back), and later the
receiver's return of the credit, when the part's span ends. A gather that
failed, or a room that failed before the write, comes back through the
loop's inbox (the data plane's ``LoopInbox``), in batches.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.trace import Span

from kvbroker.broker import telemetry
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import Posting
from kvbroker.broker.execution._bundles import Machines, Transport
from kvbroker.broker.execution._credits import Credits
from kvbroker.broker.execution._device_copies import DeviceCopies, as_broker_error, slot_of
from kvbroker.broker.execution._probes import TransportProbes
from kvbroker.broker.execution._tasks import TaskSet
from kvbroker.broker.execution._tickets import part_ticket
from kvbroker.broker.execution._turn import in_turn
from kvbroker.broker.execution._writes import notice_bytes, packed_write
from kvbroker.broker.memory import Credit, StagingPool, TransferSlot
from kvbroker.broker.peers import TransportVerdict
from kvbroker.broker.rooms import FAILED, Part
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import FailedPrecondition, Internal, KvBrokerError
from kvbroker.plan import pool_text
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["PackedParts", "PartsHeld", "SendingPart"]

VRAM = common_pb2.MEMORY_KIND_VRAM
#: The hops of a sending part whose times its span carries (``kvbroker.t.<hop>``, monotonic seconds).
HOPS = ("handed_on", "slot", "credit", "gather_start", "gathered", "posted", "done", "credit_back")


@dataclass(frozen=True, eq=False)
class PartsHeld:
    """What ``PartsInFlight`` holds that the packed path reads."""

    #: Parts handed on and not settled: their span and when they started.
    spans: dict[Part, tuple[Span, float]]
    counters: Counters
    #: Settle a part that never reached NIXL, as failed.
    fail: Callable[[Part, KvBrokerError], None]


class SendingPart:
    """One packed part from its admission (a send slot and a credit held) until
    its credit comes back: what it holds, and where it is.

    Its gather and its post happen on the lanes' and the data plane's threads;
    the rendezvous between the gather being done (:meth:`gathered`, a lane's
    thread) and the sender's state machine handing the part on (:meth:`clear`,
    the loop) is under its lock: whichever comes second gets the write to post.
    Everything else is the loop's.
    """

    __slots__ = (
        "_cleared",
        "_gathered",
        "_lock",
        "_posting",
        "abandoned",
        "checksum",
        "agent_name",
        "buffer",
        "credit",
        "make_posting",
        "part",
        "poster",
        "pool",
        "slot",
        "span",
        "times",
    )

    def __init__(
        self,
        part: Part,
        pool: StagingPool,
        slot: TransferSlot,
        credit: Credit,
        buffer: peer_pb2.RemoteBuffer,
        span: Span,
        times: dict[str, float],
    ) -> None:
        self.part = part
        self.pool = pool
        #: Its send slot: its range of the local send buffer, until its write is DONE.
        self.slot = slot
        self.credit = credit
        self.buffer = buffer
        self.span = span
        #: When each hop happened (``HOPS``), monotonic seconds.
        self.times = times
        self.agent_name = ""
        #: Builds the part's write once its notice is complete (set when cleared).
        self.make_posting: Callable[[], Posting] | None = None
        #: It settled (failed) while its gather ran: the gather gives the slot back.
        self.abandoned = False
        #: Its slot's CRC-32, once gathered (when its receiver verifies).
        self.checksum: int | None = None
        self._lock = threading.Lock()
        self._gathered = False
        self._cleared = False
        self._posting = False
        #: The thread that posted its write (off the loop, in steady state).
        self.poster = ""

    def clear(self, agent_name: str, make_posting: Callable[[], Posting]) -> Posting | None:
        """The state machine handed the part on (loop): its write, to post now if
        the gather is done already; else None (the gather's thread posts it)."""
        with self._lock:
            self.agent_name, self.make_posting, self._cleared = agent_name, make_posting, True
            go = self._gathered and not self._posting
            self._posting = self._posting or go
        return self._post() if go else None

    def gathered(self, checksum: int | None) -> tuple[Posting | None, bool]:
        """Its gather is done (a lane's thread): its write, to post now if the
        state machine handed the part on already (else None); and whether it
        was abandoned meanwhile (its slot is then the gather's to give back)."""
        self.times["gathered"] = time.monotonic()
        self.checksum = checksum
        with self._lock:
            self._gathered = True
            go = self._cleared and not self._posting and not self.abandoned
            self._posting = self._posting or go
            abandoned = self.abandoned
        return (self._post() if go else None), abandoned

    def failed(self) -> bool:
        """Its gather failed, or its room did before its write (a lane's thread): it
        is never posted. Whether it was abandoned already (its slot is then the
        gather's to give back)."""
        with self._lock:
            self._gathered = self._posting = True
            return self.abandoned

    def abandon(self) -> bool:
        """It settled before its write was posted (loop): whether its gather is done
        (its slot may go back now); if not, the gather gives it back when done."""
        with self._lock:
            self.abandoned = True
            return self._gathered

    @property
    def posted(self) -> bool:
        return self._posting

    def _post(self) -> Posting:
        """The write (once both sides are through the rendezvous: nobody else touches the notice now)."""
        assert self.make_posting is not None
        self.times["posted"] = time.monotonic()
        self.poster = threading.current_thread().name
        return self.make_posting()


class PackedParts:
    """The packed parts from their slot and credit until their credit comes back. Control loop only."""

    def __init__(
        self,
        *,
        config: BrokerConfig,
        machines: Machines,
        transport: Transport,
        credits: Credits,
        probes: TransportProbes,
        copies: DeviceCopies,
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
        #: Admitted parts (a slot and a credit held), until they settle.
        self._sending: dict[Part, SendingPart] = {}
        #: Parts whose write is DONE, by credit id, until the receiver returns
        #: their credit: the span of each (traced rooms) ends then.
        self._returning: dict[int, SendingPart] = {}
        credits.on_returned(self._credit_back)

    def reserve(self, part: Part) -> None:
        """Room for a packed part: our slot first, then the receiver's credit; then its gather."""
        times = {"handed_on": time.monotonic()}
        if not self._pack_now(part, times):
            self._tasks.spawn(self._pack(part, times), name=f"pack-{part.source.room}")

    def post(self, part: Part, agent_name: str, chunk_sum: int | None) -> None:
        """The state machine handed a packed part on: its write goes once it is
        gathered (``chunk_sum``: its chunk's checksum, when its receiver verifies)."""
        sending = self._sending.get(part)
        if sending is None:
            self._held.fail(part, Internal("a packed part was posted without its slot"))
            return
        ticket = part_ticket(part, self._config.priorities)

        def make() -> Posting:
            notif = notice_bytes(part, chunk_sum, sending.checksum)
            write = packed_write(part, sending.pool.buffer, sending.slot.offset, agent_name, notif)
            return Posting(part, write, agent_name, part.nbytes, ticket)

        posting = sending.clear(agent_name, make)
        if posting is not None:
            self._dataplane.post(posting)

    def settled(self, part: Part, done: bool, span: Span | None, settled_at: float) -> bool:
        """A part settled (``done``: its write reached the receiver): what it holds
        goes back, but a done part's credit, which the receiver returns. Whether it
        keeps ``span`` (a traced part's ends when its credit comes back)."""
        sending = self._sending.pop(part, None)
        if sending is None:
            return False
        if not done:
            # It never reached the receiver: its range is free (a DONE one the receiver hands back).
            self._credits.release(sending.credit)
            if sending.abandon():
                sending.pool.release(sending.slot)
            return False
        sending.pool.release(sending.slot)
        sending.times["done"] = settled_at
        if span is None or not span.is_recording() or not self._credits.is_placed(sending.credit.credit_id):
            return False
        sending.span = span
        self._returning[sending.credit.credit_id] = sending
        return True

    # -- admission ------------------------------------------------------------------------
    def _pack_now(self, part: Part, times: dict[str, float]) -> bool:
        """The steady state of a packed part, without a task: where nothing
        must be waited for (the pair's transport verdict is known, nobody
        waits before it, our send buffer and our credits at the receiver have
        room now), take both ranges and admit it here. False where something
        must be waited for: ``_pack`` then does it all."""
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
        ticket = part_ticket(part, self._config.priorities)
        reservation = pool.try_reserve_slot(part.nbytes, ticket)
        if reservation is None:
            return False
        got = self._credits.try_acquire(peer, remote, part.nbytes, ticket)
        if got is None:
            pool.release(reservation)
            return False
        times["slot"] = times["credit"] = time.monotonic()
        if verdict is not None:
            self._show_transport(part, verdict)
        self._admit(part, held[0], pool, reservation, *got, times)
        return True

    async def _pack(self, part: Part, times: dict[str, float]) -> None:
        """Reserve a slot of the send transfer buffer, then a range of our
        credits in the receiver's buffer, then admit the part. The order
        matters: a part that holds a receive range already holds its send slot
        and waits for nothing else, so parts waiting for one buffer never hold
        the other one full (they did, deadlocked, when both were asked for at
        once). A part that gets no slot or range fails here."""
        spec = part.spec
        assert spec.packing is not None
        pool = self._pools.pool("send", *spec.pools[0])
        try:
            await self._transport(part)
            if pool is None:
                raise FailedPrecondition(f"this broker has no send transfer buffer for {pool_text(spec.pools[0])}")
            reservation = await pool.reserve_slot(
                part.nbytes, self._config.staging_wait_seconds, ticket=part_ticket(part, self._config.priorities)
            )
        except Exception as exc:
            self._held.fail(part, as_broker_error(exc, "reserving a send slot"))
            return
        times["slot"] = time.monotonic()
        if part not in self._held.spans:  # it settled (failed) while it waited
            pool.release(reservation)
            return
        if part.source.state == FAILED:
            pool.release(reservation)
            self._held.fail(part, FailedPrecondition("the room failed before its packed part was written"))
            return
        got = await self._credit(part)
        held = self._held.spans.get(part)
        if got is None or held is None:
            pool.release(reservation)
            if got is not None:  # it settled (failed) while it waited
                self._credits.release(got[1])
            return
        times["credit"] = time.monotonic()
        self._admit(part, held[0], pool, reservation, *got, times)

    async def _credit(self, part: Part) -> tuple[peer_pb2.RemoteBuffer, Credit] | None:
        """A packed part's range in the receiver's transfer buffer, from this
        broker's credits there (no call to the receiver unless its window must
        grow); None if the part failed (settled) instead."""
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        if peer is None or peer.agent_name is None:
            self._held.fail(part, FailedPrecondition(f"broker {part.dest.info.receiver_broker_id} is gone"))
            return None
        try:
            got = await self._credits.acquire(
                peer, part.spec.pools[1], part.nbytes, part_ticket(part, self._config.priorities)
            )
        except KvBrokerError as exc:
            self._held.fail(part, exc)
            return None
        if part not in self._held.spans:  # it settled (failed) while it waited
            self._credits.release(got[1])
            return None
        if part.source.state == FAILED:
            self._credits.release(got[1])
            self._held.fail(part, FailedPrecondition("the room failed before its packed part was written"))
            return None
        return got

    def _admit(
        self,
        part: Part,
        span: Span,
        pool: StagingPool,
        reservation: TransferSlot,
        buffer: peer_pb2.RemoteBuffer,
        credit: Credit,
        times: dict[str, float],
    ) -> None:
        """The part holds its slot and its credit: it is a :class:`SendingPart`
        now. Its notice names the credit, the state machine hands it on (to be
        posted once gathered), and its gather goes to its lane."""
        sending = SendingPart(part, pool, reservation, credit, buffer, span, times)
        self._sending[part] = sending
        if span.is_recording():
            span.set_attribute("kvbroker.credit_id", credit.credit_id)
        self._held.counters.transfers_packed += 1
        self._placed(part, buffer, credit)
        spec = part.spec
        assert spec.packing is not None
        try:
            self._copies.gather_then(
                part.source.engine,
                spec.packing.blocks,
                pool.buffer,
                slot_of(pool, reservation, part.nbytes),
                span,
                with_checksum=part.dest.info.verify_checksum,
                then=lambda checksum, error: self._gathered(sending, checksum, error),
                ticket=part_ticket(part, self._config.priorities),
                times=times,
            )
        except Exception as exc:
            self._gathered(sending, None, exc)

    @in_turn
    def _placed(self, part: Part, buffer: peer_pb2.RemoteBuffer, credit: Credit) -> None:
        """A packed part holds its range in the receiver's buffer: the sender's
        state machine names the credit in its notice and hands it on (to be
        posted once gathered)."""
        self._sender.staging_reserved(part, buffer, credit.offset, credit.credit_id)

    # -- on the lanes' threads ------------------------------------------------------------
    def _gathered(self, sending: SendingPart, checksum: int | None, error: BaseException | None) -> None:
        """A part's gather is done (on its lane's thread): post its write from here
        when it may go; a failure, or a room that failed meanwhile, goes to the loop."""
        if error is None and sending.part.source.state == FAILED:  # (a racy read: it saves a write, nothing depends on it)
            error = FailedPrecondition("the room failed before its packed part was written")
        if error is not None:
            sending.failed()
            self._dataplane.inbox.put(functools.partial(self._not_posted, sending, error))
            return
        posting, abandoned = sending.gathered(checksum)
        if posting is not None:
            try:
                self._dataplane.post(posting)
            except KvBrokerError as exc:  # the broker is stopping
                self._dataplane.inbox.put(functools.partial(self._not_posted, sending, exc))
        elif abandoned:
            self._dataplane.inbox.put(lambda: sending.pool.release(sending.slot))

    def _not_posted(self, sending: SendingPart, error: BaseException) -> None:
        """A part whose gather failed, or whose room failed before its write: it settles as failed."""
        if self._sending.get(sending.part) is sending:
            self._held.fail(sending.part, as_broker_error(error, "gathering a packed part"))
        elif sending.abandoned:
            sending.pool.release(sending.slot)

    # -- credits back ---------------------------------------------------------------------
    def _credit_back(self, credit_ids: list[int]) -> None:
        """The receiver returned these credits (or they went with their peer): the
        parts they carried end their spans, with their hops' times."""
        now = time.monotonic()
        for credit_id in credit_ids:
            sending = self._returning.pop(credit_id, None)
            if sending is None:
                continue
            sending.times["credit_back"] = now
            for hop in HOPS:
                if hop in sending.times:
                    sending.span.set_attribute(f"kvbroker.t.{hop}", sending.times[hop])
            sending.span.set_attribute("kvbroker.posted_on", sending.poster)
            telemetry.end_with_status(sending.span, True, "")

    # -- the transport self-test ---------------------------------------------------------
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


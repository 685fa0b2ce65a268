"""Landed parts on the receiver: each one's life, from its notice until its range goes back.

A packed part's notice is taken where it is read, on the data-plane thread
(:meth:`ReceivingParts.take`), when its rank is open to that (its
``LandingGate``, from its plan until it ends): the notice is checked against
the gate's snapshot of the rank (the source and its sender broker, the
part's number, the range in a grant this broker gave that sender, the
blocks from the rank's own pages and their size), the part is claimed at the
gate, and its scatter starts there. Any other notice, and one the thread
declines (anything unusual: the loop's checks then say what is wrong), goes
to the loop, whose state machine takes it (``RankLanding.notices``) and asks
for the scatter (``Scatter``). Either way the part is a
:class:`ReceivingPart` from then on, which owns its span, its hops' times,
where its range goes back, and how it went. It moves through:

- **noticed**: taken at its rank's gate or by the state machine, its copies
  handed to its lane;
- **checked**: a packed part that carries a CRC-32 (``packed_checksum``) is
  checked in a job of its own, before its scatter: a part that arrived
  corrupted is never scattered;
- **scattered**: its bytes are in the rank's pages (or its copy failed);
- **handed back**: a packed part's range of its sender's credits goes back
  to the sender from the lane's thread, in the pass that saw the scatter
  complete (a ``CreditReturn`` notification), not through the loop.

The loop hears only the outcome, in a batch (the data plane's inbox): the
counters, and ``ReceiverCore.landing.scattered`` (or ``taken``, for a part the
thread took), in a turn. A part whose copy
failed, or whose range could not go back from the lane (the data plane is
stopping), has its range handed back by the state machine instead.
"""

from __future__ import annotations

import threading
import time
from functools import partial

from google.protobuf.message import DecodeError
from opentelemetry.trace import Span

from kvbroker.broker import telemetry
from kvbroker.broker.dataplane import LoopInbox
from kvbroker.broker.execution._bundles import Machines, Transport
from kvbroker.broker.execution._credits import CREDIT_RETURN, Credits, returned_credit
from kvbroker.broker.execution._device_copies import DeviceCopies, as_broker_error
from kvbroker.broker.memory import CreditRange, StagingPool
from kvbroker.broker.rooms import Landing, Receiver, Scatter
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import KvBrokerError
from kvbroker.plan import MAX_PARTS, landing_blocks, packed_bytes, rank_key
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import peer_pb2

__all__ = ["ReceivingPart", "ReceivingParts"]

#: The hops of a receiving part whose times its span carries (``kvbroker.t.<hop>``, monotonic seconds).
HOPS = ("notice", "scatter_asked", "scatter_start", "scatter_end")


class ReceivingPart:
    """One landed part from its notice until its range goes back: what it holds,
    where it is, and how it went. Made on the loop; its copies and its hand-back
    run on its lane's thread, and the loop reads it again only once it is done."""

    __slots__ = ("back", "checked", "error", "handed_back", "landing", "mismatch", "off_loop", "rank", "span", "state", "times")

    def __init__(
        self,
        rank: Receiver,
        landing: Landing,
        notice_at: float,
        back: tuple[str, peer_pb2.ReturnedCredit, StagingPool | None] | None,
        off_loop: bool = False,
    ) -> None:
        self.rank = rank
        self.landing = landing
        #: The data-plane thread took it through its rank's gate (the loop never saw its notice).
        self.off_loop = off_loop
        #: Where its range goes back once scattered: (the sender's agent, the range, the pool), for a packed part.
        self.back = back
        #: noticed -> checked -> scattered -> handed back (or failed).
        self.state = "noticed"
        self.times = {"notice": notice_at or time.monotonic(), "scatter_asked": time.monotonic()}
        #: Why it did not land (None: its bytes are in the rank's pages).
        self.error: KvBrokerError | None = None
        #: Its packed checksum was checked; and differed from the sender's.
        self.checked = False
        self.mismatch = False
        self.handed_back = False
        rank, landing = self.rank, self.landing
        self.span: Span | None = None
        if rank.span is None or telemetry.records_children(rank.span):  # (an untraced room's: none to make)
            self.span = telemetry.start_span(
                "kvbroker.staging.scatter",
                parent=rank.span,
                attributes={"kvbroker.bytes": landing.nbytes, "kvbroker.chunk": landing.key[1], "kvbroker.source": str(landing.key[0])},
            )

    def checked_crc(self, mismatch: bool) -> None:
        """Its packed checksum was checked (lane's thread)."""
        self.checked, self.mismatch = True, mismatch
        self.state = "checked"

    def scatter_started(self) -> None:
        self.times["scatter_start"] = time.monotonic()

    def done(self, error: KvBrokerError | None) -> None:
        """Its copies are over (lane's thread): scattered, or failed with ``error``; its span ends."""
        self.times["scatter_end"] = time.monotonic()
        self.error = error
        self.state = "failed" if error is not None else "scattered"
        if self.span is not None:
            for hop in HOPS:
                if hop in self.times:
                    self.span.set_attribute(f"kvbroker.t.{hop}", self.times[hop])
            self.span.set_attribute("kvbroker.credit_id", self.landing.notice.credit_id)
            self.span.set_attribute("kvbroker.scattered_on", threading.current_thread().name)
            self.span.end()

    def hand_back(self, credits: Credits) -> None:
        """A scattered packed part's range goes back to its sender now (lane's thread)."""
        if self.error is None and self.back is not None:
            try:
                credits.return_now(*self.back)
                self.handed_back = True
                self.state = "handed back"
            except KvBrokerError:  # the data plane is stopping: the state machine hands it back (or nothing will)
                pass


class ReceivingParts:
    """The landed parts being scattered (the executor's ``Scatter``, and the packed
    notices the data-plane thread takes itself: :meth:`take`). Control loop only,
    but for what runs on the data-plane and lanes' threads (:meth:`take`, :meth:`_on_lane`)."""

    def __init__(
        self, *, machines: Machines, transport: Transport, copies: DeviceCopies, credits: Credits, counters: Counters
    ) -> None:
        self._receiver = machines.receiver
        self._turn = machines.turn
        self._gates = machines.rooms.gates
        self._peers = transport.peers
        self._pools = transport.pools
        self._dataplane = transport.dataplane
        self._copies = copies
        self._credits = credits
        self._counters = counters

    def scatter(self, effect: Scatter, notice_at: float) -> None:
        """Unpack a landed part into its rank's pages, on its lane: a packed part's
        range goes back to its sender from the lane's thread as soon as it is
        scattered, and the receiver hears how it went (in a batch, on the loop)."""
        self._start(ReceivingPart(effect.receiver, effect.landing, notice_at, self._back(effect.landing)))

    def take(self, agent: str, payload: bytes) -> bool:
        """A notification read on the data-plane thread: if it is a packed part's
        whose rank's gate is open, and everything it says checks out against the
        gate, claim the part and start its scatter here. False (the notice goes to
        the loop) for anything else, and for anything unusual."""
        if payload[:1] == CREDIT_RETURN or not self._gates:  # (no rank open: nothing to parse twice)
            return False
        try:
            notice = peer_pb2.TransferNotice.FromString(payload)
        except DecodeError:
            return False
        if notice.protocol_version != PROTOCOL_VERSION or not (notice.packed and notice.staged and notice.credit_id):
            return False
        if notice.token_end or not notice.part < max(1, notice.parts) <= MAX_PARTS:
            return False
        gate = self._gates.get((notice.room, rank_key(notice.receiver)))
        source = rank_key(notice.source)
        expected = gate.sources.get(source) if gate is not None else None
        if gate is None or expected is None or expected[1] != notice.sender_broker_id:
            return False
        plan, rank = expected[0], gate.rank
        if not self._credits.ledger.holds(notice.sender_broker_id, gate.pool, notice.staging_offset, notice.staging_bytes):
            return False
        try:
            blocks = landing_blocks(rank.engine.layout, plan, rank.pages, rank.prefix_pages, rank.aux_row, rank.state_indices, notice)
        except KvBrokerError:
            return False
        if packed_bytes(blocks) != notice.staging_bytes:
            return False
        key = (source, notice.chunk_index, notice.part)
        held = CreditRange(notice.staging_offset, notice.staging_bytes, notice.sender_broker_id, notice.credit_id)
        landing = Landing(key=key, pool=gate.pool, held=held, nbytes=notice.staging_bytes, blocks=tuple(blocks), notice=notice)
        back = self._back(landing)
        if not gate.claim(key):
            return False
        # (Claimed: from here on the part is this thread's, and its outcome reaches the loop whatever happens.)
        self._start(ReceivingPart(rank, landing, time.monotonic(), back, off_loop=True))
        return True

    def _back(self, landing: Landing) -> tuple[str, peer_pb2.ReturnedCredit, StagingPool | None] | None:
        """Where a packed part's range goes back once it is scattered (None: a staged part's reservation)."""
        held = landing.held
        peer = self._peers.by_id.get(held.sender) if isinstance(held, CreditRange) else None
        if peer is None or peer.agent_name is None:
            return None
        assert isinstance(held, CreditRange)
        kind, device = landing.pool
        return peer.agent_name, returned_credit(kind, device, held), self._pools.pool("receive", kind, device)

    def _start(self, part: ReceivingPart) -> None:
        inbox = self._dataplane.inbox
        try:
            self._copies.scatter_then(part, partial(self._on_lane, inbox))
        except Exception as exc:  # its copies could not start (the broker is stopping): it is over
            part.done(as_broker_error(exc, "starting a scatter"))
            self._on_lane(inbox, part)

    def _on_lane(self, inbox: LoopInbox, part: ReceivingPart) -> None:
        """A part's copies are over (on its lane's thread): its range goes back now,
        and the loop hears of it in its next batch."""
        part.hand_back(self._credits)
        inbox.put(partial(self._settled, part))

    def _settled(self, part: ReceivingPart) -> None:
        self._counters.packed_checksums_checked += part.checked
        self._counters.checksum_mismatches += part.mismatch
        self._counters.parts_taken_off_loop += part.off_loop
        with self._turn:
            if part.off_loop:
                self._receiver.landing.taken(part.rank, part.landing, part.error, part.handed_back)
            else:
                self._receiver.landing.scattered(part.rank, part.landing, part.error, part.handed_back)

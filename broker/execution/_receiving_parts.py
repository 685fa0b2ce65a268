"""Landed parts on the receiver: each one's life, from its notice until its range goes back.

The receiver's state machine takes a staged or packed part's notice on the
loop (``RankLanding.notices``: the rank, the source, the range in a grant or
a reservation, the blocks from the rank's own room) and asks for it to be
scattered (``Scatter``). From then on the part is a :class:`ReceivingPart`,
which owns its span, its hops' times, where its range goes back, and how it
went. It moves through:

- **noticed**: taken by the state machine, its copies handed to its lane;
- **checked**: a packed part that carries a CRC-32 (``packed_checksum``) is
  checked in a job of its own, before its scatter: a part that arrived
  corrupted is never scattered;
- **scattered**: its bytes are in the rank's pages (or its copy failed);
- **handed back**: a packed part's range of its sender's credits goes back
  to the sender from the lane's thread, in the pass that saw the scatter
  complete (a ``CreditReturn`` notification), not through the loop.

The loop hears only the outcome, in a batch (the data plane's inbox): the
counters, and ``ReceiverCore.scattered``, in a turn. A part whose copy
failed, or whose range could not go back from the lane (the data plane is
stopping), has its range handed back by the state machine instead.
"""

from __future__ import annotations

import threading
import time
from functools import partial

from opentelemetry.trace import Span

from kvbroker.broker import telemetry
from kvbroker.broker.dataplane import LoopInbox
from kvbroker.broker.execution._bundles import Machines, Transport
from kvbroker.broker.execution._credits import Credits, returned_credit
from kvbroker.broker.execution._staging_copies import StagingCopies
from kvbroker.broker.memory import CreditRange, StagingPool
from kvbroker.broker.rooms import Landing, Receiver, Scatter
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import KvBrokerError
from kvbroker.v1 import peer_pb2

__all__ = ["ReceivingPart", "ReceivingParts"]

#: The hops of a receiving part whose times its span carries (``kvbroker.t.<hop>``, monotonic seconds).
HOPS = ("notice", "scatter_asked", "scatter_start", "scatter_end")


class ReceivingPart:
    """One landed part from its notice until its range goes back: what it holds,
    where it is, and how it went. Made on the loop; its copies and its hand-back
    run on its lane's thread, and the loop reads it again only once it is done."""

    __slots__ = ("back", "checked", "error", "handed_back", "landing", "mismatch", "rank", "span", "state", "times")

    def __init__(
        self,
        effect: Scatter,
        notice_at: float,
        back: tuple[str, peer_pb2.ReturnedCredit, StagingPool | None] | None,
    ) -> None:
        self.rank: Receiver = effect.receiver
        self.landing: Landing = effect.landing
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
    """The landed parts being scattered (the executor's ``Scatter``). Control loop only,
    but for what a part does on its lane's thread (:meth:`_on_lane`)."""

    def __init__(
        self, *, machines: Machines, transport: Transport, copies: StagingCopies, credits: Credits, counters: Counters
    ) -> None:
        self._receiver = machines.receiver
        self._turn = machines.turn
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
        held, back = effect.landing.held, None
        peer = self._peers.by_id.get(held.sender) if isinstance(held, CreditRange) else None
        if peer is not None and peer.agent_name is not None:
            assert isinstance(held, CreditRange)
            kind, device = effect.landing.pool
            back = (peer.agent_name, returned_credit(kind, device, held), self._pools.pool("receive", kind, device))
        part = ReceivingPart(effect, notice_at, back)
        self._copies.scatter_then(part, partial(self._on_lane, self._dataplane.inbox))

    def _on_lane(self, inbox: LoopInbox, part: ReceivingPart) -> None:
        """A part's copies are over (on its lane's thread): its range goes back now,
        and the loop hears of it in its next batch."""
        part.hand_back(self._credits)
        inbox.put(partial(self._settled, part))

    def _settled(self, part: ReceivingPart) -> None:
        self._counters.packed_checksums_checked += part.checked
        self._counters.checksum_mismatches += part.mismatch
        with self._turn:
            self._receiver.scattered(part.rank, part.landing, part.error, part.handed_back)

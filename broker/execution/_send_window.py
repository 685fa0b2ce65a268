"""The sender's window on the wire: the bytes of parts written straight
between engines' pages (and staged ones) that are posted to NIXL and not
settled are bounded (``BrokerConfig.send_window_bytes``). The queue stays
here, where it can be ordered (``scheduling``: class, deadline, fair shares
between engines, arrival): once posted, a write goes through NIXL first come,
first served, so an interactive room's part posted behind a bulk room's
would wait for every byte posted before it."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvbroker.broker.dataplane import Posting
from kvbroker.broker.rooms import FAILED, Part, Source
from kvbroker.broker.scheduling import FairQueue, Priority, Ticket
from kvbroker.broker.telemetry import QueueObserver
from kvbroker.errors import FailedPrecondition, KvBrokerError

__all__ = ["SendWindow"]


class SendWindow:
    """Posts within the window now; queues the rest by ticket. Control loop only."""

    def __init__(
        self,
        limit_bytes: int,
        post: Callable[[Posting], None],
        fail: Callable[[Part, KvBrokerError], None],
        *,
        waited: Callable[[Part, float, str], None],
        observer: QueueObserver | None = None,
    ) -> None:
        self._limit = limit_bytes
        self._post = post
        self._fail = fail
        #: Told of a part that waited: how long, and behind what (when it was queued).
        self._waited = waited
        #: Queued postings: when, and what was ahead of them then.
        self._queued: dict[Posting, tuple[float, str]] = {}
        self._waiting: FairQueue[Posting] = FairQueue(observer=observer)
        #: Posted parts' bytes, until they settle.
        self._posted: dict[Part, int] = {}
        self.posted_bytes = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def post(self, posting: Posting) -> None:
        """Post ``posting`` (its token is its part) now if the window has room
        (or nothing is posted: a part larger than the window goes alone), else
        queue it."""
        if not self._limit or (not self._waiting and (not self._posted or self.posted_bytes + posting.nbytes <= self._limit)):
            self._send(posting)
        else:
            behind = f"{len(self._posted)} parts ({self.posted_bytes} bytes) posted, {len(self._waiting)} queued"
            self._queued[posting] = (time.monotonic(), behind)
            self._waiting.push(posting, posting.ticket or Ticket(Priority.STANDARD, "", posting.nbytes))

    def settled(self, part: Part) -> None:
        """A part settled: its bytes leave the window, the next ones go."""
        nbytes = self._posted.pop(part, None)
        if nbytes is None:
            return
        self.posted_bytes -= nbytes
        dropped: list[Part] = []
        while (head := self._waiting.peek()) is not None:
            if head.token.source.state == FAILED:
                self._waiting.pop()
                self._queued.pop(head, None)
                dropped.append(head.token)
                continue
            if self._posted and self.posted_bytes + head.nbytes > self._limit:
                break
            self._waiting.pop()
            self._send(head)
        for failed in dropped:
            self._fail(failed, FailedPrecondition("the room failed before its part was posted"))

    def drop(self, source: Source) -> None:
        """``source``'s room ended: its parts still queued fail now (they free their place)."""
        mine = [p for p in self._waiting if p.token.source is source]
        for posting in mine:
            self._waiting.remove(posting)
            self._queued.pop(posting, None)
        for posting in mine:
            self._fail(posting.token, FailedPrecondition("the room ended before its part was posted"))

    def _send(self, posting: Posting) -> None:
        queued = self._queued.pop(posting, None)
        if queued is not None:
            self._waited(posting.token, time.monotonic() - queued[0], queued[1])
        if self._limit:
            self._posted[posting.token] = posting.nbytes
            self.posted_bytes += posting.nbytes
        self._post(posting)

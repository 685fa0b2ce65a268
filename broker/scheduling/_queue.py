"""The broker's one ordering structure for waiting work: :class:`FairQueue`.

Every queue of the broker that holds work for rooms (transfers) orders it the
same way. A room carries a priority class (:class:`Priority`, from the wire
value by :func:`priority_of`) and an optional deadline; the work it puts in a
queue carries a :class:`Ticket` with those, the engine it belongs to (the unit
of fair shares) and the bytes it moves when served (its cost). The queue
serves, in this order of rules:

1. **Class.** The highest class that has waiting items, unless rule 2 says
   otherwise.
2. **Floor share.** A lower class that waits is guaranteed at least
   ``floor_share`` of the bytes served while it waits: for each class the
   queue keeps the bytes served to all classes since the class last went from
   empty to non-empty (``since``) and the bytes served to the class itself in
   that time (``own``); when a waiting class below the top one has
   ``own < floor_share * since``, the lowest such class is served instead.
   Both counters start again when the class empties. ``floor_share=0`` is
   strict priority.
3. **Deadline.** Within the class, items with a deadline come before items
   without one, earliest deadline first (ties: arrival).
4. **Fair shares.** Items without a deadline are shared between engines by
   start-time fair queuing on bytes: each engine of a class has a virtual
   clock, the bytes served to it in that class (deadline items included);
   the engine with the smallest clock is served (ties: the engine whose head
   item arrived first), each engine's items in arrival order.
5. **Arrival**: a sequence number given at :meth:`FairQueue.push`.

With every item in one class and one engine and no deadlines the queue is
first come, first served, which is what every queue of the broker did before
classes existed.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import time
from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvbroker.broker.telemetry import QueueObserver

__all__ = [
    "FairQueue",
    "Priority",
    "Ticket",
    "Waiter",
    "joint_ticket",
    "priority_of",
]

T = TypeVar("T", bound=Hashable)
R = TypeVar("R")


class Priority(enum.IntEnum):
    """A room's priority class; a higher value is served first."""

    BULK = 1
    STANDARD = 2
    INTERACTIVE = 3


def priority_of(value: int) -> Priority:
    """A wire value as a class: 0 (unspecified) is STANDARD, 1..3 the classes; anything else is a ValueError."""
    if value == 0:
        return Priority.STANDARD
    try:
        return Priority(value)
    except ValueError:
        raise ValueError(f"unknown priority class {value!r} (expected 0..{max(Priority)})") from None


@dataclass(frozen=True)
class Ticket:
    """What the queue orders a waiting item by.

    ``engine`` is the unit of fair shares within a class; ``nbytes`` is what
    the item moves when served (its cost: 0 is allowed and counts as 1 byte
    for shares); ``deadline`` is in ``time.monotonic()`` seconds, or None.
    """

    priority: Priority
    engine: str
    nbytes: int
    deadline: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority", Priority(self.priority))
        if self.nbytes < 0:
            raise ValueError(f"a ticket's nbytes cannot be negative (got {self.nbytes})")

    @property
    def cost(self) -> int:
        """The bytes the item counts for in shares and clocks: ``nbytes``, at least 1."""
        return max(self.nbytes, 1)


@dataclass(eq=False, slots=True)
class Waiter(Generic[R]):
    """A request waiting in a queue for room: its bytes, the future its grant goes to, and whose
    it is (a room, or None). Hashed by identity."""

    nbytes: int
    future: asyncio.Future[R]
    owner: object = None

    def __hash__(self) -> int:
        return id(self)


def joint_ticket(tickets: Iterable[Ticket | None]) -> Ticket | None:
    """One ticket for work done as one job (copies batched together): the
    most urgent class and deadline among them, the bytes of all, the engine
    of the most urgent; None where none has one."""
    given = [t for t in tickets if t is not None]
    if not given:
        return None
    first = max(given, key=lambda t: (t.priority, -(t.deadline if t.deadline is not None else float("inf"))))
    deadlines = [t.deadline for t in given if t.deadline is not None]
    return Ticket(first.priority, first.engine, sum(t.nbytes for t in given), min(deadlines) if deadlines else None)


@dataclass
class _Band(Generic[T]):
    """The waiting items of one class: a heap of those with a deadline and,
    for the others, one FIFO lane per engine with the engine's virtual clock.

    A removed deadline item stays in the heap until it reaches the top (its
    sequence number leaves ``live``); the heap is rebuilt when the stale
    entries outnumber the live ones.
    """

    count: int = 0
    since: int = 0  # bytes served to every class since this one last became non-empty
    own: int = 0  # bytes served to this class in that time
    deadlines: list[tuple[float, int, T]] = field(default_factory=list)
    live: set[int] = field(default_factory=set)
    lanes: dict[str, deque[tuple[int, T]]] = field(default_factory=dict)
    clocks: dict[str, int] = field(default_factory=dict)

    def add(self, item: T, ticket: Ticket, seq: int) -> None:
        """Queue ``item``; an engine whose lane was empty starts at the smallest active clock, or 0."""
        self.count += 1
        if ticket.deadline is not None:
            heapq.heappush(self.deadlines, (ticket.deadline, seq, item))
            self.live.add(seq)
            return
        lane = self.lanes.get(ticket.engine)
        if lane is None:
            if self.lanes:
                floor = min(self.clocks[e] for e in self.lanes)
                self.clocks[ticket.engine] = max(self.clocks.get(ticket.engine, 0), floor)
            else:
                # Nobody active: the old clocks mean nothing any more (re-base the class at 0).
                self.clocks.clear()
                self.clocks[ticket.engine] = 0
            lane = self.lanes[ticket.engine] = deque()
        lane.append((seq, item))

    def discard(self, ticket: Ticket, seq: int) -> None:
        """Take the item queued with ``ticket`` as number ``seq`` out, wherever it waits."""
        self.count -= 1
        if ticket.deadline is not None:
            self.live.discard(seq)
            if len(self.deadlines) > 2 * len(self.live) + 8:
                self.deadlines = [d for d in self.deadlines if d[1] in self.live]
                heapq.heapify(self.deadlines)
            return
        lane = self.lanes[ticket.engine]
        for i, (s, _) in enumerate(lane):
            if s == seq:
                del lane[i]
                break
        if not lane:
            self._retire(ticket.engine)

    def head(self) -> tuple[int, T] | None:
        """The (sequence number, item) this class serves next, or None if it is empty."""
        while self.deadlines and self.deadlines[0][1] not in self.live:
            heapq.heappop(self.deadlines)  # stale: removed earlier (not observable)
        if self.deadlines:
            _, seq, item = self.deadlines[0]
            return seq, item
        if not self.lanes:
            return None
        engine = min(self.lanes, key=lambda e: (self.clocks[e], self.lanes[e][0][0]))
        return self.lanes[engine][0]

    def take(self, ticket: Ticket, seq: int) -> None:
        """Serve the head (queued with ``ticket`` as ``seq``): charge its engine's clock."""
        self.count -= 1
        self.own += ticket.cost
        self.clocks[ticket.engine] = self.clocks.get(ticket.engine, 0) + ticket.cost
        if ticket.deadline is not None:
            heapq.heappop(self.deadlines)
            self.live.discard(seq)
            return
        lane = self.lanes[ticket.engine]
        lane.popleft()
        if not lane:
            self._retire(ticket.engine)

    def _retire(self, engine: str) -> None:
        """``engine``'s lane emptied: drop it, and its clock when keeping it could change nothing."""
        del self.lanes[engine]
        if not self.lanes:
            self.clocks.clear()
        elif self.clocks[engine] <= min(self.clocks[e] for e in self.lanes):
            # The smallest active clock never goes down while engines are active, so
            # this engine would come back at that clock anyway.
            del self.clocks[engine]


class FairQueue(Generic[T]):
    """Waiting items (hashable, each queued at most once) in the broker's service order.

    :meth:`peek` is the item :meth:`pop` returns; the module docstring gives
    the rules. The floor share's guarantee: while a class below the top one
    waits, the bytes served to it are at least ``floor_share`` of all bytes
    served since it began waiting, short by at most about one item of each
    class (the check runs before each item is chosen, and items are not split). ``floor_share`` must lie in
    [0, 0.5): two lower classes each get their floor, and the top class keeps
    the rest.

    Within a class, an engine that becomes active starts at the smallest
    clock of the engines already active (so an idle engine gets no burst: it
    is served at most about one item beyond its fair share) unless its own
    clock is larger (an engine that left for a while keeps what it was
    ahead by); a class with no active engine starts every clock at 0.
    Pushes and pops cost O(log n) plus the number of active engines of one
    class; :meth:`remove` is linear in the item's own engine's lane.
    """

    def __init__(self, *, floor_share: float = 0.1, observer: QueueObserver | None = None) -> None:
        if not 0.0 <= floor_share < 0.5:
            raise ValueError(f"floor_share must lie in [0, 0.5) (got {floor_share})")
        self._floor_share = floor_share
        self._bands: dict[Priority, _Band[T]] = {p: _Band() for p in Priority}
        self._entries: dict[T, tuple[Ticket, int]] = {}
        self._waiting: dict[tuple[Priority, str], tuple[int, int]] = {}
        self._seq = 0
        #: Told of every item queued, served and taken out (``telemetry.QueueStats``).
        self._observer = observer
        #: When each item was queued (with an observer).
        self._since: dict[T, float] = {}
        self._next: T | None = None
        self._next_valid = False

    def push(self, item: T, ticket: Ticket) -> None:
        """Queue ``item`` under ``ticket``; an item already queued is a ValueError."""
        if item is None:
            raise ValueError("None cannot be queued (peek answers None for an empty queue)")
        if item in self._entries:
            raise ValueError(f"{item!r} is already queued")
        self._seq += 1
        band = self._bands[ticket.priority]
        if band.count == 0:
            band.since = band.own = 0
        band.add(item, ticket, self._seq)
        self._entries[item] = (ticket, self._seq)
        self._count(ticket, +1)
        self._next_valid = False
        if self._observer is not None:
            self._since[item] = time.monotonic()
            self._observer.queued(ticket.priority, ticket.engine)

    def remove(self, item: T) -> bool:
        """Take a waiting ``item`` out (its room aborted or failed); True if it was queued."""
        entry = self._entries.pop(item, None)
        if entry is None:
            return False
        ticket, seq = entry
        self._bands[ticket.priority].discard(ticket, seq)
        self._gone(item, ticket)
        if self._observer is not None:
            self._observer.left(ticket.priority, ticket.engine)
        return True

    def peek(self) -> T | None:
        """The item :meth:`pop` would return now, or None when nothing waits; changes nothing."""
        if not self._next_valid:
            band = self._chosen_band()
            head = band.head() if band is not None else None
            self._next = head[1] if head is not None else None
            self._next_valid = True
        return self._next

    def pop(self) -> T:
        """Take out and return the next item (IndexError when nothing waits), and account for its bytes."""
        item = self.peek()
        if item is None:
            raise IndexError("pop from an empty FairQueue")
        ticket, seq = self._entries.pop(item)
        for band in self._bands.values():
            if band.count:
                band.since += ticket.cost
        self._bands[ticket.priority].take(ticket, seq)
        waited = self._gone(item, ticket)
        if self._observer is not None and waited is not None:
            self._observer.served(ticket.priority, ticket.engine, ticket.nbytes, waited)
        return item

    def _gone(self, item: T, ticket: Ticket) -> float | None:
        """``item`` left its band: the class's counters start again if it emptied; how long it
        waited (None without an observer)."""
        band = self._bands[ticket.priority]
        if band.count == 0:
            band.since = band.own = 0
        self._count(ticket, -1)
        self._next_valid = False
        since = self._since.pop(item, None)
        return time.monotonic() - since if since is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item: object) -> bool:
        return item in self._entries

    def __iter__(self) -> Iterator[T]:
        """The waiting items, in no particular order (a snapshot: the queue may change meanwhile)."""
        return iter(list(self._entries))

    def ticket(self, item: T) -> Ticket:
        """The ticket ``item`` waits under (KeyError if it is not queued)."""
        return self._entries[item][0]

    def waiting(self) -> dict[tuple[Priority, str], tuple[int, int]]:
        """(class, engine) -> (items waiting, bytes waiting), for the pairs with items waiting."""
        return dict(self._waiting)

    def _chosen_band(self) -> _Band[T] | None:
        """The class served next: the lowest waiting class below the top one short of its floor share, else the top one."""
        waiting = [p for p in sorted(Priority) if self._bands[p].count]
        if not waiting:
            return None
        for p in waiting[:-1]:
            band = self._bands[p]
            if band.since > 0 and band.own < self._floor_share * band.since:
                return band
        return self._bands[waiting[-1]]

    def _count(self, ticket: Ticket, sign: int) -> None:
        key = (ticket.priority, ticket.engine)
        items, nbytes = self._waiting.get(key, (0, 0))
        items, nbytes = items + sign, nbytes + sign * ticket.nbytes
        if items:
            self._waiting[key] = (items, nbytes)
        else:
            self._waiting.pop(key, None)

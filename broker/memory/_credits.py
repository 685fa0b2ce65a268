"""Receive credits: room in a receiving broker's transfer buffer, granted to a sending broker.

A packed part needs a slot in the receiver's transfer buffer before its
write. Asking for each (``ReserveStaging``) cost a gRPC round trip per part
on both brokers. Instead the receiver grants each sending peer room in a
receive buffer in bulk (``PeerBroker.GrantCredits``: a reservation of its
pool, made first come first served like any other), and the sender places
its parts in its grants itself. The receiver hands each part's range back
once it scattered (or dropped) the part (a ``CreditReturn`` notification),
and the sender writes the next part there: in steady state a part takes no
call before its write.

Two books, no I/O (the execution layer does the calls):

- :class:`CreditLedger`, the receiver's: which grants each peer holds, and
  whether a part's range lies in one of them;
- :class:`CreditWindow`, the sender's, per (peer, receive buffer): its grants,
  which ranges parts hold (each placement has an id the receiver names when
  it hands the range back: a stale return is ignored), and which grants are
  wholly free (to give back: idle, or the receiver said others wait).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from kvbroker.broker.memory._staging import FreeList, TransferSlot

__all__ = ["Credit", "CreditLedger", "CreditRange", "CreditWindow", "Grant"]

#: A transfer buffer by (memory kind, device).
PoolKey = tuple[int, int]

_ids = itertools.count(1)


@dataclass(frozen=True)
class Grant:
    """Room in one receive buffer, granted to one sending peer."""

    grant_id: str
    peer: str
    pool: PoolKey
    slot: TransferSlot


class CreditLedger:
    """The receiver's grants, by peer. Changed on the control loop only; read
    (:meth:`holds`) on the data-plane thread too: a peer's grants are replaced,
    never changed in place, so a reader sees them before or after a change."""

    def __init__(self) -> None:
        self._by_peer: dict[str, dict[str, Grant]] = {}

    def add(self, grant: Grant) -> None:
        self._by_peer[grant.peer] = {**self._by_peer.get(grant.peer, {}), grant.grant_id: grant}

    def take(self, peer: str, grant_id: str) -> Grant | None:
        """Remove and return one grant of ``peer`` (None if it has no such grant)."""
        grants = dict(self._by_peer.get(peer, {}))
        grant = grants.pop(grant_id, None)
        if grants:
            self._by_peer[peer] = grants
        else:
            self._by_peer.pop(peer, None)
        return grant

    def drop_peer(self, peer: str) -> list[Grant]:
        """Every grant of ``peer`` (lost, or restarted), removed."""
        return list(self._by_peer.pop(peer, {}).values())

    def holds(self, peer: str, pool: PoolKey, offset: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``offset`` of receive buffer ``pool`` lie in one of ``peer``'s grants."""
        return any(
            g.pool == pool and g.slot.offset <= offset and offset + nbytes <= g.slot.offset + g.slot.nbytes
            for g in self._by_peer.get(peer, {}).values()
        )

    def peers(self) -> set[str]:
        """Peers holding grants here."""
        return set(self._by_peer)

    def any_granted(self) -> bool:
        """Whether a peer holds a grant here (it may write into it at any moment)."""
        return any(self._by_peer.values())

    def granted_bytes(self) -> int:
        return sum(g.slot.nbytes for grants in self._by_peer.values() for g in grants.values())


@dataclass(frozen=True)
class Credit:
    """A part's range in a grant, as its sender placed it: where it writes, and
    the id the receiver returns it by."""

    credit_id: int
    offset: int
    nbytes: int
    grant_id: str


@dataclass(frozen=True, slots=True)
class CreditRange:
    """The same range as the receiver holds it, from a part's notice until the
    part is scattered or dropped: it belongs to ``sender``'s grant, so it goes
    back to that sender (a ``CreditReturn`` naming ``credit_id``), never to the
    receive buffer's free list."""

    offset: int
    nbytes: int
    sender: str
    credit_id: int


@dataclass
class _WindowGrant:
    offset: int
    nbytes: int
    free: FreeList
    #: When the grant last became wholly free (or was granted).
    idle_since: float = field(default_factory=time.monotonic)


class CreditWindow:
    """The sender's grants in one receive buffer of one peer, and the parts
    placed in them. Control loop only."""

    def __init__(self) -> None:
        self._grants: dict[str, _WindowGrant] = {}
        #: Placed parts by offset: their credit.
        self._placed: dict[int, Credit] = {}
        #: Grants to give back once wholly free: no part is placed in them any more.
        self._retiring: set[str] = set()

    @property
    def granted_bytes(self) -> int:
        return sum(g.nbytes for g in self._grants.values())

    @property
    def placed(self) -> int:
        """Parts placed and not handed back."""
        return len(self._placed)

    def add_grant(self, grant_id: str, offset: int, nbytes: int) -> None:
        self._grants[grant_id] = _WindowGrant(offset, nbytes, FreeList([(offset, nbytes)]))

    def free_bytes(self) -> int:
        """Bytes free in the grants parts may still be placed in."""
        return sum(g.free.free_bytes() for gid, g in self._grants.items() if gid not in self._retiring)

    def place(self, nbytes: int, keep: int = 0) -> Credit | None:
        """Room for a part of ``nbytes`` in the first grant that has it, or None
        (also where it would leave less than ``keep`` bytes free: room kept for
        the parts of classes above bulk)."""
        if keep and self.free_bytes() - FreeList.aligned(nbytes) < keep:
            return None
        for grant_id, grant in self._grants.items():
            if grant_id in self._retiring:
                continue
            offset = grant.free.take(nbytes)
            if offset is not None:
                credit = Credit(next(_ids), offset, FreeList.aligned(nbytes), grant_id)
                self._placed[offset] = credit
                return credit
        return None

    def give_back(self, offset: int, credit_id: int) -> bool:
        """The range of the part ``credit_id`` at ``offset`` is free again (the
        receiver scattered it, or the part never reached it). False, and
        nothing changes, if no such part is placed there (a stale return)."""
        credit = self._placed.get(offset)
        if credit is None or credit.credit_id != credit_id:
            return False
        del self._placed[offset]
        grant = self._grants.get(credit.grant_id)
        if grant is not None:
            grant.free.give(credit.offset, credit.nbytes)
            if grant.free.free_bytes() == grant.nbytes:
                grant.idle_since = time.monotonic()
        return True

    def retire_all(self) -> None:
        """Place no more parts in the grants held now (the receiver said others
        wait): each goes back once wholly free (:meth:`free_grants`)."""
        self._retiring.update(self._grants)

    def free_grants(self, idle_seconds: float) -> list[str]:
        """Grants to give back: wholly free and retired, or wholly free for at
        least ``idle_seconds``."""
        now = time.monotonic()
        return [
            grant_id
            for grant_id, g in self._grants.items()
            if g.free.free_bytes() == g.nbytes and (grant_id in self._retiring or now - g.idle_since >= idle_seconds)
        ]

    def remove_grant(self, grant_id: str) -> None:
        """Forget a grant (given back): it must be wholly free."""
        self._grants.pop(grant_id, None)
        self._retiring.discard(grant_id)

    def grant_ids(self) -> list[str]:
        return list(self._grants)

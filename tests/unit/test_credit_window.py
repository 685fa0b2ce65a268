"""The books of receive credits (``broker/memory/_credits.py``): the sender's window and the receiver's ledger."""

from __future__ import annotations

import time

from kvbroker.broker.memory import CreditLedger, CreditWindow, Grant, TransferSlot


def test_a_window_places_parts_in_its_grants_and_ignores_a_stale_return() -> None:
    """Parts go first fit into the grants (4 KiB aligned); a range comes back only under the id
    of the part placed there now: the return of a part whose range was freed and placed again
    (its write failed, the receiver still handed it back) changes nothing."""
    window = CreditWindow()
    assert window.place(100) is None, "no grant, no room"
    window.add_grant("g1", 1 << 20, 16 << 10)
    a, b = window.place(5000), window.place(8192)
    assert a is not None and b is not None
    assert (a.offset, a.nbytes, b.offset) == (1 << 20, 8192, (1 << 20) + 8192)
    assert window.place(4096) is None, "16 KiB granted, all placed"
    assert window.give_back(a.offset, a.credit_id)
    c = window.place(4096)
    assert c is not None and c.offset == a.offset
    assert not window.give_back(a.offset, a.credit_id), "a stale return: the range holds another part now"
    assert window.placed == 2
    assert window.free_grants(0.0) == []
    assert window.give_back(b.offset, b.credit_id) and window.give_back(c.offset, c.credit_id)
    assert window.free_grants(3600.0) == [] and window.free_grants(0.0) == ["g1"]


def test_a_draining_window_places_nothing_more_and_gives_each_grant_back_once_empty() -> None:
    """A draining window places no new part; each grant goes back once it is wholly free (an empty one at once); a
    grant added after is not draining."""
    window = CreditWindow()
    window.add_grant("g1", 0, 8192)
    window.add_grant("g2", 8192, 8192)
    part = window.place(8192)
    assert part is not None and part.grant_id == "g1"
    window.retire_all()
    assert window.place(4096) is None, "no new part in a draining grant"
    assert window.free_grants(3600.0) == ["g2"], "a wholly free draining grant goes back at once"
    window.remove_grant("g2")
    assert window.give_back(part.offset, part.credit_id)
    assert window.free_grants(3600.0) == ["g1"]
    window.remove_grant("g1")
    assert window.granted_bytes == 0
    window.add_grant("g3", 0, 8192)
    assert window.place(4096) is not None, "a new grant is not draining"


def test_a_grant_goes_back_after_being_idle() -> None:
    """A free grant goes back once it has been idle longer than the bound, not before."""
    window = CreditWindow()
    window.add_grant("g", 0, 4096)
    assert window.free_grants(0.05) == []
    time.sleep(0.06)
    assert window.free_grants(0.05) == ["g"]


def test_the_ledger_knows_each_peers_grants() -> None:
    """The credit ledger says whether a peer holds a range of a pool through its grants (not another peer's, not past
    a grant), hands each grant out once, and drops a peer's grants with it."""
    ledger = CreditLedger()
    ledger.add(Grant("a", "p1", (2, 0), TransferSlot(0, 8192)))
    ledger.add(Grant("b", "p1", (2, 1), TransferSlot(0, 8192)))
    ledger.add(Grant("c", "p2", (2, 0), TransferSlot(8192, 8192)))
    assert ledger.holds("p1", (2, 0), 4096, 4096) and not ledger.holds("p1", (2, 0), 4096, 8192)
    assert not ledger.holds("p2", (2, 0), 0, 4096), "another peer's grant"
    assert not ledger.holds("p1", (2, 0), 8192, 4096)
    assert ledger.holds("p1", (2, 1), 0, 8192), "the grant of that pool"
    assert ledger.granted_bytes() == 3 * 8192 and ledger.peers() == {"p1", "p2"}
    assert ledger.take("p1", "c") is None, "not p1's"
    assert ledger.take("p1", "a") is not None and ledger.take("p1", "a") is None
    assert [g.grant_id for g in ledger.drop_peer("p1")] == ["b"]
    assert ledger.peers() == {"p2"}


def test_a_window_keeps_room_that_bulk_parts_may_not_take() -> None:
    """``place(..., keep)`` leaves ``keep`` bytes of the window free (a bulk part's: the room kept
    for classes above it); without a keep the same part fits."""
    window = CreditWindow()
    window.add_grant("g1", 0, 4 * 4096)
    assert all(window.place(4096, keep=4096) for _ in range(3))
    assert window.free_bytes() == 4096
    assert window.place(4096, keep=4096) is None, "it would take the kept room"
    assert window.place(4096) is not None, "a part of a class above bulk takes it"

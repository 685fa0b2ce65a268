"""The service order of waiting work (``kvbroker.broker.scheduling``): classes, deadlines, fair shares, floor shares."""

from __future__ import annotations

import pytest

from kvbroker.broker.scheduling import FairQueue, Priority, Ticket, priority_of

MIB = 1 << 20
KIB = 1 << 10


def drain(queue: FairQueue[str]) -> list[str]:
    """Every item, in the order the queue serves them."""
    out = []
    while queue:
        out.append(queue.pop())
    return out


def test_unspecified_class_is_standard_and_wire_values_map_to_classes() -> None:
    """0 on the wire is STANDARD; 1..3 are the classes; anything else is refused."""
    assert priority_of(0) is Priority.STANDARD
    assert [priority_of(v) for v in (1, 2, 3)] == [Priority.BULK, Priority.STANDARD, Priority.INTERACTIVE]
    for bad in (-1, 4, 99):
        with pytest.raises(ValueError):
            priority_of(bad)
    assert Ticket(priority_of(0), "e", 1).priority is Priority.STANDARD
    with pytest.raises(ValueError):
        Ticket(Priority.BULK, "e", -1)
    with pytest.raises(ValueError):
        FairQueue(floor_share=-0.1)
    with pytest.raises(ValueError):
        FairQueue(floor_share=0.5)


def test_one_class_one_engine_no_deadlines_is_first_come_first_served() -> None:
    """Today's behaviour: whatever the sizes, items come out in the order they went in."""
    queue: FairQueue[str] = FairQueue()
    names = [f"room-{i}" for i in range(100)]
    for i, name in enumerate(names):
        queue.push(name, Ticket(priority_of(0), "engine", (i * 7919) % (3 * MIB)))
        if i % 10 == 9:  # interleave pops with pushes: still FIFO
            assert queue.pop() == names[i // 10]
    assert drain(queue) == names[10:]
    assert queue.peek() is None
    with pytest.raises(IndexError):
        queue.pop()


def test_a_higher_class_pushed_later_is_served_first() -> None:
    """The class order alone (no floor share: with one, BULK would be due right after the first item)."""
    queue: FairQueue[str] = FairQueue(floor_share=0.0)
    queue.push("bulk", Ticket(Priority.BULK, "e", MIB))
    queue.push("standard", Ticket(Priority.STANDARD, "e", MIB))
    queue.push("interactive", Ticket(Priority.INTERACTIVE, "e", MIB))
    queue.push("standard-2", Ticket(Priority.STANDARD, "e", MIB))
    assert drain(queue) == ["interactive", "standard", "standard-2", "bulk"]
    queue = FairQueue()  # the default floor share: the higher class still goes first
    queue.push("bulk", Ticket(Priority.BULK, "e", MIB))
    queue.push("interactive", Ticket(Priority.INTERACTIVE, "e", MIB))
    assert queue.pop() == "interactive"


def test_deadline_items_come_first_in_their_class_earliest_first() -> None:
    """Deadlines before no deadline, earliest first, ties by arrival; deadlines do not cross classes."""
    queue: FairQueue[str] = FairQueue(floor_share=0.0)
    queue.push("plain-1", Ticket(Priority.STANDARD, "a", MIB))
    queue.push("late", Ticket(Priority.STANDARD, "b", MIB, deadline=30.0))
    queue.push("plain-2", Ticket(Priority.STANDARD, "a", MIB))
    queue.push("early", Ticket(Priority.STANDARD, "a", MIB, deadline=10.0))
    queue.push("tie-first", Ticket(Priority.STANDARD, "b", MIB, deadline=20.0))
    queue.push("tie-second", Ticket(Priority.STANDARD, "a", MIB, deadline=20.0))
    queue.push("bulk-urgent", Ticket(Priority.BULK, "a", MIB, deadline=1.0))
    queue.push("interactive", Ticket(Priority.INTERACTIVE, "c", MIB))
    assert drain(queue) == ["interactive", "early", "tie-first", "tie-second", "late", "plain-1", "plain-2", "bulk-urgent"]


def test_two_backlogged_engines_share_bytes_evenly_whatever_their_item_sizes() -> None:
    """Engine A moves 1 MiB items, B 256 KiB ones, both always backlogged: every 64 MiB window is about half each."""
    queue: FairQueue[str] = FairQueue()
    size = {"A": MIB, "B": 256 * KIB}
    counter = 0

    def refill(engine: str) -> None:
        nonlocal counter
        counter += 1
        queue.push(f"{engine}-{counter}", Ticket(Priority.STANDARD, engine, size[engine]))

    for _ in range(8):
        refill("A")
        refill("B")
    served = {"A": 0, "B": 0}
    windows = 0
    while windows < 16:  # 1 GiB in all
        engine = queue.pop().split("-")[0]
        served[engine] += size[engine]
        refill(engine)
        total = served["A"] + served["B"]
        if total >= 64 * MIB:
            for e in served:
                assert 0.425 <= served[e] / total <= 0.575, (windows, served)
            served = {"A": 0, "B": 0}
            windows += 1


def test_an_engine_that_joins_late_gets_no_burst() -> None:
    """A has been served alone for a long time; B joins: B is served at once, never more than one item ahead of A."""
    queue: FairQueue[str] = FairQueue()
    for i in range(400):
        queue.push(f"A-{i}", Ticket(Priority.STANDARD, "A", MIB))
    for _ in range(100):
        queue.pop()
    for i in range(200):
        queue.push(f"B-{i}", Ticket(Priority.STANDARD, "B", 512 * KIB))
    size = {"A": MIB, "B": 512 * KIB}
    served = {"A": 0, "B": 0}
    order = []
    for _ in range(200):
        item = queue.pop()
        engine = item.split("-")[0]
        order.append(engine)
        served[engine] += size[engine]
        assert served["B"] - served["A"] <= MIB, served
        assert served["A"] - served["B"] <= MIB, served
    assert "B" in order[:2]


def test_an_engine_that_left_ahead_keeps_its_lead_when_it_comes_back() -> None:
    """B took 10 MiB at once and left while A kept going; back at once, B waits until A has caught up."""
    queue: FairQueue[str] = FairQueue()
    queue.push("B-big", Ticket(Priority.STANDARD, "B", 10 * MIB))
    for i in range(30):
        queue.push(f"A-{i}", Ticket(Priority.STANDARD, "A", MIB))
    assert queue.pop() == "B-big"  # clocks equal: B's head arrived first
    assert queue.pop() == "A-0"
    for i in range(5):
        queue.push(f"B-{i}", Ticket(Priority.STANDARD, "B", MIB))
    order = [queue.pop() for _ in range(12)]
    assert order[:9] == [f"A-{i}" for i in range(1, 10)]
    assert "B-0" in order[9:]


def test_the_clocks_of_a_class_start_again_when_it_empties() -> None:
    """Once a class has emptied, an engine that was far ahead before is not held back."""
    queue: FairQueue[str] = FairQueue()
    queue.push("B-big", Ticket(Priority.STANDARD, "B", 100 * MIB))
    queue.pop()
    queue.push("A-0", Ticket(Priority.STANDARD, "A", MIB))
    queue.push("B-0", Ticket(Priority.STANDARD, "B", MIB))
    queue.push("A-1", Ticket(Priority.STANDARD, "A", MIB))
    queue.push("B-1", Ticket(Priority.STANDARD, "B", MIB))
    assert drain(queue) == ["A-0", "B-0", "A-1", "B-1"]


def floor_run(floor_share: float, bulk_items: int) -> list[str]:
    """INTERACTIVE always backlogged (1 MiB items), ``bulk_items`` BULK items of 1 MiB waiting from the start.

    Returns the classes served ("i" or "b"), in order, until BULK has emptied or 2000 items were served.
    """
    queue: FairQueue[str] = FairQueue(floor_share=floor_share)
    counter = 0

    def push_interactive() -> None:
        nonlocal counter
        counter += 1
        queue.push(f"i-{counter}", Ticket(Priority.INTERACTIVE, "hot", MIB))

    for i in range(bulk_items):
        queue.push(f"b-{i}", Ticket(Priority.BULK, "cold", MIB))
    for _ in range(4):
        push_interactive()
    served: list[str] = []
    while queue.waiting().get((Priority.BULK, "cold")) and len(served) < 2000:
        item = queue.pop()
        served.append(item[0])
        if item[0] == "i":
            push_interactive()
    return served


def test_a_lower_class_gets_its_floor_share_under_a_sustained_higher_load() -> None:
    """With floor_share=0.1 BULK gets 9..20% of the bytes while INTERACTIVE stays backlogged, and all of it is served."""
    served = floor_run(0.1, bulk_items=50)
    assert served.count("b") == 50
    assert 0.09 <= served.count("b") / len(served) <= 0.2
    # Checked over every prefix of 100 items too: the share holds all along, not only on average.
    for end in range(100, len(served), 100):
        assert 0.09 <= served[:end].count("b") / end <= 0.2


def test_with_no_floor_share_a_lower_class_waits_until_the_higher_one_is_empty() -> None:
    """With no floor share a lower class is served only once the higher one is empty."""
    served = floor_run(0.0, bulk_items=5)
    assert served == ["i"] * 2000
    queue: FairQueue[str] = FairQueue(floor_share=0.0)
    for i in range(3):
        queue.push(f"b-{i}", Ticket(Priority.BULK, "cold", MIB))
        queue.push(f"i-{i}", Ticket(Priority.INTERACTIVE, "hot", MIB))
    assert drain(queue) == ["i-0", "i-1", "i-2", "b-0", "b-1", "b-2"]


def test_two_lower_classes_each_get_their_floor_share() -> None:
    """BULK and STANDARD both waiting under a backlogged INTERACTIVE class: each gets about floor_share."""
    queue: FairQueue[str] = FairQueue(floor_share=0.1)
    for i in range(1000):
        queue.push(f"b-{i}", Ticket(Priority.BULK, "x", MIB))
        queue.push(f"s-{i}", Ticket(Priority.STANDARD, "x", MIB))
        queue.push(f"i-{i}", Ticket(Priority.INTERACTIVE, "x", MIB))
    served = [queue.pop()[0] for _ in range(1000)]
    for cls in "bs":
        assert 0.09 <= served.count(cls) / len(served) <= 0.2, (cls, served.count(cls))
    assert served.count("i") >= 600


def test_remove_frees_the_items_place() -> None:
    """Removing an item takes it out of the queue and its counts (the head too, so the next changes); removing one not
    queued answers False."""
    queue: FairQueue[str] = FairQueue()
    queue.push("a", Ticket(Priority.STANDARD, "e", 100))
    queue.push("b", Ticket(Priority.STANDARD, "e", 200))
    queue.push("c", Ticket(Priority.STANDARD, "f", 300, deadline=5.0))
    queue.push("d", Ticket(Priority.STANDARD, "f", 400))
    assert queue.peek() == "c"
    assert queue.remove("c") is True
    assert "c" not in queue and len(queue) == 3
    assert queue.peek() == "a"  # removing the head changes what comes next
    assert queue.remove("b") is True
    assert queue.waiting() == {(Priority.STANDARD, "e"): (1, 100), (Priority.STANDARD, "f"): (1, 400)}
    assert queue.remove("b") is False
    assert queue.remove("never-queued") is False
    assert drain(queue) == ["a", "d"]
    assert queue.waiting() == {}


def test_a_removed_item_may_be_queued_again_but_never_twice_at_once() -> None:
    """An item may not be queued twice at once; removed, it may be queued again, and only its new ticket counts."""
    queue: FairQueue[str] = FairQueue()
    queue.push("a", Ticket(Priority.BULK, "e", 1, deadline=1.0))
    with pytest.raises(ValueError):
        queue.push("a", Ticket(Priority.INTERACTIVE, "e", 1))
    assert queue.ticket("a") == Ticket(Priority.BULK, "e", 1, deadline=1.0)
    queue.remove("a")
    queue.push("b", Ticket(Priority.BULK, "e", 1, deadline=2.0))
    queue.push("a", Ticket(Priority.BULK, "e", 1, deadline=3.0))  # its old heap entry must not count
    assert drain(queue) == ["b", "a"]
    with pytest.raises(KeyError):
        queue.ticket("a")


def test_many_removed_deadline_items_leave_nothing_behind() -> None:
    """Many removed deadline items leave nothing behind: the rest come out in deadline order."""
    queue: FairQueue[str] = FairQueue()
    for i in range(500):
        queue.push(f"d-{i}", Ticket(Priority.STANDARD, "e", 1, deadline=float(i)))
    for i in range(0, 500, 2):
        queue.remove(f"d-{i}")
    assert drain(queue) == [f"d-{i}" for i in range(1, 500, 2)]


def test_peek_is_stable_and_pop_returns_what_peek_said() -> None:
    """Over a mixed workload, peek twice gives the same item, and pop gives it."""
    queue: FairQueue[str] = FairQueue()
    classes = list(Priority)
    for i in range(300):
        deadline = float(i % 7) if i % 5 == 0 else None
        queue.push(f"x-{i}", Ticket(classes[i % 3], f"e{i % 4}", (i % 9) * 100 * KIB, deadline=deadline))
    assert sorted(queue) == sorted(f"x-{i}" for i in range(300))
    while queue:
        first = queue.peek()
        assert queue.peek() == first
        assert first in queue
        assert queue.pop() == first
    assert queue.peek() is None


def test_waiting_reports_items_and_bytes_per_class_and_engine() -> None:
    """waiting reports the items and bytes queued per class and engine, as a copy the caller may change."""
    queue: FairQueue[str] = FairQueue()
    queue.push("a", Ticket(Priority.STANDARD, "e1", 100))
    queue.push("b", Ticket(Priority.STANDARD, "e1", 50, deadline=1.0))
    queue.push("c", Ticket(Priority.STANDARD, "e2", 0))
    queue.push("d", Ticket(Priority.BULK, "e1", 7))
    assert queue.waiting() == {
        (Priority.STANDARD, "e1"): (2, 150),
        (Priority.STANDARD, "e2"): (1, 0),
        (Priority.BULK, "e1"): (1, 7),
    }
    assert queue.pop() == "b"
    assert queue.waiting()[(Priority.STANDARD, "e1")] == (1, 100)
    snapshot = queue.waiting()
    snapshot.clear()  # a copy: the queue's counts are untouched
    assert len(queue.waiting()) == 3

"""The sender's window on the wire (``execution._send_window``): what it posts now, what waits, in
which order, and what a room's end takes out."""

from __future__ import annotations

from typing import Any

from kvbroker.broker.dataplane import Posting
from kvbroker.broker.execution._send_window import SendWindow
from kvbroker.broker.rooms import FAILED
from kvbroker.broker.scheduling import Priority, Ticket
from kvbroker.errors import KvBrokerError

MIB = 1 << 20


class _Source:
    state = 1


class _Part:
    def __init__(self, name: str, source: _Source) -> None:
        self.name, self.source = name, source


def _window(limit: int) -> tuple[SendWindow, list[str], list[tuple[str, str]]]:
    posted: list[str] = []
    failed: list[tuple[str, str]] = []

    def fail(part: Any, error: KvBrokerError) -> None:
        failed.append((part.name, error.message))

    return SendWindow(limit, lambda p: posted.append(p.token.name), fail, waited=lambda _p, _s, _b: None), posted, failed


def _posting(part: _Part, nbytes: int, priority: Priority | None = None, engine: str = "a") -> Posting:
    ticket = Ticket(priority, engine, nbytes) if priority is not None else None
    return Posting(part, lambda agent: None, "peer", nbytes, ticket)


def test_the_window_posts_up_to_its_bytes_then_serves_the_queue_by_class() -> None:
    """16 MiB of bulk parts fill the window; an interactive part that comes next waits only for the
    first part to settle, then goes before the bulk parts queued ahead of it; a part larger than the
    window goes alone once nothing is posted."""
    window, posted, _ = _window(16 * MIB)
    source = _Source()
    bulk = [_Part(f"bulk{i}", source) for i in range(6)]
    for part in bulk:
        window.post(_posting(part, 4 * MIB, Priority.BULK))
    chat = _Part("chat", source)
    window.post(_posting(chat, 64 << 10, Priority.INTERACTIVE, engine="b"))
    assert posted == ["bulk0", "bulk1", "bulk2", "bulk3"] and window.waiting == 3
    window.settled(bulk[0])  # type: ignore[arg-type]
    assert posted[4:] == ["chat"] and window.posted_bytes == 12 * MIB + (64 << 10)
    big = _Part("big", source)
    window.post(_posting(big, 64 * MIB, Priority.BULK))
    for part in [*bulk[1:4], chat]:
        window.settled(part)  # type: ignore[arg-type]
    assert posted[5:] == ["bulk4", "bulk5"]
    for part in bulk[4:]:
        window.settled(part)  # type: ignore[arg-type]
    assert posted[-1] == "big" and window.posted_bytes == 64 * MIB


def test_a_rooms_end_takes_its_queued_parts_out_and_a_failed_room_is_never_posted() -> None:
    """drop(source): the room's queued parts fail at once and free their place; a part whose room
    failed while it waited is failed, not posted, when its turn comes."""
    window, posted, failed = _window(4 * MIB)
    ended, failing, other = _Source(), _Source(), _Source()
    first = _Part("first", other)
    window.post(_posting(first, 4 * MIB))
    queued = [_Part("ended", ended), _Part("failing", failing), _Part("next", other)]
    for part in queued:
        window.post(_posting(part, 4 * MIB))
    window.drop(ended)  # type: ignore[arg-type]
    assert failed == [("ended", "the room ended before its part was posted")] and window.waiting == 2
    failing.state = FAILED
    window.settled(first)  # type: ignore[arg-type]
    assert posted == ["first", "next"] and failed[-1] == ("failing", "the room failed before its part was posted")
    assert window.waiting == 0


def test_no_window_posts_everything_at_once() -> None:
    """With no send window (0) every part is posted at once and none waits."""
    window, posted, _ = _window(0)
    source = _Source()
    for i in range(5):
        window.post(_posting(_Part(f"p{i}", source), 64 * MIB))
    assert posted == [f"p{i}" for i in range(5)] and window.waiting == 0

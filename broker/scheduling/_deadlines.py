"""Deadlines on the wire and here: milliseconds from now on the wire (no
clock is shared between hosts), ``time.monotonic()`` seconds in a broker."""

from __future__ import annotations

import time

__all__ = ["deadline_in", "deadline_ms"]


def deadline_in(milliseconds: int) -> float | None:
    """The monotonic time ``milliseconds`` from now; None for 0 (no deadline)."""
    return time.monotonic() + milliseconds / 1000 if milliseconds else None


def deadline_ms(deadline: float | None) -> int:
    """What is left of ``deadline`` in milliseconds for the wire: 0 for none,
    at least 1 for one that passed (it stays a deadline, the most urgent)."""
    if deadline is None:
        return 0
    return max(1, min(int((deadline - time.monotonic()) * 1000), 2**32 - 1))

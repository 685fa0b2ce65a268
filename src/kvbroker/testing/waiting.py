"""Waiting for a condition in tests: the one polling helper."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["eventually"]


def eventually(
    predicate: Callable[[], object],
    timeout_seconds: float = 10.0,
    *,
    interval_seconds: float = 0.01,
    describe: Callable[[], object] = lambda: "",
) -> float:
    """Call ``predicate`` every ``interval_seconds`` until it returns something true.

    Returns the seconds it took (from the call until ``predicate`` first held),
    which a test can hold against a bound. If it still does not hold after
    ``timeout_seconds``, raises :class:`AssertionError` naming the timeout and
    the text of ``describe()`` (called once, then: say what the state was).
    Exceptions from ``predicate`` propagate at once.
    """
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_seconds:
            message = f"condition not met within {timeout_seconds} s"
            detail = str(describe())
            raise AssertionError(f"{message}: {detail}" if detail else message)
        time.sleep(interval_seconds)
    return time.monotonic() - start

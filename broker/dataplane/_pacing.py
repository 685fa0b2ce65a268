"""How closely the data-plane thread polls NIXL, without a busy loop.

- Nothing in flight and no room waiting for data: the thread sleeps until
  work arrives (and once a second drains stray notifications).
- Transfers in flight, or rooms waiting for notifications (``listening``):
  it polls, sleeping between passes with a backoff that starts at
  ``MIN_WAIT_S`` and doubles up to ``MAX_WAIT_S`` while nothing happens (up
  to ``_INFLIGHT_WAIT_S`` while a transfer younger than ``_SLOW_AFTER_S`` is
  in flight: its slots are held until it is seen DONE; every ``MIN_WAIT_S``
  for its first ``_PROMPT_S`` while at most ``PROMPT_MAX`` are in flight)
  (at most ``_HURRY_WAIT_S`` for a moment after a room's registration went
  out to its sender, :meth:`Pacing.hurry`, every ``MIN_WAIT_S`` for its
  first ``_PROMPT_S`` while at most ``PROMPT_MAX`` rooms wait: its data is
  due within milliseconds)
  (``_SLOW_WAIT_S`` once every transfer in flight is older than
  ``_SLOW_AFTER_S``: a hung transfer costs a few hundred cheap checks a
  second, not a core, until the transfer timeout cancels it). Any result or
  new work resets the backoff.
- Packed parts in flight (``busy``: this broker's credits at a peer hold
  parts whose return is due, or a peer holds credits here and writes into
  them), or a device copy launched on the thread whose event it checks:
  every ``_BUSY_WAIT_S``, with no backoff, as long as it lasts (a part's
  notice, its copy's completion and its credit's return are each one hop
  of the pipeline: a 1 ms backoff there was a millisecond per part). That
  costs CPU while parts move (docs/benchmarks.md), never while idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MAX_WAIT_S", "MIN_WAIT_S", "PROMPT_MAX", "Pacing"]

MIN_WAIT_S = 50e-6
MAX_WAIT_S = 1e-3
_SLOW_WAIT_S = 5e-3
_SLOW_AFTER_S = 0.1
_IDLE_WAIT_S = 1.0
#: After a room registers its data comes within milliseconds: poll at most
#: this far apart for ``_HURRY_S`` (the backoff would have grown to 1 ms)...
_HURRY_WAIT_S = 200e-6
_HURRY_S = 0.05
#: ...and, for the first ``_PROMPT_S`` of that (and of a transfer's flight),
#: every ``MIN_WAIT_S`` with no backoff: a small room's write and notice come
#: within a millisecond or two, and a wait that grew to 200 us was a tenth of
#: such a room. Only while at most ``PROMPT_MAX`` rooms wait for data (or
#: transfers are in flight): with more, notices come often enough to reset
#: the backoff, and a 50 us poll with nothing to find cost the decode
#: broker 40% more CPU a room at 200 rooms in flight.
_PROMPT_S = 0.005
PROMPT_MAX = 4
#: While a young transfer is in flight: poll at most this far apart.
_INFLIGHT_WAIT_S = 200e-6
#: While packed parts are in flight (``busy``) or a device copy is watched:
#: poll this far apart, with no backoff.
_BUSY_WAIT_S = 100e-6


class Pacing:
    """What the data-plane thread waits for, and so how long it sleeps between
    passes. The control loop sets ``listening`` and ``busy``; ``wake`` wakes a
    thread asleep in a longer wait than it should now be."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._listening = False
        self._busy = False
        self._hurry_until = 0.0
        self._prompt_until = 0.0

    @property
    def listening(self) -> bool:
        """Whether rooms wait for notifications: poll for them."""
        return self._listening

    @listening.setter
    def listening(self, value: bool) -> None:
        if value and not self._listening:
            self._wake()
        self._listening = value

    @property
    def busy(self) -> bool:
        """Whether packed parts are in flight: poll closely, with no backoff, while they are."""
        return self._busy

    @busy.setter
    def busy(self, value: bool) -> None:
        if value and not self._busy:
            self._wake()
        self._busy = value

    def hurry(self, waiting: int = 1) -> None:
        """Data is expected soon (a room just registered with its sender): poll
        for notifications closely for a moment; at once, with no backoff, for
        the first ``_PROMPT_S`` of it if at most ``PROMPT_MAX`` rooms
        (``waiting``) wait for data."""
        now = time.monotonic()
        self._hurry_until = now + _HURRY_S
        if waiting <= PROMPT_MAX:
            self._prompt_until = now + _PROMPT_S
        self._wake()  # (and reset its backoff)

    def wait(self, backoff: float, inflight: Sequence[Any], watching: bool) -> float:
        """Seconds to sleep before the next pass: ``backoff`` as it grew, the
        transfers in flight (their ``posted_at``), whether device copies are watched."""
        if self._busy or watching:
            return _BUSY_WAIT_S
        if inflight:
            now = time.monotonic()
            if all(now - t.posted_at > _SLOW_AFTER_S for t in inflight):
                return _SLOW_WAIT_S
            # A part holds its slots until its write is seen DONE: a 1 ms
            # backoff would add up to 1 ms to every part (a 128 MiB part
            # moves in under 1 ms on a GPU).
            if len(inflight) <= PROMPT_MAX and any(now - t.posted_at < _PROMPT_S for t in inflight):
                return MIN_WAIT_S
            return min(backoff, _INFLIGHT_WAIT_S)
        if not self._listening:
            return _IDLE_WAIT_S
        now = time.monotonic()
        if now >= self._hurry_until:
            return backoff
        return MIN_WAIT_S if now < self._prompt_until else min(backoff, _HURRY_WAIT_S)

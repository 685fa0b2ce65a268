"""How closely the data-plane thread polls (``dataplane._pacing``): promptly while a small room's
write or notice is due, never busily while idle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbroker.broker.dataplane import _pacing
from kvbroker.broker.dataplane._pacing import MAX_WAIT_S, MIN_WAIT_S, PROMPT_MAX, Pacing


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(_pacing.time, "monotonic", c)
    return c


def _posted(clock: Clock, ago: float) -> SimpleNamespace:
    return SimpleNamespace(posted_at=clock.now - ago)


def test_an_idle_thread_sleeps_and_a_listening_one_backs_off(clock: Clock) -> None:
    """A data-plane thread with nothing to watch sleeps long; once listening it is woken and waits as its backoff
    grew."""
    woken: list[int] = []
    pacing = Pacing(lambda: woken.append(1))
    assert pacing.wait(MIN_WAIT_S, [], False) == _pacing._IDLE_WAIT_S
    pacing.listening = True
    assert woken == [1]
    assert pacing.wait(MAX_WAIT_S, [], False) == MAX_WAIT_S  # no hurry: the backoff as it grew


def test_a_young_write_is_checked_with_no_backoff_then_at_most_200_us_then_slowly(clock: Clock) -> None:
    """A young write is checked with no backoff (unless there are many), an older one at most every 200 us, a hung one
    slowly."""
    pacing = Pacing(lambda: None)
    young, older, old = _posted(clock, 0.001), _posted(clock, 0.02), _posted(clock, 1.0)
    assert pacing.wait(MAX_WAIT_S, [young], False) == MIN_WAIT_S
    assert pacing.wait(MAX_WAIT_S, [older, young], False) == MIN_WAIT_S  # any young one
    many = [_posted(clock, 0.001) for _ in range(PROMPT_MAX + 1)]
    assert pacing.wait(MAX_WAIT_S, many, False) == _pacing._INFLIGHT_WAIT_S  # many: their results reset the backoff
    assert pacing.wait(MAX_WAIT_S, [older], False) == _pacing._INFLIGHT_WAIT_S
    assert pacing.wait(MIN_WAIT_S * 2, [older], False) == MIN_WAIT_S * 2
    assert pacing.wait(MAX_WAIT_S, [old], False) == _pacing._SLOW_WAIT_S  # a hung write: cheap checks


def test_after_a_registration_notices_are_looked_for_at_once_then_closely_then_as_before(clock: Clock) -> None:
    """After a registration the thread is woken and looks for notices at once, then closely for a while, then as
    before."""
    woken: list[int] = []
    pacing = Pacing(lambda: woken.append(1))
    pacing.listening = True
    pacing.hurry()
    assert len(woken) == 2  # a thread asleep in a longer wait is woken
    assert pacing.wait(MAX_WAIT_S, [], False) == MIN_WAIT_S
    clock.now += _pacing._PROMPT_S + 0.001
    assert pacing.wait(MAX_WAIT_S, [], False) == _pacing._HURRY_WAIT_S
    clock.now += _pacing._HURRY_S
    assert pacing.wait(MAX_WAIT_S, [], False) == MAX_WAIT_S


def test_with_many_rooms_waiting_a_registration_hurries_without_the_prompt_phase(clock: Clock) -> None:
    """With many rooms waiting, a registration hurries the thread without the prompt phase; with one it has it."""
    pacing = Pacing(lambda: None)
    pacing.listening = True
    pacing.hurry(waiting=PROMPT_MAX + 1)
    assert pacing.wait(MAX_WAIT_S, [], False) == _pacing._HURRY_WAIT_S
    pacing.hurry(waiting=1)
    assert pacing.wait(MAX_WAIT_S, [], False) == MIN_WAIT_S


def test_packed_parts_or_watched_copies_poll_closely_with_no_backoff(clock: Clock) -> None:
    """Packed parts in flight, or copies being watched, keep the thread polling closely with no backoff."""
    pacing = Pacing(lambda: None)
    assert pacing.wait(MAX_WAIT_S, [], True) == _pacing._BUSY_WAIT_S
    pacing.busy = True
    assert pacing.wait(MAX_WAIT_S, [_posted(clock, 1.0)], False) == _pacing._BUSY_WAIT_S

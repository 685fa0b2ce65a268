"""Late callbacks: set once while a broker is built, and a clear error where one is used unset."""

from __future__ import annotations

import pytest

from kvbroker.broker.runtime import Late, LateCalls
from kvbroker.errors import Internal


def test_a_late_callback_calls_its_target_once_set() -> None:
    """Once set, calling it calls its target with the same arguments and returns what it returns."""
    late: Late[[int, str], str] = Late("Thing.call")
    late.set(lambda n, s: s * n)
    assert late.is_set and late(2, "ab") == "abab"


def test_a_late_callback_used_before_it_is_set_names_itself() -> None:
    """Calling one before it is set raises Internal naming what it should call, not AttributeError on None."""
    late: Late[[], None] = Late("Executor.on_events")
    with pytest.raises(Internal, match="Executor.on_events called before it was set"):
        late()


def test_a_late_callback_is_set_only_once() -> None:
    """A second set is a wiring mistake, not a quiet rebinding."""
    late: Late[[], int] = Late("Operators.draining")
    late.set(lambda: 1)
    with pytest.raises(Internal, match="set twice"):
        late.set(lambda: 2)
    assert late() == 1


def test_late_calls_list_what_is_not_set() -> None:
    """``LateCalls.unset`` names every callback not set yet (what Broker.start refuses to start with)."""
    late = LateCalls(on_events=Late("a"), take_notice=Late("e"), peer_restarted=Late("b"), fd_closed=Late("c"), draining=Late("d"))
    assert late.unset() == ["a", "e", "b", "c", "d"]
    late.on_events.set(lambda events: None)
    late.draining.set(lambda: False)
    late.take_notice.set(lambda agent, payload: False)
    assert late.unset() == ["b", "c"]

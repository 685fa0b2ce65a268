"""A turn: the effect loop runs once, where the outermost turn ends, and never across an await."""

from __future__ import annotations

import asyncio

import pytest

from kvbroker.broker.execution import Turn, in_turn


def _turn() -> tuple[Turn, list[str]]:
    ran: list[str] = []
    turn = Turn()
    turn.bind(lambda: ran.append("effects"))
    return turn, ran


def test_the_effects_run_once_when_the_outermost_turn_ends() -> None:
    """Nested turns run the effects once, when the outermost ends."""
    turn, ran = _turn()
    with turn:
        with turn:
            ran.append("inner")
        assert ran == ["inner"]  # an inner turn's end leaves the effects to the outer one
        ran.append("outer")
    assert ran == ["inner", "outer", "effects"]


def test_the_effects_run_when_the_entry_raises() -> None:
    """Effects an entry left before it raised are carried out, not left for the next turn."""
    turn, ran = _turn()
    with pytest.raises(ValueError), turn:
        raise ValueError("refused")
    assert ran == ["effects"]


def test_an_entry_made_while_the_effects_run_is_a_turn_of_its_own() -> None:
    """A part that fails as it is posted enters the machines again from inside the effect loop."""
    turn = Turn()
    ran: list[int] = []

    def effects() -> None:
        ran.append(len(ran))
        if len(ran) == 1:
            with turn:
                pass

    turn.bind(effects)
    with turn:
        pass
    assert ran == [0, 1]


def test_a_method_in_turn_runs_its_effects_before_it_returns() -> None:
    """A method marked in_turn runs its effects before it returns its result."""
    class Route:
        def __init__(self, turn: Turn, ran: list[str]) -> None:
            self._turn = turn
            self._ran = ran

        @in_turn
        def call(self, x: int) -> int:
            self._ran.append("call")
            return x + 1

    turn, ran = _turn()
    assert Route(turn, ran).call(1) == 2
    assert ran == ["call", "effects"]


def test_a_coroutine_cannot_be_a_turn() -> None:
    """in_turn refuses a coroutine function: a turn never spans an await."""
    with pytest.raises(TypeError, match="never spans an await"):

        class Route:
            _turn: Turn

            @in_turn  # type: ignore[type-var]
            async def call(self) -> None:
                pass


def test_a_turn_held_across_an_await_is_refused() -> None:
    """Entering a turn that another task holds across an await raises RuntimeError saying so."""
    turn, _ = _turn()

    async def main() -> None:
        opened = asyncio.Event()
        release = asyncio.Event()

        async def holder() -> None:
            with turn:
                opened.set()
                await release.wait()

        task = asyncio.create_task(holder())
        await opened.wait()
        with pytest.raises(RuntimeError, match="spans an await"), turn:
            pass
        release.set()
        await task

    asyncio.run(main())


def test_the_effect_loop_is_bound_once() -> None:
    """A turn's effect loop is bound once; a second bind raises RuntimeError."""
    turn, _ = _turn()
    with pytest.raises(RuntimeError, match="bound once"):
        turn.bind(lambda: None)

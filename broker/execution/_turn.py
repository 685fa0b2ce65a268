"""A turn: one entry into the room state machines, and the effects it left, carried out.

Every call into ``SenderCore`` or ``ReceiverCore`` is made inside a turn:
the routes (engine calls, session commands, peer requests, peer loss,
operators), the data plane's events (``Executor.on_events``), the
housekeeping timer, and the answers of the executor's own tasks (scatters,
checksums, calls to peers, registrations, parts). When the outermost turn
ends, the executor's effect loop runs (:meth:`Turn.__exit__`, the one place
that calls it), so no entry can leave effects unrun, and a route's effects
(statuses published, calls spawned, parts posted) are carried out before it
answers.

A turn is synchronous: it never spans an ``await`` (the turn of another
task would nest in it and leave its effects to it). :func:`in_turn` refuses
coroutine functions, and a turn entered by a second task while a first one's
is open is an error. The effect loop itself runs outside the turn: an entry
made while it runs (a part that fails as it is posted) is a turn of its own,
whose effects run when it ends.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from types import TracebackType
from typing import Concatenate, ParamSpec, Protocol, TypeVar

__all__ = ["Turn", "in_turn"]

P = ParamSpec("P")
R = TypeVar("R")


class Turn:
    """Nesting-aware: the effect loop runs when the outermost turn ends. Control loop only.

    Made before the executor (the routes and the executor's parts share it);
    the executor hands it its effect loop once (:meth:`bind`).
    """

    def __init__(self) -> None:
        self._effects: Callable[[], None] | None = None
        self._depth = 0
        #: The task whose turn is open (None: no running loop, or no turn open).
        self._task: asyncio.Task[object] | None = None

    def bind(self, effects: Callable[[], None]) -> None:
        """The effect loop to run when a turn ends (the executor's, once)."""
        if self._effects is not None:
            raise RuntimeError("a turn's effect loop is bound once")
        self._effects = effects

    def __enter__(self) -> Turn:
        task = _current_task()
        if self._depth == 0:
            self._task = task
        elif task is not self._task:
            raise RuntimeError("a turn spans an await: another task entered it")
        self._depth += 1
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._depth -= 1
        if self._depth:
            return
        self._task = None
        # Whatever the entry left is carried out, even if it raised: effects
        # it left before raising are not left for the next turn.
        assert self._effects is not None, "a turn ended before the executor bound its effect loop"
        self._effects()


class _HasTurn(Protocol):
    _turn: Turn


S = TypeVar("S", bound=_HasTurn)


def in_turn(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """A method that runs as a turn (``self._turn``): a route into the room state machines."""
    if inspect.iscoroutinefunction(method):
        raise TypeError(f"{method.__qualname__}: a turn never spans an await; enter it around the synchronous part")

    def wrapper(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._turn:
            return method(self, *args, **kwargs)

    functools.update_wrapper(wrapper, method)
    return wrapper


def _current_task() -> asyncio.Task[object] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop (a test driving the machines by hand)
        return None

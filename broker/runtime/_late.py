"""Callbacks into parts made later: the cycles of a broker's wiring, bound late.

A few parts report to a part that needs them, so one of the two must be made
first and told of the other afterwards (``runtime/_build.py`` says which
cycle each is). :class:`Late` is that callback: made empty, handed to the
part that calls it, and set once, when its target exists. :class:`LateCalls`
holds a broker's, and :meth:`Broker.start` refuses to start while one is not
set; calling one before it is set, or setting it twice, is a wiring mistake
and raises :class:`~kvbroker.errors.Internal` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Generic, ParamSpec, TypeVar

from kvbroker.broker.dataplane import Event
from kvbroker.broker.memory import FdConnection
from kvbroker.broker.peers import Peer
from kvbroker.errors import Internal

__all__ = ["Late", "LateCalls"]

P = ParamSpec("P")
R = TypeVar("R")


class Late(Generic[P, R]):
    """A callback set once, after the part that calls it is made."""

    __slots__ = ("what", "_target")

    def __init__(self, what: str) -> None:
        #: What it calls, for the error that says it was not set.
        self.what = what
        self._target: Callable[P, R] | None = None

    def set(self, target: Callable[P, R]) -> None:
        """Bind it to ``target``; once."""
        if self._target is not None:
            raise Internal(f"late callback {self.what} set twice")
        self._target = target

    @property
    def is_set(self) -> bool:
        return self._target is not None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        target = self._target
        if target is None:
            raise Internal(f"late callback {self.what} called before it was set (build_broker sets it)")
        return target(*args, **kwargs)


@dataclass(frozen=True, eq=False)
class LateCalls:
    """A broker's late callbacks, each a cycle of its wiring (``runtime/_build.py``)."""

    #: The data plane's events, to the executor (which posts to the data plane).
    on_events: Late[[list[Event]], None]
    #: The notifications the data plane reads, to the receiving parts (which post to it).
    take_notice: Late[[str, bytes], bool]
    #: A peer that restarted, from the peer table to the peer loss route (which drops peers from it).
    peer_restarted: Late[[Peer, str], None]
    #: An engine's fd connection closed, from the fd socket to the engine calls (which claim its uploads).
    fd_closed: Late[[FdConnection], None]
    #: The draining flag, for the fleet record (which the operators tell when it changes).
    draining: Late[[], bool]

    def unset(self) -> list[str]:
        """What is not set yet (nothing, once the broker is built)."""
        return [late.what for late in (getattr(self, f.name) for f in fields(self)) if not late.is_set]

"""A mapping for per-room tables that nearly always hold one entry.

A room has one source rank and one receiver rank in the common case (tp and
pp equal on both sides), and a broker keeps a few such tables per open room
(a sender room's sources and transfer infos, a source's destinations, a
receiver room's ranks, a rank's expected sources). A ``dict`` of one entry
takes 224 bytes; :class:`SmallMap` keeps that entry in two slots (56 bytes)
and makes a real ``dict`` only when a second key comes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any, TypeVar, overload

__all__ = ["SmallMap"]

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")

_NONE: Any = object()


class SmallMap(MutableMapping[K, V]):
    """A ``dict`` for at most one entry, that grows into one for more."""

    __slots__ = ("_key", "_value", "_dict")

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        self._key: Any = _NONE
        self._value: Any = None
        self._dict: dict[K, V] | None = None
        self.update(items)

    def __getitem__(self, key: K) -> V:
        if self._dict is not None:
            return self._dict[key]
        if self._key is not _NONE and self._key == key:
            return self._value  # type: ignore[no-any-return]
        raise KeyError(key)

    def __setitem__(self, key: K, value: V) -> None:
        if self._dict is not None:
            self._dict[key] = value
        elif self._key is _NONE or self._key == key:
            self._key, self._value = key, value
        else:
            self._dict = {self._key: self._value, key: value}
            self._key, self._value = _NONE, None

    def __delitem__(self, key: K) -> None:
        if self._dict is not None:
            del self._dict[key]
        elif self._key is not _NONE and self._key == key:
            self._key, self._value = _NONE, None
        else:
            raise KeyError(key)

    def __iter__(self) -> Iterator[K]:
        if self._dict is not None:
            return iter(self._dict)
        return iter(() if self._key is _NONE else (self._key,))

    def __len__(self) -> int:
        if self._dict is not None:
            return len(self._dict)
        return 0 if self._key is _NONE else 1

    def __contains__(self, key: object) -> bool:
        if self._dict is not None:
            return key in self._dict
        return self._key is not _NONE and self._key == key

    @overload
    def get(self, key: K, /) -> V | None: ...
    @overload
    def get(self, key: K, default: V | T, /) -> V | T: ...
    def get(self, key: K, default: Any = None) -> Any:
        if self._dict is not None:
            return self._dict.get(key, default)
        if self._key is not _NONE and self._key == key:
            return self._value
        return default

    def __repr__(self) -> str:
        return f"SmallMap({dict(self.items())!r})"

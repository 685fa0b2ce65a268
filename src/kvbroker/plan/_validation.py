"""The one check of every index a room names, before any record or descriptor exists.

An index outside a registered region must never reach NIXL: it would be a
write outside a buffer on someone else's host. Every place that takes
indices checks them here, against the layout they address:

- ExpectRoom (the receiving engine's own layout),
- SendChunk (the sending engine's own layout),
- RegisterRoom (the receiver's layout as its broker announced it in the
  handshake: the sender's broker checks again and trusts nobody).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvbroker.errors import InvalidArgument
from kvbroker.plan._indices import IndexArray
from kvbroker.plan._layout import Layout

__all__ = ["check_chunk", "check_declared_pages", "check_index", "check_indices", "check_room_indices"]


def check_indices(indices: IndexArray, count: int, what: str) -> None:
    """``InvalidArgument`` unless every index is in ``[0, count)``."""
    if indices.size == 0:
        return
    low, high = int(indices.min()), int(indices.max())
    if low < 0:
        raise InvalidArgument(f"{what}: index {low} is negative")
    if high >= count:
        raise InvalidArgument(f"{what}: index {high} is out of range (the region holds {count})")


def check_index(index: int, count: int, what: str) -> None:
    """:func:`check_indices` for a single index (an aux row)."""
    check_indices(np.array([index], dtype=np.int64), count, what)


def check_room_indices(
    layout: Layout,
    *,
    pages: IndexArray,
    aux_row: int | None,
    state: Mapping[str, IndexArray],
    who: str = "",
) -> None:
    """Check a room's page indices, aux row and state indices against ``layout``.

    ``who`` prefixes the messages (e.g. ``"receiver g/tp0/pp0 "``): "this
    engine" when empty.
    """
    owner = who or "this engine "
    check_indices(pages, layout.num_pages, f"{who}pages")
    if aux_row is not None:
        if not layout.aux_regions:
            raise InvalidArgument(f"aux_row given but {owner}registered no aux regions")
        check_index(aux_row, layout.aux_rows, f"{who}aux_row")
    for name, indices in state.items():
        if name not in layout.state_components:
            raise InvalidArgument(f"state component {name!r} is not in the layout of {owner.strip()}")
        check_indices(indices, layout.state_items[name], f"{who}state {name!r}")


def check_declared_pages(layout: Layout, num_pages: int) -> None:
    """``InvalidArgument`` unless a sending room of ``num_pages`` pages (0: not
    said) fits the engine's pool (BeginSend; the client checks before it queues)."""
    if layout.num_pages and num_pages > layout.num_pages:
        raise InvalidArgument(f"num_pages {num_pages} exceeds the engine's {layout.num_pages} pages")


def check_chunk(
    layout: Layout,
    *,
    declared: int,
    sent: int,
    pages: IndexArray,
    is_last: bool,
    aux_row: int | None,
    state: Mapping[str, IndexArray],
) -> None:
    """Check one chunk of a sending room: its indices, and its page count
    against the ``declared`` total (0: not declared) after ``sent`` pages.
    The client checks a chunk here before it queues it; the broker again."""
    total = sent + int(pages.size)
    if not is_last and (aux_row is not None or state):
        raise InvalidArgument("aux_row and state go on the last chunk (is_last)")
    check_room_indices(layout, pages=pages, aux_row=aux_row, state=state)
    if declared and total > declared:
        raise InvalidArgument(f"this chunk brings the room to {total} pages; BeginSend declared {declared}")
    if not is_last:
        return
    if declared and total != declared:
        raise InvalidArgument(f"the last chunk brings the room to {total} pages; BeginSend declared {declared}")
    if layout.aux_regions and aux_row is None:
        raise InvalidArgument("the last chunk must carry aux_row: this engine registered aux regions")

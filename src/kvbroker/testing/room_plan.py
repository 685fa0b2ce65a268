"""Which pages and aux rows each room uses on each side, from the seed alone.

Rooms run in batches of ``window``; room ``i`` of a batch uses slot ``i``. A
slot owns a span of pages in each side's pool; a room picks its pages from
its span, in random order of runs with gaps between them, so page lists are
non-contiguous but have contiguous runs (which the broker coalesces). Both
sides compute the same plan independently. ``kvbroker demo`` and the
parallel-layout scenarios (``scenario``) share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbroker.client import StateSpec

__all__ = ["STATE_KINDS", "RoomPlan", "plan_room", "pool_pages", "state_indices", "state_specs"]


@dataclass(frozen=True)
class RoomPlan:
    room: int
    slot: int
    src_pages: np.ndarray
    dst_pages: np.ndarray
    #: [start, end) of each chunk over the room's pages.
    chunks: tuple[tuple[int, int], ...]


def _span(pages: int) -> int:
    return pages + max(2, pages // 2)


def pool_pages(pages: int, window: int) -> int:
    """Pages each side's pool needs."""
    return _span(pages) * window


def _pick(rng: np.random.Generator, pages: int, slot: int) -> np.ndarray:
    span = _span(pages)
    chosen = np.sort(rng.choice(span, size=pages, replace=False))
    # Keep runs, but shuffle their order so destination order differs from
    # ascending source order.
    breaks = np.flatnonzero(np.diff(chosen) != 1) + 1
    runs = np.split(chosen, breaks)
    order = rng.permutation(len(runs))
    return (np.concatenate([runs[i] for i in order]) + slot * span).astype(np.int32)


def plan_room(*, seed: int, index: int, room_base: int, pages: int, chunks: int, window: int) -> RoomPlan:
    """The plan of the ``index``-th room."""
    slot = index % window
    src = _pick(np.random.default_rng([seed, index, 1]), pages, slot)
    dst = _pick(np.random.default_rng([seed, index, 2]), pages, slot)
    n = max(1, min(chunks, pages)) if pages else 1
    bounds = np.linspace(0, pages, n + 1).astype(int)
    return RoomPlan(
        room=room_base + index,
        slot=slot,
        src_pages=src,
        dst_pages=dst,
        chunks=tuple((int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])),
    )


#: The state component types a scenario can carry.
STATE_KINDS = ("mamba", "swa", "nsa")


def state_specs(names: tuple[str, ...], num_layers: int, slots: int) -> tuple[StateSpec, ...]:
    """One component per name, with state on every layer: Mamba has 2 buffers
    (conv, ssm) of one item per request slot; SWA and NSA are paged (4 items
    per slot)."""
    layers = tuple(range(num_layers))
    specs = {
        "mamba": StateSpec("mamba", "mamba", item_bytes=96, num_items=slots, num_regions=2, layers=layers),
        "swa": StateSpec("swa", "swa", item_bytes=64, num_items=4 * slots, layers=layers),
        "nsa": StateSpec("nsa", "nsa", item_bytes=48, num_items=4 * slots, layers=layers),
    }
    return tuple(specs[name] for name in names)


def state_indices(name: str, slot: int, side: int) -> list[int]:
    """Indices of component ``name`` for the room in ``slot`` (side 0: sender, 1: receiver)."""
    if name == "mamba":
        return [slot]
    base = 4 * slot
    return [base + (i + side) % 4 for i in range(3)]

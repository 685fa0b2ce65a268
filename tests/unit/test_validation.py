"""The one index validation: ``kvbroker.plan``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvbroker.errors import InvalidArgument
from kvbroker.plan._validation import check_index, check_indices, check_room_indices
from kvbroker.v1 import common_pb2

Builder = Callable[..., Any]


def i32(values: list[int] | range) -> np.ndarray:
    return np.array(list(values), dtype=np.int32)


# -- bounds of one index list --------------------------------------------------


def test_check_indices_in_range_ok() -> None:
    """Indices in [0, count) pass, including both ends of the range."""
    check_indices(i32([0, 5, 9]), 10, "pages")


def test_check_indices_negative() -> None:
    """A negative index is InvalidArgument mentioning 'negative' and the index."""
    with pytest.raises(InvalidArgument, match=r"src pages: index -1 is negative"):
        check_indices(i32([3, -1, 2]), 10, "src pages")


def test_check_indices_equal_to_count() -> None:
    """An index equal to the region's count is out of range."""
    with pytest.raises(
        InvalidArgument, match=r"dst pages: index 10 is out of range \(the region holds 10\)"
    ):
        check_indices(i32([0, 10]), 10, "dst pages")


def test_check_indices_reports_extremes() -> None:
    """The error names the smallest negative or largest too-large index."""
    with pytest.raises(InvalidArgument, match="index -7 is negative"):
        check_indices(i32([-2, -7, 100]), 10, "x")
    with pytest.raises(InvalidArgument, match="index 100 is out of range"):
        check_indices(i32([12, 100, 11]), 10, "x")


def test_check_indices_empty_ok() -> None:
    """An empty index list passes, even against an empty region."""
    check_indices(i32([]), 0, "pages")
    check_indices(i32([]), 10, "pages")


def test_check_indices_any_index_into_empty_region() -> None:
    """Index 0 into a region holding nothing is out of range."""
    with pytest.raises(InvalidArgument, match="out of range"):
        check_indices(i32([0]), 0, "pages")


@pytest.mark.parametrize("index,ok", [(0, True), (3, True), (4, False), (-1, False)])
def test_check_index(index: int, ok: bool) -> None:
    """check_index applies the same bounds to one index (an aux row)."""
    if ok:
        check_index(index, 4, "aux row")
    else:
        with pytest.raises(InvalidArgument, match="aux row: index"):
            check_index(index, 4, "aux row")


# -- a room's indices against a layout ------------------------------------------


@pytest.fixture
def layout(layout_proto: Builder, state_spec: Any) -> Any:
    spec = state_spec("swa", common_pb2.STATE_TYPE_SWA, items=8, item_bytes=32, regions=1)
    return layout_proto(num_layers=2, num_pages=16, aux_rows=4, aux_row_bytes=(16,), state=(spec,)).build()


def test_room_indices_in_range_pass(layout: Any) -> None:
    """Pages, aux row and state indices inside the layout's regions pass."""
    check_room_indices(layout, pages=i32([0, 15]), aux_row=3, state={"swa": i32([0, 7])})


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"pages": i32([16])}, "pages: index 16 is out of range"),
        ({"pages": i32([-1])}, "pages: index -1 is negative"),
        ({"aux_row": 4}, "aux_row: index 4"),
        ({"state": {"swa": i32([8])}}, "state 'swa': index 8"),
        ({"state": {"mamba": i32([0])}}, "state component 'mamba' is not in the layout"),
    ],
)
def test_room_indices_out_of_range_are_refused(layout: Any, kwargs: dict[str, Any], fragment: str) -> None:
    """Each kind of index is checked against its own region; the message names what was wrong."""
    args: dict[str, Any] = {"pages": i32([0]), "aux_row": None, "state": {}, **kwargs}
    with pytest.raises(InvalidArgument, match=fragment):
        check_room_indices(layout, **args)


def test_room_indices_name_who_they_belong_to(layout: Any) -> None:
    """``who`` prefixes the messages (the sender checks a receiver's transfer info with it)."""
    with pytest.raises(InvalidArgument, match="receiver d/tp0/pp0 pages: index 99"):
        check_room_indices(layout, pages=i32([99]), aux_row=None, state={}, who="receiver d/tp0/pp0 ")


def test_aux_row_without_aux_regions(layout_proto: Builder) -> None:
    """An aux row for an engine that registered no aux regions is refused."""
    bare = layout_proto(num_layers=1, num_pages=4, aux_row_bytes=()).build()
    with pytest.raises(InvalidArgument, match="registered no aux regions"):
        check_room_indices(bare, pages=i32([0]), aux_row=0, state={})

"""SmallMap behaves as a dict whatever its size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker.broker.rooms._smallmap import SmallMap

ops = st.lists(st.tuples(st.sampled_from(("set", "del", "get")), st.integers(0, 3), st.integers()), max_size=30)


@given(ops)
def test_smallmap_matches_a_dict(steps: list[tuple[str, int, int]]) -> None:
    """Any sequence of sets, deletes and lookups leaves a SmallMap equal to a dict given the same."""
    small: SmallMap[int, int] = SmallMap()
    ref: dict[int, int] = {}
    for op, key, value in steps:
        if op == "set":
            small[key] = ref[key] = value
        elif op == "del":
            if key in ref:
                del small[key], ref[key]
            else:
                with pytest.raises(KeyError):
                    del small[key]
        else:
            assert small.get(key) == ref.get(key) and small.get(key, -1) == ref.get(key, -1)
            assert (key in small) == (key in ref)
        assert len(small) == len(ref) and dict(small.items()) == ref and list(small) == list(ref)
        assert small == ref and sorted(small.values()) == sorted(ref.values())


def test_one_entry_is_smaller_than_a_dict() -> None:
    """A SmallMap of one entry takes under a third of a dict's size, and reads like one."""
    import sys

    assert sys.getsizeof(SmallMap({1: 2})) < sys.getsizeof({1: 2}) // 3
    assert repr(SmallMap({1: 2})) == "SmallMap({1: 2})"

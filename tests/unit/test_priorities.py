"""How each adapter maps its engine's request priority to a room's class (RoomPriority): vLLM's
kv_connector_extra_config thresholds (a lower vLLM priority is more urgent) and a request's own
kv_transfer_params, SGLang's environment in SGLang's direction. Unconfigured, every room stays
unspecified; a value the mapping does not take is refused by the name it was given under."""

from __future__ import annotations

import pytest

from kvbroker.adapters._priorities import (
    PriorityRule,
    RoomClass,
    room_class_of,
    sglang_priority_rule,
    vllm_priority_rule,
)
from kvbroker.errors import InvalidArgument
from kvbroker.v1 import common_pb2

UNSPECIFIED = common_pb2.ROOM_PRIORITY_UNSPECIFIED
BULK = common_pb2.ROOM_PRIORITY_BULK
STANDARD = common_pb2.ROOM_PRIORITY_STANDARD
INTERACTIVE = common_pb2.ROOM_PRIORITY_INTERACTIVE


def test_unconfigured_engines_leave_every_room_unspecified() -> None:
    """An engine configured with no priority thresholds leaves every room's class unspecified, whatever its request's
    priority."""
    for rule in (vllm_priority_rule({}), vllm_priority_rule({"broker": "x", "kvbroker_bulk_at_least": None}), sglang_priority_rule({}, False)):
        assert not rule.configured
        assert [rule.classify(p) for p in (-(2**63), -1, 0, 1, 2**63 - 1, None)] == [UNSPECIFIED] * 6
    assert room_class_of(None, 0, PriorityRule()) == RoomClass(UNSPECIFIED, None)
    assert room_class_of({"do_remote_decode": True}, -5, PriorityRule()) == RoomClass()


def test_vllm_lower_priorities_are_more_urgent_and_the_thresholds_are_inclusive() -> None:
    """For vLLM a lower priority is more urgent and both thresholds are inclusive; with one threshold alone the rest
    is standard."""
    rule = vllm_priority_rule({"kvbroker_interactive_at_most": -1, "kvbroker_bulk_at_least": 5})
    assert rule == PriorityRule(interactive=-1, bulk=5, lower_is_more_urgent=True)
    assert [rule.classify(p) for p in (-10, -1, 0, 4, 5, 100)] == [INTERACTIVE, INTERACTIVE, STANDARD, STANDARD, BULK, BULK]
    # One threshold alone: the rest is standard (vLLM's default priority 0 included).
    only_interactive = vllm_priority_rule({"kvbroker_interactive_at_most": "0"})  # JSON strings of integers too
    assert [only_interactive.classify(p) for p in (-1, 0, 1)] == [INTERACTIVE, INTERACTIVE, STANDARD]
    only_bulk = vllm_priority_rule({"kvbroker_bulk_at_least": 1.0})
    assert [only_bulk.classify(p) for p in (0, 1)] == [STANDARD, BULK]


def test_sglang_follows_its_own_direction() -> None:
    """SGLang: a larger priority is more urgent, unless --schedule-low-priority-values-first."""
    env = {"KVBROKER_INTERACTIVE_PRIORITY": "10", "KVBROKER_BULK_PRIORITY": "0"}
    high_first = sglang_priority_rule(env, low_values_first=False)
    assert [high_first.classify(p) for p in (20, 10, 5, 0, -3, None)] == [INTERACTIVE, INTERACTIVE, STANDARD, BULK, BULK, UNSPECIFIED]
    low_first = sglang_priority_rule({"KVBROKER_INTERACTIVE_PRIORITY": "0", "KVBROKER_BULK_PRIORITY": "10"}, low_values_first=True)
    assert [low_first.classify(p) for p in (-3, 0, 5, 10, 20, None)] == [INTERACTIVE, INTERACTIVE, STANDARD, BULK, BULK, UNSPECIFIED]
    # SGLang's stand-in for "no priority" under --enable-priority-scheduling is its least urgent value.
    assert high_first.classify(-(2**63)) == BULK and sglang_priority_rule({"KVBROKER_BULK_PRIORITY": " "}, False) == PriorityRule(lower_is_more_urgent=False)


def test_a_requests_own_kv_transfer_params_win_over_its_vllm_priority() -> None:
    """A request's kvbroker_priority (a name, any case, or a number; 0 unspecified) wins over its vLLM priority; a
    kvbroker_deadline_ms gives the room a deadline in seconds."""
    rule = vllm_priority_rule({"kvbroker_interactive_at_most": -1, "kvbroker_bulk_at_least": 5})
    assert room_class_of({"do_remote_decode": True}, -1, rule) == RoomClass(INTERACTIVE)
    assert room_class_of({"kvbroker_priority": "bulk"}, -1, rule) == RoomClass(BULK)
    assert room_class_of({"kvbroker_priority": "Interactive"}, 9, PriorityRule()) == RoomClass(INTERACTIVE)
    assert room_class_of({"kvbroker_priority": 2}, 9, rule) == RoomClass(STANDARD)
    # 0 (unspecified) is a value of its own: the rule does not apply.
    assert room_class_of({"kvbroker_priority": 0}, 9, rule) == RoomClass(UNSPECIFIED)
    assert room_class_of({"kvbroker_priority": None}, 9, rule) == RoomClass(BULK)  # None: not given
    assert room_class_of({"kvbroker_deadline_ms": 250}, 0, rule) == RoomClass(STANDARD, 0.25)
    assert room_class_of({"kvbroker_priority": "interactive", "kvbroker_deadline_ms": 1500.0}, 0, rule) == RoomClass(INTERACTIVE, 1.5)


@pytest.mark.parametrize("value", ["urgent", 4, -1, True, 1.5, [3], "3"])
def test_a_class_the_broker_does_not_take_is_refused_naming_the_request_and_key(value: object) -> None:
    """A kvbroker_priority that is not a room class is INVALID_ARGUMENT naming the request and key and saying what it
    takes."""
    with pytest.raises(InvalidArgument, match=r"request r-7's kv_transfer_params kvbroker_priority .* is not a room class: it takes \"interactive\""):
        room_class_of({"kvbroker_priority": value}, 0, PriorityRule(), "r-7")


@pytest.mark.parametrize("value", [0, -5, "soon", True, float("nan"), float("inf")])
def test_a_deadline_that_is_not_positive_milliseconds_is_refused_by_key(value: object) -> None:
    """A kvbroker_deadline_ms that is not a finite number of milliseconds above 0 is INVALID_ARGUMENT, by key."""
    with pytest.raises(InvalidArgument, match="kv_transfer_params kvbroker_deadline_ms .* is not a deadline: it takes milliseconds above 0"):
        room_class_of({"kvbroker_deadline_ms": value}, 0, PriorityRule())


def test_thresholds_that_are_not_integers_or_that_overlap_are_refused_where_they_were_set() -> None:
    """Thresholds that are not integers, or that overlap (in the engine's direction of urgency), are INVALID_ARGUMENT
    naming where they were set (vLLM's connector config, SGLang's environment)."""
    for bad in ("high", 1.5, True, [1]):
        with pytest.raises(InvalidArgument, match="kv_connector_extra_config kvbroker_interactive_at_most .* is not an integer"):
            vllm_priority_rule({"kvbroker_interactive_at_most": bad})
    with pytest.raises(InvalidArgument, match="kvbroker_interactive_at_most 5 and kv_connector_extra_config kvbroker_bulk_at_least 5 overlap"):
        vllm_priority_rule({"kvbroker_interactive_at_most": 5, "kvbroker_bulk_at_least": 5})
    vllm_priority_rule({"kvbroker_interactive_at_most": 4, "kvbroker_bulk_at_least": 5})
    with pytest.raises(InvalidArgument, match="the environment variable KVBROKER_BULK_PRIORITY 'low' is not an integer"):
        sglang_priority_rule({"KVBROKER_BULK_PRIORITY": "low"}, False)
    # The same numbers are fine in one direction and overlap in the other.
    env = {"KVBROKER_INTERACTIVE_PRIORITY": "10", "KVBROKER_BULK_PRIORITY": "0"}
    sglang_priority_rule(env, low_values_first=False)
    with pytest.raises(InvalidArgument, match=r"overlap: .* \(here a lower priority is more urgent\)"):
        sglang_priority_rule(env, low_values_first=True)

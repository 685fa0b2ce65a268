"""RoomTimeouts: the one check an engine's timeouts pass (client and broker), and how each adapter
reads them from its engine's configuration (vLLM's kv_connector_extra_config, SGLang's environment)."""

from __future__ import annotations

import pytest

from kvbroker.adapters import room_timeouts_of, sglang_timeouts
from kvbroker.errors import InvalidArgument
from kvbroker.plan import RoomTimeouts
from kvbroker.v1 import common_pb2


def test_unset_fields_are_the_brokers_flags_and_set_ones_the_engines() -> None:
    """A room's timeout the engine set is its own, one it left unset the broker's flag, and each limit says which it
    is."""
    timeouts = RoomTimeouts(sender_info_seconds=4)
    assert timeouts.limit("sender_info_seconds", 120).seconds == 4.0
    assert str(timeouts.limit("sender_info_seconds", 120)) == "4 s (the engine's RoomTimeouts.sender_info_seconds)"
    assert str(timeouts.limit("bootstrap_seconds", 30)) == "30 s (the broker's --bootstrap-timeout)"
    effective = timeouts.effective(sender_info=120, bootstrap=30, receiver_data=300)
    assert (effective.sender_info_seconds, effective.bootstrap_seconds, effective.receiver_data_seconds) == (4, 30, 300)


def test_the_wire_form_goes_there_and_back_with_zero_as_unset() -> None:
    """RoomTimeouts goes to the wire and back with 0 meaning unset; a negative one from the wire is INVALID_ARGUMENT,
    by field."""
    timeouts = RoomTimeouts(bootstrap_seconds=2.5, receiver_data_seconds=60)
    wire = timeouts.to_proto()
    assert wire.sender_info_seconds == 0.0
    assert RoomTimeouts.from_proto(wire) == timeouts
    assert RoomTimeouts.from_proto(common_pb2.RoomTimeouts()) == RoomTimeouts()
    with pytest.raises(InvalidArgument, match="receiver_data_seconds"):
        RoomTimeouts.from_proto(common_pb2.RoomTimeouts(receiver_data_seconds=-3))


def test_vllm_reads_its_connector_config_keys_and_nixls_lease_and_refuses_by_key() -> None:
    """vLLM's timeouts come from its connector config keys and NixlConnector's kv_lease_duration (kvbroker's own key
    wins); a bad value is INVALID_ARGUMENT naming the key."""
    extra = {"broker": "x", "sender_info_timeout": 480, "bootstrap_timeout": "15", "receiver_data_timeout": None}
    assert room_timeouts_of(extra) == RoomTimeouts(sender_info_seconds=480, bootstrap_seconds=15)
    # NixlConnector's name for the prefill's lease sets it too; kvbroker's own name wins where both are set.
    assert room_timeouts_of({"kv_lease_duration": 30}) == RoomTimeouts(sender_info_seconds=30)
    assert room_timeouts_of({"kv_lease_duration": 30, "sender_info_timeout": 90}) == RoomTimeouts(sender_info_seconds=90)
    with pytest.raises(InvalidArgument, match="kv_connector_extra_config kv_lease_duration 'soon'"):
        room_timeouts_of({"kv_lease_duration": "soon"})
    for bad in (0, -1, "soon", 10**6, [1]):
        with pytest.raises(InvalidArgument, match="kv_connector_extra_config sender_info_timeout"):
            room_timeouts_of({"sender_info_timeout": bad})


def test_sglang_reads_kvbrokers_variables_then_its_own_disaggregation_timeouts() -> None:
    """SGLang's timeouts come from kvbroker's environment variables, then SGLang's disaggregation timeouts; a blank
    one is unset, a bad one INVALID_ARGUMENT naming the variable."""
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "600", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "300"}
    assert sglang_timeouts(env) == RoomTimeouts(sender_info_seconds=600, receiver_data_seconds=300)
    env |= {"KVBROKER_SENDER_INFO_TIMEOUT": "45", "KVBROKER_BOOTSTRAP_TIMEOUT": "12"}
    assert sglang_timeouts(env) == RoomTimeouts(sender_info_seconds=45, bootstrap_seconds=12, receiver_data_seconds=300)
    assert sglang_timeouts({"KVBROKER_BOOTSTRAP_TIMEOUT": " "}) == RoomTimeouts()  # blank: unset
    with pytest.raises(InvalidArgument, match="environment variable SGLANG_DISAGGREGATION_WAITING_TIMEOUT '-5'"):
        sglang_timeouts({"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "-5"})

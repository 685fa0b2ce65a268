"""An engine's own timeouts for its rooms (``RoomTimeouts``), instead of its broker's flags.

An adapter passes on the bounds its engine already has (vLLM's
``kv_connector_extra_config``, SGLang's ``SGLANG_DISAGGREGATION_*_TIMEOUT``):
a prefill's lease on the pages it sends (how long its room waits for the
decode), how long a decode's room looks for its sender, and how long it then
waits for its data. Each bounds only that engine's rooms, says in the
failure whose bound it was, and shows in ListEngines. In-process brokers
with the fake NIXL agent; the broker flags stay at their defaults
(120 s, 30 s, 300 s), so a room that fails within seconds failed by the
engine's own bound.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import grpc
import pytest

from kvbroker import errors
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, RoomTimeouts, SenderRef
from kvbroker.v1 import admin_pb2, admin_pb2_grpc, common_pb2

from .conftest import SMALL_MODEL
from .test_service import DST, SRC, _wait_tables_empty

FAST = {"housekeeping_interval_seconds": 0.05}


def test_a_prefills_own_lease_frees_its_room_while_another_engines_waits(fake_brokers, make_engine) -> None:
    """Two prefill engines on one broker; one set ``sender_info_seconds`` 0.5. Its room fails
    TIMEOUT after about that, naming its own bound and the broker's flag it replaced; the other
    engine's room, opened at the same time, is still waiting under the broker's 120 s."""
    p = fake_brokers("p", **FAST)
    leased = make_engine(p.address, "prefill", "leased", timeouts=RoomTimeouts(sender_info_seconds=0.5))
    plain = make_engine(p.address, "prefill", "plain")
    started = time.monotonic()
    senders = {}
    for name, engine in (("leased", leased), ("plain", plain)):
        senders[name] = sender = engine.handle.sender(10)
        sender.init(len(SRC), aux_row=1)
        sender.send(SRC)
    status = senders["leased"].wait(10)
    assert 0.5 <= time.monotonic() - started < 5
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_TIMEOUT, status
    assert "waited 0.5 s (the engine's RoomTimeouts.sender_info_seconds)" in status.cause.message, status.cause.message
    assert status.pages_settled
    assert senders["plain"].status().state == RoomState.BOOTSTRAPPING
    senders["plain"].abort("test over")
    assert senders["plain"].wait(10).state == RoomState.FAILED
    _wait_tables_empty(p)


def test_a_decodes_own_data_timeout_fails_its_room_and_tells_the_sender(fake_brokers, make_engine) -> None:
    """A decode engine with ``receiver_data_seconds`` 0.5: its registered room that gets no data
    fails TIMEOUT after about that (the broker's flag is 300 s), naming its bound; the prefill's
    room fails too."""
    p, d = fake_brokers("p"), fake_brokers("d", **FAST)
    pe = make_engine(p.address, "prefill")
    de = make_engine(d.address, "decode", timeouts=RoomTimeouts(receiver_data_seconds=0.5))
    receiver = de.handle.receiver(20, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    sender = pe.handle.sender(20)
    sender.init(len(SRC), aux_row=1)
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_TIMEOUT, status
    assert "waited 0.5 s (the engine's RoomTimeouts.receiver_data_seconds)" in status.cause.message, status.cause.message
    assert sender.wait(10).state == RoomState.FAILED
    _wait_tables_empty(p, d)


def test_a_decodes_own_bootstrap_timeout_bounds_the_search_for_its_sender(fake_brokers, make_engine) -> None:
    """A decode engine with ``bootstrap_seconds`` 0.8 whose sender's broker never answers: its room
    fails after 0.8 s (the broker's flag is 30 s), saying it gave up by the engine's bound."""
    d = fake_brokers("d", peer_rpc_timeout_seconds=0.2)
    de = make_engine(d.address, "decode", timeouts=RoomTimeouts(bootstrap_seconds=0.8))
    receiver = de.handle.receiver(30, SenderRef("127.0.0.1:1", "prefill-group"))
    started = time.monotonic()
    receiver.init(DST, aux_row=2)
    status = receiver.wait(10)
    assert 0.8 <= time.monotonic() - started < 5
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_PEER, status
    assert "the bootstrap timeout is 0.8 s, the engine's RoomTimeouts.bootstrap_seconds" in status.cause.message, status.cause.message
    assert status.pages_settled


def test_list_engines_shows_the_timeouts_that_apply(fake_brokers, make_engine) -> None:
    """ListEngines gives each engine the bounds its rooms live by: its own, else the broker's flags."""
    p = fake_brokers("p", sender_info_timeout_seconds=60.0)
    make_engine(p.address, "prefill", "own", timeouts=RoomTimeouts(sender_info_seconds=7.5, receiver_data_seconds=9))
    make_engine(p.address, "prefill", "flags")
    with grpc.insecure_channel(p.address) as channel:
        listed = admin_pb2_grpc.AdminStub(channel).ListEngines(admin_pb2.ListEnginesRequest())
    by_group = {e.rank.group: e.timeouts for e in listed.engines}
    assert (by_group["own"].sender_info_seconds, by_group["own"].bootstrap_seconds, by_group["own"].receiver_data_seconds) == (7.5, 30.0, 9.0)
    assert (by_group["flags"].sender_info_seconds, by_group["flags"].bootstrap_seconds, by_group["flags"].receiver_data_seconds) == (60.0, 30.0, 300.0)


@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, 86400.5, True, "30"])
def test_a_timeout_that_is_not_a_sensible_number_of_seconds_is_refused_at_once(value: object) -> None:
    """Zero, negative, not finite, over a day, or not a number: ``InvalidArgument`` naming the
    field, before anything reaches a broker."""
    with pytest.raises(errors.InvalidArgument, match="RoomTimeouts.bootstrap_seconds"):
        RoomTimeouts(bootstrap_seconds=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, 1e9])
def test_the_broker_refuses_a_registration_with_bad_timeouts_and_registers_nothing(fake_brokers, value: float) -> None:
    """A RegisterEngine whose timeouts skipped the client's check (another client, grpcurl) is
    refused INVALID_ARGUMENT naming the field; the broker holds no engine afterwards, and the same
    rank registers with sensible ones."""
    p = fake_brokers("p")
    rank = RankSpec(group="bad-timeouts", role="prefill")
    memory = EngineMemory.allocate(rank, SMALL_MODEL, num_pages=8)
    client = BrokerClient(p.address)
    try:
        bad = SimpleNamespace(to_proto=lambda: common_pb2.RoomTimeouts(sender_info_seconds=value))
        with pytest.raises(errors.InvalidArgument, match="RoomTimeouts.sender_info_seconds"):
            client.upload_and_register(rank, memory, bad)  # type: ignore[arg-type]
        assert p.loop.call(lambda: len(p.broker.queries.engines())) == 0
        handle = client.register_engine(rank, memory, timeouts=RoomTimeouts(sender_info_seconds=5))
        handle.close()
    finally:
        client.close()
        memory.close()

"""Security basics: socket permissions, rooms bound to the registering session, limits."""

from __future__ import annotations

import os
import stat

import grpc
import numpy as np
import pytest

from kvbroker import errors
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.plan import encode_indices
from kvbroker.v1 import admin_pb2, admin_pb2_grpc, transfer_pb2

from .conftest import SMALL_MODEL


def test_engine_sockets_are_owner_and_group_only(fake_brokers) -> None:
    """The engine gRPC socket and the fd socket are created mode 0660."""
    b = fake_brokers("s")
    for path in (b.broker.endpoints.engine_socket_path, b.broker.broker_info().fd_socket_path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660, path


def test_one_engine_cannot_touch_another_engines_rooms(fake_brokers, make_engine) -> None:
    """Engine B can neither abort nor send into engine A's room on the same broker; A's room completes."""
    p, d = fake_brokers("p"), fake_brokers("d")
    owner = make_engine(p.address, "prefill", "prefill-group")
    intruder = make_engine(p.address, "prefill", "other-group", seed=5)
    de = make_engine(d.address, "decode")
    de.handle.receiver(1, SenderRef(p.address, "prefill-group")).init([0, 1], aux_row=0)
    sender = owner.handle.sender(1)
    sender.init(2, aux_row=1)
    intruder.handle.sender(1).abort("hostile")
    intruder.handle.flush()
    status = intruder.handle.poll([1])[1]  # not a room of the intruder's: asked of the broker
    assert status.cause.kind != 0 and "no room 1" in status.cause.message
    with pytest.raises(errors.NotFound):
        intruder.handle.sender(1).send([0, 1])
    sender.send([3, 4])
    assert de.handle.wait([1], timeout_seconds=10)[1].state == RoomState.SUCCESS


def test_engine_ids_are_secrets_of_their_session(fake_brokers, make_engine) -> None:
    """ListEngines shows labels, not engine ids; a label or a forged id is refused as an engine id."""
    p = fake_brokers("p")
    pe = make_engine(p.address, "prefill")
    with grpc.insecure_channel(p.address) as ch:
        listed = admin_pb2_grpc.AdminStub(ch).ListEngines(admin_pb2.ListEnginesRequest())
    (info,) = listed.engines
    assert pe.handle.engine_id not in str(listed) and info.engine_label.startswith("prefill-group/tp0/pp0")
    for forged in (info.engine_label, "eng-" + "0" * 32):
        with pytest.raises(errors.NotFound):
            pe.client.call(pe.client.stub.Abort, transfer_pb2.AbortRequest(engine_id=forged, room=1))


def test_a_session_token_registers_one_engine_only(fake_brokers) -> None:
    """A used or made-up session token cannot register another engine."""
    p = fake_brokers("p")
    client = BrokerClient(p.address)
    try:
        for token in ("", "made-up"):
            with pytest.raises(errors.NotFound, match="session_token"):
                client.call(
                    client.stub.RegisterEngine,
                    transfer_pb2.RegisterEngineRequest(session_token=token, rank=RankSpec("g", "prefill").to_proto()),
                )
        memory = EngineMemory.allocate(RankSpec("g", "prefill"), SMALL_MODEL, num_pages=4)
        engine = client.register_engine(RankSpec("g", "prefill"), memory)
        token = p.broker.queries.engine(engine.engine_id).session_token
        with pytest.raises(errors.NotFound):
            client.call(
                client.stub.RegisterEngine,
                transfer_pb2.RegisterEngineRequest(session_token=token, rank=RankSpec("g", "prefill", tp_size=2, tp_rank=1).to_proto()),
            )
        engine.close()
    finally:
        client.close()


def test_oversize_messages_are_refused_and_change_nothing(fake_brokers, make_engine) -> None:
    """A request above the broker's message limit is RESOURCE_EXHAUSTED and opens no room."""
    d = fake_brokers("d", max_message_bytes=64 * 1024)
    de = make_engine(d.address, "decode")
    request = transfer_pb2.ExpectRoomRequest(
        engine_id=de.handle.engine_id,
        room=9,
        sender=transfer_pb2.SenderRef(broker_address="127.0.0.1:1", group="x"),
        pages=encode_indices(np.zeros(100_000, dtype=np.int32)),
    )
    with pytest.raises(errors.ResourceExhausted):
        de.client.call(de.client.stub.ExpectRoom, request)
    assert d.tables()["receiver_rooms"] == 0

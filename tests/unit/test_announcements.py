"""Rooms a decode rank announced before opening them, and the lease renewals its
broker owes them (``ReceiverCore.announcements``, ``tick``:
``kvbroker.broker.rooms._announcements``), without gRPC."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvbroker.broker.memory import CreditLedger
from kvbroker.broker.rooms import (
    Abort,
    AnnounceRoom,
    Effect,
    ExpectRoom,
    ReceiverCore,
    RenewLeases,
    RoomTables,
    cause,
)
from kvbroker.broker.telemetry import Counters, QueueStats
from kvbroker.v1 import common_pb2

A = "host-a:50051"
B = "host-b:50051"
Builder = Callable[..., Any]


class World:
    def __init__(self, engine_stub: Builder) -> None:
        self.engine_stub = engine_stub
        self.core = ReceiverCore(broker_id="decode-broker", rooms=RoomTables(), counters=Counters(queues=QueueStats()), credits=CreditLedger(), on_bytes=lambda _n: None)

    def announce(self, engine: Any, room: int, address: str = A, group: str = "prefill-group") -> None:
        self.core.announcements.announce(AnnounceRoom(engine=engine, room=room, sender_address=address, sender_group=group))

    def renewals(self, now: float, max_every: float = 5.0) -> list[RenewLeases]:
        self.core.tick(now, data_timeout_seconds=300, retry_seconds=1, lease_renew_max_seconds=max_every)
        effects: list[Effect] = self.core.take()
        return [e for e in effects if isinstance(e, RenewLeases)]


@pytest.fixture
def world(engine_stub: Builder) -> World:
    return World(engine_stub)


def test_one_renewal_per_sender_broker_lists_its_rooms_at_once(world: World) -> None:
    """Before any answer a renewal goes at the first pass: one per sender broker address, listing
    (room, group) of every engine's announcements there; announcing again changes nothing."""
    d0, d1 = world.engine_stub("decode"), world.engine_stub("decode", tp_size=2, tp_rank=1)
    world.announce(d0, 1)
    world.announce(d0, 1)
    world.announce(d1, 2, group="other")
    world.announce(d1, 3, address=B)
    renewals = {r.address: r.rooms for r in world.renewals(100.0)}
    assert renewals == {A: ((1, "prefill-group"), (2, "other")), B: ((3, "prefill-group"),)}
    assert world.core.announcements.announced(d0) == {1: (A, "prefill-group")}


def test_one_call_at_a_time_then_a_third_of_the_lease_at_most_max_every(world: World) -> None:
    """No second renewal while one is in flight; after the answer, the next is due a third of the
    lease later, but never later than ``max_every``; a failed renewal before any answer is tried
    again a second later."""
    de = world.engine_stub("decode")
    world.announce(de, 1)
    assert len(world.renewals(100.0)) == 1
    assert world.renewals(100.1) == []  # in flight
    world.core.announcements.renewed(A, 3.0)
    assert world.renewals(100.9) == []
    assert len(world.renewals(101.0)) == 1  # 3.0 / 3
    world.core.announcements.renewed(A, 120.0)
    assert world.renewals(105.9, max_every=5.0) == []
    assert len(world.renewals(106.0, max_every=5.0)) == 1
    world.core.announcements.renewed(A, None)  # failed: the lease known stays
    assert world.renewals(110.0) == [] and len(world.renewals(111.0)) == 1

    other = World(world.engine_stub)
    other.announce(de, 5, address=B)
    assert len(other.renewals(1.0)) == 1
    other.core.announcements.renewed(B, None)  # unreachable, no lease known yet: again a second later
    assert other.renewals(1.9) == [] and len(other.renewals(2.0)) == 1


def test_expect_room_abort_and_the_engine_going_away_end_announcements(world: World) -> None:
    """ExpectRoom (its registration takes over), Abort and the engine going away end the
    announcement: no renewals once nothing is announced."""
    de = world.engine_stub("decode")
    for room in (1, 2, 3):
        world.announce(de, room)
    world.core.expect(ExpectRoom(engine=de, room=1, sender_address=A, sender_group="prefill-group", pages=np.array([0], dtype=np.int32), aux_row=0))
    world.core.abort(Abort(engine=de, room=2))
    (renewal,) = world.renewals(1.0)
    assert renewal.rooms == ((3, "prefill-group"),)
    world.core.announcements.renewed(A, 1.0)
    world.core.engine_gone(de, cause(common_pb2.FAILURE_KIND_ENGINE_LOST, "gone", "decode-broker"))
    assert world.core.announcements.announced(de) == {}
    assert world.renewals(100.0) == []

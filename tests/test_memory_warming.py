"""An engine's host memory is faulted in after its registration, in the background: a
registration costs what NIXL's own does, an engine let go while its memory warms is released
cleanly, and one whose memory the host cannot back is unregistered, its rooms failed."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvbroker import errors
from kvbroker.client import RoomState, SenderRef
from kvbroker.testing import eventually
from kvbroker.v1 import common_pb2

#: Where the engine table finds ``populate`` (patched by string: no private import).
POPULATE = "kvbroker.broker.memory._engines.populate"


class Gate:
    """A ``populate`` that waits for the test to open the gate, records its calls, then
    does the real work (or raises ``fail``)."""

    def __init__(self, real: Callable[[int, int], None], fail: OSError | None = None) -> None:
        self.real = real
        self.fail = fail
        self.open = threading.Event()
        self.entered = threading.Event()
        self.calls: list[tuple[int, int]] = []

    def __call__(self, address: int, length: int) -> None:
        self.entered.set()
        assert self.open.wait(20), "the test never opened the gate"
        if self.fail is not None:
            raise self.fail
        self.calls.append((address, length))
        self.real(address, length)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Gate]]:
    made: list[Gate] = []

    def make(fail: OSError | None = None) -> Gate:
        import importlib

        real = importlib.import_module("kvbroker.broker.memory._engines").populate
        g = Gate(real, fail)
        monkeypatch.setattr(POPULATE, g)
        made.append(g)
        return g

    yield make
    for g in made:  # never leave the memory thread waiting
        g.open.set()


def _engine_record(broker: Any, engine_id: str) -> Any:
    return broker.loop.call(lambda: broker.broker.queries.engine(engine_id))


def test_registration_does_not_wait_for_the_memory_to_fault_in(fake_brokers, make_engine, gate) -> None:
    g = gate()
    d = fake_brokers("d")
    engine = make_engine(d.address, "decode", num_pages=64)
    # Registered and usable while its memory has not been faulted in at all.
    assert g.entered.wait(10) and not g.calls
    record = _engine_record(d, engine.handle.engine_id)
    assert record.warming is not None
    receiver = engine.handle.receiver(5, SenderRef("127.0.0.1:1", "prefill-group"))
    receiver.init([0, 1])
    g.open.set()
    eventually(lambda: record.warming is None, 10)
    # Every byte of every host buffer was faulted in, each once.
    for buf in record.buffers:
        covered = sorted((a, n) for a, n in g.calls if buf.address <= a < buf.address + buf.size_bytes)
        assert covered[0][0] == buf.address
        assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))
        assert sum(n for _, n in covered) == buf.size_bytes
    receiver.abort("test over")


def test_an_engine_let_go_while_its_memory_warms_is_released(fake_brokers, make_engine, gate) -> None:
    """Its unmapping waits for the fault-in job that runs (the memory thread runs jobs in order)."""
    g = gate()
    d = fake_brokers("d")
    engine = make_engine(d.address, "decode")
    assert g.entered.wait(10)
    closing = threading.Thread(target=engine.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive(), "the engine was unmapped under a running fault-in job"
    g.open.set()
    closing.join(10)
    assert not closing.is_alive()
    eventually(lambda: not d.loop.call(d.broker.queries.engine_keys), 10)


def test_an_engine_whose_memory_cannot_be_backed_is_let_go(fake_brokers, make_engine, gate) -> None:
    """The host cannot back the buffer (ENOMEM while faulting in): the broker unregisters the
    engine, its rooms fail ENGINE_LOST saying why, its next call is refused (its session is
    over), and closing it is quiet."""
    g = gate(fail=OSError(errno.ENOMEM, "Cannot allocate memory"))
    d = fake_brokers("d")
    engine = make_engine(d.address, "decode")
    receiver = engine.handle.receiver(6, SenderRef("127.0.0.1:1", "prefill-group"))
    receiver.init([0, 1])
    eventually(lambda: d.tables()["receiver_rooms"] == 1, 10)  # the room is open at the broker
    g.open.set()
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED
    assert status.cause.kind == common_pb2.FAILURE_KIND_ENGINE_LOST, status.cause
    assert "cannot back" in status.cause.message, status.cause
    eventually(lambda: not d.loop.call(d.broker.queries.engine_keys), 10)
    rooms = iter(range(7, 1000))

    def refused() -> bool:
        """A new room is refused once the client has heard that the broker ended its session."""
        try:
            engine.handle.receiver(next(rooms), SenderRef("127.0.0.1:1", "prefill-group")).init([2])
        except errors.FailedPrecondition as exc:
            assert "ended this engine rank's session" in exc.message
            return True
        return False

    eventually(refused, 10)
    engine.close()

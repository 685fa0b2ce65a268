"""An engine's host memory is faulted in after its registration, in the background: a
registration costs what NIXL's own does, an engine let go while its memory warms is released
cleanly, and one whose memory the host cannot
back is unregistered, its rooms failed. What faults the memory in maps every page, writable,
and changes no byte."""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from kvbroker import errors
from kvbroker.broker.dataplane import WARM_NICE
from kvbroker.broker.memory import array_at, map_memory, populate, unmap
from kvbroker.client import RoomState, SenderRef
from kvbroker.testing import eventually
from kvbroker.v1 import admin_pb2, admin_pb2_grpc, common_pb2

#: Where the engine table finds ``populate`` (patched there, by string: the one private name).
POPULATE = "kvbroker.broker.memory._engines.populate"
PAGE = mmap.PAGESIZE


class Gate:
    """A ``populate`` that waits for the test to open the gate, records its calls, then
    does the real work (or raises ``fail``)."""

    def __init__(self, real: Callable[[int, int, int, int], None], fail: OSError | None = None) -> None:
        self.real = real
        self.fail = fail
        self.open = threading.Event()
        self.entered = threading.Event()
        self.calls: list[tuple[int, int]] = []
        #: The ranges a job was let run on after they had been unmapped.
        self.unmapped: list[tuple[int, int]] = []

    def __call__(self, address: int, length: int, fd: int = -1, offset: int = 0) -> None:
        self.entered.set()
        assert self.open.wait(20), "the test never opened the gate"
        if not _mapped(address, length):
            self.unmapped.append((address, length))
        if self.fail is not None:
            raise self.fail
        self.calls.append((address, length))
        self.real(address, length, fd, offset)


def _mapped(address: int, length: int) -> bool:
    """Whether this process maps every byte of ``[address, address + length)`` now."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            spans.append((start, end))
    at = address
    for start, end in sorted(spans):
        if start <= at < end:
            at = end
        if at >= address + length:
            return True
    return False


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Gate]]:
    made: list[Gate] = []

    def make(fail: OSError | None = None) -> Gate:
        real = populate
        g = Gate(real, fail)
        monkeypatch.setattr(POPULATE, g)
        made.append(g)
        return g

    yield make
    for g in made:  # never leave the memory thread waiting
        g.open.set()


def _listed(broker: Any) -> list[admin_pb2.EngineInfo]:
    """The broker's engines as ``Admin.ListEngines`` lists them."""
    with grpc.insecure_channel(broker.address) as channel:
        return list(admin_pb2_grpc.AdminStub(channel).ListEngines(admin_pb2.ListEnginesRequest(), timeout=10).engines)


def _engine_record(broker: Any, engine_id: str) -> Any:
    return broker.loop.call(lambda: broker.broker.queries.engine(engine_id))


def test_registration_does_not_wait_for_the_memory_to_fault_in(fake_brokers, make_engine, gate) -> None:
    """An engine registers and opens rooms while its memory is still faulting in (listed as warming); then every byte
    of every host buffer is faulted in, once."""
    g = gate()
    d = fake_brokers("d")
    engine = make_engine(d.address, "decode", num_pages=64)
    # Registered and usable while its memory has not been faulted in at all.
    assert g.entered.wait(10) and not g.calls
    record = _engine_record(d, engine.handle.engine_id)
    assert record.warming is not None
    assert [e.memory_warming for e in _listed(d)] == [True]
    receiver = engine.handle.receiver(5, SenderRef("127.0.0.1:1", "prefill-group"))
    receiver.init([0, 1])
    g.open.set()
    eventually(lambda: record.warming is None, 10)
    assert [e.memory_warming for e in _listed(d)] == [False]
    # Every byte of every host buffer was faulted in, each once.
    for buf in record.buffers:
        covered = sorted((a, n) for a, n in g.calls if buf.address <= a < buf.address + buf.size_bytes)
        assert covered[0][0] == buf.address
        assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))
        assert sum(n for _, n in covered) == buf.size_bytes
    receiver.abort("test over")


def test_an_engine_let_go_while_its_memory_warms_is_released(fake_brokers, make_engine, gate) -> None:
    """Its unmapping waits for the fault-in job that runs: the job, held at its start until the
    engine is being let go, still finds its range mapped when it runs."""
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
    assert not g.unmapped, "a fault-in job ran on memory already unmapped"
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


class Memfd:
    """A sealed memfd of ``pages`` pages mapped shared (as the broker maps an engine's), a few
    pages written first (as an engine would have)."""

    def __init__(self, pages: int) -> None:
        self.size = pages * PAGE
        self.fd = os.memfd_create("warming-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.size)
        self.address = map_memory(self.size, mmap.MAP_SHARED, self.fd)
        self.view = array_at(self.address, self.size)
        self.written = {3: 0x5A, pages // 2: 0xA5, pages - 1: 0x3C}
        for page, value in self.written.items():
            self.view[page * PAGE : (page + 1) * PAGE] = value

    def mapped_pages(self) -> int:
        """Pages of the mapping with a page table entry (``/proc/self/pagemap``, bit 63)."""
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(self.address // PAGE * 8)
            entries = struct.unpack(f"{self.size // PAGE}Q", f.read(self.size // PAGE * 8))
        return sum(e >> 63 for e in entries)

    def allocated_bytes(self) -> int:
        return os.fstat(self.fd).st_blocks * 512

    def assert_unchanged(self) -> None:
        for page in range(self.size // PAGE):
            assert int(self.view[page * PAGE : (page + 1) * PAGE].max()) == self.written.get(page, 0), page

    def close(self) -> None:
        del self.view
        unmap(self.address, self.size)
        os.close(self.fd)


@pytest.fixture
def memfd() -> Iterator[Callable[[int], Memfd]]:
    made: list[Memfd] = []

    def make(pages: int) -> Memfd:
        made.append(Memfd(pages))
        return made[-1]

    yield make
    for m in made:
        m.close()


@pytest.mark.parametrize("with_file", [True, False], ids=["allocated-in-the-file-then-read", "madvise-steps"])
def test_populate_maps_every_page_and_changes_no_byte(memfd: Callable[[int], Memfd], with_file: bool) -> None:
    """With the memfd: allocated in the file, then each page read (no memory-map lock held);
    without: MADV_POPULATE_WRITE. From an offset, only that range."""
    m = memfd(600)
    half = 300 * PAGE
    populate(m.address + half, m.size - half, m.fd if with_file else -1, half)
    assert m.mapped_pages() >= 300 and m.allocated_bytes() >= m.size - half
    populate(m.address, half, m.fd if with_file else -1, 0)
    assert m.mapped_pages() == 600 and m.allocated_bytes() == m.size
    m.assert_unchanged()


def test_populate_says_when_the_file_cannot_be_allocated(memfd: Callable[[int], Memfd]) -> None:
    """populate raises the OSError of a failed fallocate (EBADF for no such fd) rather than going on."""
    m = memfd(4)
    with pytest.raises(OSError) as raised:
        populate(m.address, m.size, 10_000, 0)  # no such fd: fallocate fails
    assert raised.value.errno == errno.EBADF


def test_memory_warms_on_a_thread_of_lower_priority_never_an_idle_one(fake_brokers, make_engine, gate) -> None:
    """The fault-in runs on the broker's ``kvb-warm`` thread at nice ``WARM_NICE``, under
    the normal policy: at idle priority (``SCHED_IDLE``) a busy host gave it no CPU, and
    every transfer that touched a page it was filling waited for it (issue 41)."""
    g = gate()
    d = fake_brokers("d")
    make_engine(d.address, "decode", num_pages=64)
    assert g.entered.wait(10)  # the warming thread is in its first job
    tasks = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as comm:
            tasks[int(tid)] = comm.read().strip()
    warm = [tid for tid, name in tasks.items() if name == "kvb-warm"]
    assert warm, f"no kvb-warm thread among {sorted(set(tasks.values()))}"
    nice = WARM_NICE
    for tid in warm:
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, tid) == nice > os.getpriority(os.PRIO_PROCESS, os.getpid())
    g.open.set()

"""An engine's host memory is faulted in after its registration, in the background: a
registration costs what NIXL's own does, an engine let go while its memory warms is released
cleanly (a helper process still faulting it in is stopped), and one whose memory the host cannot
back is unregistered, its rooms failed. What faults the memory in maps every page, writable,
and changes no byte."""

from __future__ import annotations

import errno
import importlib
import mmap
import os
import struct
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
#: The module that faults memory in (its functions are private to the broker's memory package).
IMPORTERS = importlib.import_module("kvbroker.broker.memory._importers")
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

    def __call__(self, address: int, length: int, fd: int = -1, offset: int = 0) -> None:
        self.entered.set()
        assert self.open.wait(20), "the test never opened the gate"
        if self.fail is not None:
            raise self.fail
        self.calls.append((address, length))
        self.real(address, length, fd, offset)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Gate]]:
    made: list[Gate] = []

    def make(fail: OSError | None = None) -> Gate:
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


class Memfd:
    """A sealed memfd of ``pages`` pages mapped shared (as the broker maps an engine's), a few
    pages written first (as an engine would have)."""

    def __init__(self, pages: int) -> None:
        self.size = pages * PAGE
        self.fd = os.memfd_create("warming-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.size)
        self.address = IMPORTERS.map_memory(self.size, mmap.MAP_SHARED, self.fd)
        self.view = IMPORTERS.array_at(self.address, self.size)
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
        IMPORTERS.unmap(self.address, self.size)
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
    IMPORTERS.populate(m.address + half, m.size - half, m.fd if with_file else -1, half)
    assert m.mapped_pages() >= 300 and m.allocated_bytes() >= m.size - half
    IMPORTERS.populate(m.address, half, m.fd if with_file else -1, 0)
    assert m.mapped_pages() == 600 and m.allocated_bytes() == m.size
    m.assert_unchanged()


def test_populate_says_when_the_file_cannot_be_allocated(memfd: Callable[[int], Memfd]) -> None:
    m = memfd(4)
    with pytest.raises(OSError) as raised:
        IMPORTERS.populate(m.address, m.size, 10_000, 0)  # no such fd: fallocate fails
    assert raised.value.errno == errno.EBADF


def _progress(fd: int) -> bytes:
    """What the helper wrote on its progress pipe until it ended."""
    os.set_blocking(fd, True)
    out = b""
    while chunk := os.read(fd, 64):
        out += chunk
    return out


def test_the_prefault_helper_allocates_the_pages_in_the_file_at_idle_priority(
    memfd: Callable[[int], Memfd], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper process faults the buffer in through a mapping of its own, a step at a time
    (a byte on its pipe each): the file's pages are allocated (every mapping of it sees them)
    and no byte changes; it runs SCHED_IDLE."""
    m = memfd(512)
    buf = IMPORTERS.ImportedBuffer(address=m.address, size_bytes=m.size, kind=common_pb2.MEMORY_KIND_DRAM, device_id=0,
                                   _unmap=lambda: None, fd=m.fd)
    progress = IMPORTERS.spawn_prefault(buf, 200 * PAGE)
    assert progress is not None and buf.helper is not None
    assert _progress(progress) == b"..."  # 200 + 200 + 112 pages
    assert buf.helper.wait(30) == 0
    assert m.allocated_bytes() == m.size
    m.assert_unchanged()
    buf.release()
    # Its priority: the same helper, held once it has faulted the pages in.
    monkeypatch.setattr(IMPORTERS, "_PREFAULT", IMPORTERS._PREFAULT + "\nimport time;time.sleep(60)")
    buf._released = False
    progress = IMPORTERS.spawn_prefault(buf, m.size)
    try:
        eventually(lambda: os.sched_getscheduler(buf.helper.pid) == os.SCHED_IDLE, 10)
    finally:
        buf.release()  # kills it
    assert buf.helper.returncode == -9
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this process's own is untouched


def test_releasing_an_engine_stops_its_prefault_helper(fake_brokers, make_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine let go while a helper faults its memory in: the helper is killed, not waited for."""
    monkeypatch.setattr(IMPORTERS, "_PREFAULT", "import time; time.sleep(120)")
    d = fake_brokers("d")
    engine = make_engine(d.address, "decode")
    record = _engine_record(d, engine.handle.engine_id)
    eventually(lambda: record.buffers[0].helper is not None, 10)
    helper = record.buffers[0].helper
    assert helper.poll() is None
    engine.close()
    eventually(lambda: not d.loop.call(d.broker.queries.engine_keys), 10)
    assert helper.wait(10) == -9


@pytest.mark.parametrize("helper", ["raise SystemExit(3)", "import time; time.sleep(120)"], ids=["exits-at-once", "never-steps"])
def test_a_helper_that_fails_or_stalls_leaves_the_work_to_the_broker(
    fake_brokers, make_engine, monkeypatch: pytest.MonkeyPatch, helper: str
) -> None:
    """The helper is advisory: one that exits at once, or takes longer than the broker's
    patience over a step (a host with no idle CPU; then it is stopped), changes nothing but
    who allocates the pages: every page of the engine's buffer is mapped in the broker all
    the same."""
    monkeypatch.setattr(IMPORTERS, "_PREFAULT", helper)
    monkeypatch.setattr(importlib.import_module("kvbroker.broker.memory._engines"), "_HELPER_STEP_PATIENCE_S", 0.2)
    d = fake_brokers("d")
    engine = make_engine(d.address, "decode", num_pages=64)
    record = _engine_record(d, engine.handle.engine_id)
    eventually(lambda: record.warming is None, 10)
    assert record.buffers[0].helper.returncode == (3 if "SystemExit" in helper else -9)
    with open("/proc/self/pagemap", "rb") as f:  # the in-process broker's mapping is this process's
        buf = record.buffers[0]
        f.seek(buf.address // PAGE * 8)
        entries = struct.unpack(f"{buf.size_bytes // PAGE}Q", f.read(buf.size_bytes // PAGE * 8))
    assert all(e >> 63 for e in entries)

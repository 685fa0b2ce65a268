"""Shared fixtures. Tiers (markers): unit tests need nothing; service tests run
in-process brokers with the scripted fake NIXL agent; ``nixl`` tests run
``kvbroker serve`` processes and move real bytes over loopback; ``gpu`` tests
need CUDA and skip without it."""

from __future__ import annotations

import os

# Every NIXL process these tests start stays on loopback.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvbroker import errors
from kvbroker.client import (
    BrokerClient,
    EngineHandle,
    EngineMemory,
    ModelSpec,
    RankSpec,
    RoomTimeouts,
)
from kvbroker.testing import Cleanup, FakeBroker, FakeFabric, LoopThread, start_fake_broker
from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
from kvbroker.testing.hosts import Network
from kvbroker.testing.hosts import unavailable as hosts_unavailable
from kvbroker.v1 import common_pb2

_ids = itertools.count()

# One tracer provider for the test process (in-process brokers use it), with
# an in-memory exporter the `finished_spans` fixture reads.
SPANS = InMemorySpanExporter()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(SPANS))
trace.set_tracer_provider(_provider)


@pytest.fixture
def finished_spans() -> Iterator[InMemorySpanExporter]:
    """The spans in-process brokers finish during the test."""
    SPANS.clear()
    yield SPANS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() >= 1:
        return
    skip = pytest.mark.skip(reason="needs CUDA devices")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temp dir (unix socket paths must stay under 108 bytes)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvb-") as d:
        yield Path(d)


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A module that sets ``MEMORY_KINDS = ("dram", "vram")`` runs each of its tests that makes
    engines or fake brokers once per memory kind."""
    kinds = getattr(metafunc.module, "MEMORY_KINDS", None)
    if kinds and "memory_kind" in metafunc.fixturenames:
        metafunc.parametrize("memory_kind", kinds, indirect=True)


@pytest.fixture
def memory_kind(request: pytest.FixtureRequest) -> str:
    """Where ``make_engine`` puts engines' memory: "dram" (default), or "vram": the fake CUDA
    driver's device memory, which the brokers import and move on the device path."""
    return str(getattr(request, "param", "dram"))


@pytest.fixture
def fake_cuda(memory_kind: str) -> Iterator[FakeCudaLib | None]:
    """The fake CUDA driver of a "vram" test (two devices); at the end nothing of it is held."""
    if memory_kind != "vram":
        yield None
        return
    fake = FakeCudaLib(devices=2, granularity=4096)
    yield fake
    assert fake.leaks() == [], "every device allocation and mapping was released"


def assert_device_rules(broker: FakeBroker) -> None:
    """What the device path promises, as the fake agent saw it over its whole life (also after the
    engines have gone): no engine VRAM was ever registered with NIXL (only the broker's cudaMalloc
    transfer buffers), and no VRAM write read from or targeted anything else (a VMM target would
    have moved at host speed)."""
    agent = broker.agent
    assert set(agent.vram_registered) <= {"cudaMalloc"}, f"VRAM registered with NIXL: {agent.vram_registered}"
    assert set(agent.vram_sources) <= {"cudaMalloc"}, f"VRAM written from: {agent.vram_sources}"
    assert set(agent.vram_targets) <= {"cudaMalloc"} and agent.host_speed_writes == 0, f"VRAM written to: {agent.vram_targets}"


@pytest.fixture
def fake_brokers(loop_thread: LoopThread, short_tmp: Path, fake_cuda: FakeCudaLib | None) -> Iterator[Callable[..., FakeBroker]]:
    """Factory of in-process brokers sharing one fake fabric; every one is stopped at the end.
    In a "vram" test they use the fake CUDA driver and keep to the device path's rules."""
    fabric = FakeFabric()
    started: list[FakeBroker] = []

    def start(name: str = "", *, cuda: FakeCudaLib | None = None, **config: object) -> FakeBroker:
        """``cuda``: the fake CUDA driver this broker uses (a "vram" test's, unless given)."""
        settings: dict[str, object] = {
            "staging_send_bytes": 8 << 20,
            "staging_receive_bytes": 8 << 20,
            "device_send_bytes": 8 << 20,
            "device_receive_bytes": 8 << 20,
            **config,
        }
        broker = start_fake_broker(
            loop_thread, fabric, short_tmp, name or f"b{next(_ids)}", cuda=cuda if cuda is not None else fake_cuda, **settings
        )
        started.append(broker)
        return broker

    yield start
    with Cleanup() as cleanup:
        if fake_cuda is not None:
            for broker in started:
                cleanup.run(lambda broker=broker: assert_device_rules(broker))
        for broker in started:
            # However its rooms failed, a broker the test left running holds nothing (seed #27011).
            if not broker.stopped:
                cleanup.run(broker.wait_buffers_free)
        for broker in reversed(started):
            cleanup.run(broker.stop)


SMALL_MODEL = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)


@dataclass
class Engine:
    client: BrokerClient
    handle: EngineHandle
    memory: EngineMemory
    #: What unregistering may fail with because the test took the engine's
    #: session or broker away on purpose (see :meth:`die`, :meth:`lost_broker`).
    expected_close_error: type[Exception] | tuple[type[Exception], ...] = ()

    def die(self) -> None:
        """What the kernel does when the engine process dies: the session closes
        without unregistering. The broker drops the engine, so unregistering at
        the end fails as ``NotFound``."""
        assert self.handle._fd_session is not None
        self.handle._fd_session.close()
        self.expected_close_error = errors.NotFound

    def lost_broker(self) -> None:
        """The test stopped this engine's broker on purpose: unregistering at the
        end fails as ``Unavailable``."""
        self.expected_close_error = errors.Unavailable

    def close(self) -> None:
        """Unregister, then close the connection (that too when unregistering fails)."""
        with Cleanup() as cleanup:
            cleanup.run(self.handle.close, expect=self.expected_close_error)
            cleanup.run(self.client.close)


@pytest.fixture
def make_engine(fake_cuda: FakeCudaLib | None) -> Iterator[Callable[..., Engine]]:
    """Register an engine rank with a broker; filled with random bytes for prefill. In a "vram"
    test its memory is the fake driver's device memory (device: its tp rank modulo 2)."""
    engines: list[Engine] = []

    def make(
        address: str,
        role: str,
        group: str | None = None,
        *,
        model: ModelSpec = SMALL_MODEL,
        num_pages: int = 32,
        aux_rows: int = 4,
        aux_row_bytes: tuple[int, ...] = (16,),
        tp_size: int = 1,
        tp_rank: int = 0,
        pp_size: int = 1,
        pp_rank: int = 0,
        state: tuple = (),
        seed: int = 0,
        timeouts: RoomTimeouts | None = None,
    ) -> Engine:
        rank = RankSpec(
            group=group or f"{role}-group",
            role=role,  # type: ignore[arg-type]
            tp_size=tp_size,
            tp_rank=tp_rank,
            pp_size=pp_size,
            pp_rank=pp_rank,
        )
        memory = EngineMemory.allocate(
            rank, model, num_pages=num_pages, aux_rows=aux_rows, aux_row_bytes=aux_row_bytes, state=state
        )
        if role in ("prefill", "both"):
            fill_regions(memory, seed)
        if fake_cuda is not None:
            as_fake_vram(memory, fake_cuda, device=tp_rank % 2)
        client = BrokerClient(address)
        engine = Engine(client, client.register_engine(rank, memory, timeouts=timeouts), memory)
        engines.append(engine)
        return engine

    yield make
    # Guard memory around every region: nothing may have written outside one.
    overwritten = {str(e.handle.rank.group): e.memory.check_guards() for e in engines}

    def guards_intact() -> None:
        assert not any(overwritten.values()), overwritten

    with Cleanup() as cleanup:
        for engine in engines:
            cleanup.run(engine.close)
        cleanup.run(guards_intact)


def fill_regions(memory: EngineMemory, seed: int) -> None:
    """Random bytes in every region (not in the guards around them)."""
    gen = torch.Generator().manual_seed(seed)
    assert memory.raw is not None
    for region in memory.layout.regions:
        span = memory.raw[region.offset_bytes : region.offset_bytes + region.length_bytes]
        span.copy_(torch.randint(0, 256, span.shape, dtype=torch.uint8, generator=gen))


def page_bytes(memory: EngineMemory, layer: int, pages) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """The bytes of ``pages`` of every KV tensor of ``layer`` (for comparisons)."""
    index = torch.as_tensor(pages, dtype=torch.int64)
    return [t.view(torch.uint8)[index] for t in memory.kv_tensors(layer)]


def token_bytes(memory: EngineMemory, layer: int, pages, first: int, begin: int, end: int) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Room tokens [begin, end) of every KV tensor of ``layer``, gathered from ``pages`` (which hold
    room pages from ``first``): [tokens, bytes of a token] per tensor (token-major pages)."""
    size = memory.layout.page_size_tokens
    room = torch.arange(begin, end)
    ids = torch.as_tensor(pages, dtype=torch.int64)[room // size - first]
    offsets = room % size
    assert memory.layout.kv_layout == common_pb2.KV_LAYOUT_NHD, "tokens are rows of token-major pages only"
    return [t.view(torch.uint8)[ids, offsets].reshape(end - begin, -1) for t in memory.kv_tensors(layer)]


@pytest.fixture
def network() -> Iterator[Callable[..., Network]]:
    """``network("p", "d", ...)``: hosts of their own (kvbroker.testing.hosts),
    removed after the test with whatever still runs on them. Skips with one
    line where namespaces cannot be made, unless KVBROKER_REQUIRE_HOSTS=1
    (.ci/run sets it): then that line fails the test."""
    made: list[Network] = []

    def make(*names: str) -> Network:
        reason = hosts_unavailable()
        if reason:
            if os.environ.get("KVBROKER_REQUIRE_HOSTS") == "1":
                pytest.fail(f"KVBROKER_REQUIRE_HOSTS=1 but {reason}")
            pytest.skip(reason)
        made.append(Network(names).open())
        return made[-1]

    yield make
    with Cleanup() as cleanup:
        for net in made:
            cleanup.run(net.close)

"""In-process brokers with fake NIXL agents: the service tests' cluster.

:func:`start_fake_broker` starts a :class:`~kvbroker.broker.BrokerServer` on a
:class:`~kvbroker.testing.LoopThread`, with a
:class:`~kvbroker.testing.FakeAgent` on a shared
:class:`~kvbroker.testing.FakeFabric` (so brokers started on one fabric move
bytes to each other), listening on a free loopback port and serving engines
on a unix socket in ``sock_dir``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbroker import cudavmm
from kvbroker.broker import BrokerConfig, BrokerServer
from kvbroker.broker.runtime import Broker
from kvbroker.testing.fake_nixl import FakeAgent, FakeFabric
from kvbroker.testing.gpu_model import ModelledStreams
from kvbroker.testing.loop import LoopThread
from kvbroker.testing.waiting import eventually

if TYPE_CHECKING:
    from kvbroker.broker.device import Streams
    from kvbroker.testing.fake_cuda import FakeCudaLib

__all__ = ["FakeBroker", "start_fake_broker"]


@dataclass
class FakeBroker:
    """An in-process broker with a fake NIXL agent."""

    server: BrokerServer
    agent: FakeAgent
    loop: LoopThread
    #: Whether :meth:`stop` was called (a stopped broker has released everything).
    stopped: bool = False

    @property
    def address(self) -> str:
        """The broker's gRPC address (``127.0.0.1:<port>``)."""
        return self.server.address

    @property
    def broker(self) -> Broker:
        """The broker: read it through ``broker.queries``, reach a part (to
        inject a fault) through ``broker.internals``; on the loop thread
        (``loop.call``)."""
        return self.server.broker

    def tables(self) -> dict[str, int]:
        """The sizes of the broker's room tables."""
        return dict(self.loop.call(self.broker.queries.rooms.table_sizes))

    def pools_in_use(self) -> tuple[int, int]:
        """Bytes reserved now in the broker's send and receive buffers (staging
        and transfer buffers: what the Admin service's Stats reports)."""
        queries = self.broker.queries
        send: int = self.loop.call(lambda: queries.traffic.staging_in_use("send"))
        receive: int = self.loop.call(lambda: queries.traffic.staging_in_use("receive"))
        return send, receive

    def wait_buffers_free(self, timeout_seconds: float = 10.0) -> None:
        """Wait until nothing is reserved in the broker's buffers (``AssertionError``
        naming what still is, if not in time). However its rooms failed, every
        slot comes back; idle credits go back to their receiver after a second
        unused, so this may wait that long."""
        eventually(
            lambda: self.pools_in_use() == (0, 0),
            timeout_seconds,
            describe=lambda: f"{self.agent.name}: {self.pools_in_use()} bytes (send, receive) still reserved",
        )

    def evict_now(self) -> None:
        """Evict every finished room and tombstone at once."""
        self.loop.call(lambda: self.broker.routes.housekeeping.evict(time.monotonic() + 3600, everything=True))
        self.loop.call(lambda: self.broker.routes.housekeeping.evict(time.monotonic() + 7200, everything=True))

    def stop(self, grace_seconds: float = 0.1) -> None:
        """Stop serving and release everything (``BrokerServer.stop``)."""
        self.stopped = True
        self.loop.run(self.server.stop(grace_seconds=grace_seconds))


def start_fake_broker(
    loop: LoopThread,
    fabric: FakeFabric,
    sock_dir: str | Path,
    name: str,
    *,
    cuda: FakeCudaLib | None = None,
    streams: Streams | None = None,
    **config: Any,
) -> FakeBroker:
    """Start a broker named ``name`` on ``loop`` and return once it serves.

    Its agent is ``fake_<name>_agent`` on ``fabric``; it listens on
    ``127.0.0.1:0`` and serves engines on ``<sock_dir>/<name>.sock`` (keep
    ``sock_dir`` short: unix socket paths must stay under 108 bytes).
    ``config`` sets any other :class:`~kvbroker.broker.BrokerConfig` field,
    or overrides those two. Stop it with :meth:`FakeBroker.stop`.

    ``cuda``: the fake CUDA driver. VRAM buffers import through it, its
    "device memory" (host memory) is viewed as torch CPU tensors, and the
    fake NIXL agent follows the rules a real GPU showed for it. ``streams``
    (with ``cuda``): how its GPU lanes launch and wait; a modelled GPU's
    (``gpu_model.ModelledStreams``) also times the agent's VRAM writes.
    """
    agent = FakeAgent(f"fake_{name}_agent", fabric, cuda=cuda)
    if isinstance(streams, ModelledStreams):
        agent.clock = streams.clock()
    settings: dict[str, Any] = {
        "listen_address": "127.0.0.1:0",
        "engine_socket_path": str(Path(sock_dir) / f"{name}.sock"),
        **config,
    }
    try:
        server = BrokerServer(
            BrokerConfig(**settings),
            agent=agent,
            cuda_driver=cudavmm.Driver(cuda) if cuda is not None else None,
            device_as_host=cuda is not None,
            device_streams=streams,
        )
        loop.run(server.start())
    except BaseException:
        agent.close()
        raise
    return FakeBroker(server=server, agent=agent, loop=loop)

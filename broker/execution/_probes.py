"""The transport self-test: how fast one pair of transfer buffers really moves bytes.

A GPU's bytes can move at device speed (CUDA IPC on one host, GPUDirect RDMA
between hosts) or, when UCX finds no device transport, through the host
(TCP: 0.3-0.5 GB/s on an H100, ../shared/gpu/README.md), every byte still
right. Timing real parts cannot tell the two apart well: a part is timed with
its descriptors and the data plane's polling, and the first write to a peer
opens its CUDA IPC handle. So when a packed part first pairs one of this
broker's send buffers with a peer's receive buffer (and on demand,
``Admin.ProbeTransport``), the broker probes the pair:

1. a slot of its send buffer and, through ``PeerBroker.ReserveProbe``, a
   slot of the peer's receive buffer (held by the peer for no room, until
   ``ReleaseProbe`` or a lease's end);
2. one untimed write (it opens the peer's IPC handle), then ``WRITES`` timed
   ones, slot to slot, each timed on the data-plane thread from its post to
   DONE; a write not done by the time it would have taken at the floor is
   below it (the host fallback), is waited for off that thread, and ends the
   probe;
3. the verdict: "device speed" at ``--transport-floor-gbps`` or above
   (a quarter of it where one side is host memory), "host fallback" under
   it, "failed: ..." if the probe could not run
   (the parts go on either way). It is kept on the peer (``Peer.transports``,
   shown by ``ListPeers``), goes to the metric ``kvbroker.transport.gbps``
   and to every packed part's and room's span (``kvbroker.transport``), and a
   fallback is logged once as a warning with its figure.

Pairs where neither side is a GPU's are not probed. A pair is probed once per
peer process and receive buffer (a peer's new buffer is probed again).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import numpy as np
import structlog

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import Agent, XferState
from kvbroker.broker.execution._bundles import Transport
from kvbroker.broker.execution._tasks import TaskSet
from kvbroker.broker.memory import StagingBuffer
from kvbroker.broker.peers import (
    DEVICE_SPEED,
    HOST_FALLBACK,
    Peer,
    PoolKey,
    TransportVerdict,
    pool_name,
)
from kvbroker.broker.telemetry import BrokerMetrics
from kvbroker.errors import FailedPrecondition, KvBrokerError, NixlError, TransferTimeout
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["TransportProbes"]

log = structlog.get_logger(__name__)

VRAM = common_pb2.MEMORY_KIND_VRAM
#: Timed writes of a probe (after one untimed).
WRITES = 3
#: How often a write slower than the floor is checked, off the data-plane thread.
_SLOW_CHECK_S = 2e-3
_ALIGN = 4096


class TransportProbes:
    """Probes pairs of transfer buffers and keeps their verdicts. Control loop only."""

    def __init__(
        self,
        *,
        broker_id: str,
        config: BrokerConfig,
        transport: Transport,
        tasks: TaskSet,
        metrics: BrokerMetrics,
    ) -> None:
        self._id = broker_id
        self._config = config
        self._dataplane = transport.dataplane
        self._peers = transport.peers
        self._client = transport.client
        self._pools = transport.pools
        self._tasks = tasks
        self._metrics = metrics
        self._floor_bps = config.transport_floor_gbps * 1e9
        #: Probes under way, by (peer broker id, our send buffer, its receive buffer).
        self._running: dict[tuple[str, PoolKey, PoolKey], asyncio.Task[TransportVerdict]] = {}

    def verdict(self, peer: Peer, local: PoolKey, remote: PoolKey) -> TransportVerdict | None:
        """The pair's verdict, if it was probed with the peer's current buffer."""
        known = peer.transports.get((local, remote))
        buffer = peer.receive_staging.get(remote)
        if known is None or buffer is None or buffer.address != known.remote_address:
            return None
        return known

    async def ensure(self, peer: Peer, local: PoolKey, remote: PoolKey) -> TransportVerdict | None:
        """The pair's verdict, probing it first if it has none (one probe,
        however many parts ask). None for a pair of host buffers."""
        if VRAM not in (local[0], remote[0]):
            return None
        known = self.verdict(peer, local, remote)
        if known is not None:
            return known
        return await asyncio.shield(self._start(peer, local, remote))

    async def probe(self, peers: list[Peer]) -> None:
        """Probe now every pair of our send buffers and each peer's receive
        buffers where either side is a GPU's (``Admin.ProbeTransport``)."""
        for peer in peers:
            if peer.broker_id is None or peer.is_self:
                continue
            for local in self._pools.keys("send"):
                for remote in list(peer.receive_staging):
                    if VRAM in (local[0], remote[0]):
                        await asyncio.shield(self._start(peer, local, remote))

    def _start(self, peer: Peer, local: PoolKey, remote: PoolKey) -> asyncio.Task[TransportVerdict]:
        """The probe of the pair under way, or a new one."""
        assert peer.broker_id is not None
        key = (peer.broker_id, local, remote)
        task = self._running.get(key)
        if task is None:
            task = self._running[key] = self._tasks.spawn(self._probe(peer, local, remote), name=f"probe-{pool_name(local)}")

            def ended(_task: asyncio.Task[TransportVerdict]) -> None:
                if self._running.get(key) is task:
                    del self._running[key]

            task.add_done_callback(ended)
        return task

    async def _probe(self, peer: Peer, local: PoolKey, remote: PoolKey) -> TransportVerdict:
        broker_id = peer.broker_id
        buffer = peer.receive_staging.get(remote)
        nbytes, times = 0, list[float]()
        try:
            if buffer is None:
                raise FailedPrecondition(f"the peer announced no receive buffer for {pool_name(remote)}")
            nbytes, times = await self._measure(peer, local, remote, buffer)
            gbps = nbytes / statistics.median(times) / 1e9
            outcome = DEVICE_SPEED if gbps * 1e9 >= self._floor(local, remote) else HOST_FALLBACK
        except KvBrokerError as exc:
            gbps, outcome = 0.0, f"failed: {exc.message}"
        except Exception as exc:  # a bug: logged, and the parts go on without a verdict
            log.error("transport_probe_failed", peer=peer.address, error=repr(exc), exc_info=exc)
            gbps, outcome = 0.0, f"failed: {exc!r}"
        verdict = TransportVerdict(
            local=local,
            remote=remote,
            remote_address=buffer.address if buffer is not None else 0,
            verdict=outcome,
            gbps=gbps,
            floor_gbps=self._floor(local, remote) / 1e9,
            nbytes=nbytes,
            writes=len(times),
        )
        if peer.broker_id != broker_id:
            return verdict  # the peer restarted meanwhile: its new process is probed anew
        before = peer.transports.get((local, remote))
        peer.transports[(local, remote)] = verdict
        self._metrics.transport_gbps = {
            **{k: v for k, v in self._metrics.transport_gbps.items() if k[:2] != (peer.address, _pair(verdict))},
            (peer.address, _pair(verdict), outcome.split(":")[0]): gbps,
        }
        fields = dict(peer=peer.address, pair=_pair(verdict), verdict=outcome, gbps=round(gbps, 3), bytes=nbytes, writes=len(times))
        log.info("transport_probed", **fields)
        if verdict.fell_back and (before is None or not before.fell_back):
            log.warning(
                "transport_host_fallback",
                **fields,
                floor_gbps=verdict.floor_gbps,
                hint="GPU memory moves through the host (UCX found no CUDA transport: check UCX_TLS, UCX_NET_DEVICES, "
                "and UCX_PROTO_INFO=y in the broker's environment)",
            )
        elif outcome.startswith("failed") and (before is None or before.verdict != outcome):
            log.warning("transport_probe_failed", **fields)
        return verdict

    def _floor(self, local: PoolKey, remote: PoolKey) -> float:
        """The floor of a pair (bytes/s): ``--transport-floor-gbps`` between two
        GPUs' buffers, a quarter of it where one side is host memory (its bytes
        cross PCIe either way: 20-50 GB/s, not a GPU's link)."""
        return self._floor_bps if local[0] == remote[0] == VRAM else self._floor_bps / 4

    async def _measure(self, peer: Peer, local: PoolKey, remote: PoolKey, buffer: peer_pb2.RemoteBuffer) -> tuple[int, list[float]]:
        """(bytes per write, seconds of each timed write)."""
        assert peer.broker_id is not None and peer.agent_name is not None
        pool = self._pools.pool("send", *local)
        if pool is None:
            raise FailedPrecondition(f"this broker has no send buffer for {pool_name(local)}")
        nbytes = min(self._config.transport_probe_bytes, pool.size_bytes // 2, buffer.size_bytes // 2) // _ALIGN * _ALIGN
        if nbytes <= 0:
            raise FailedPrecondition("the transfer buffers are too small to probe")
        wait = self._config.staging_wait_seconds
        mine = await pool.reserve_slot(nbytes, wait)
        try:
            request = peer_pb2.ReserveProbeRequest(
                protocol_version=PROTOCOL_VERSION, sender_broker_id=self._id, kind=remote[0], device_id=remote[1], bytes=nbytes  # type: ignore[arg-type]
            )
            theirs = await self._client.reserve_probe(peer.broker_id, request)
            try:
                write = _Write(pool.buffer, mine.offset, theirs.buffer, theirs.offset, nbytes, peer.agent_name)
                return nbytes, await self._writes(write)
            finally:
                try:
                    await self._client.release_probe(peer.broker_id, theirs.probe_id)
                except KvBrokerError as exc:  # its lease frees it
                    log.info("probe_release_failed", peer=peer.address, error=exc.message)
        finally:
            pool.release(mine)

    async def _writes(self, write: _Write) -> list[float]:
        """One untimed write, then the timed ones; a write slower than the
        floor is waited for off the data-plane thread and ends the probe."""
        limit = max(write.nbytes / self._floor(write.local_key, write.remote_key), 1e-3)
        started, handle = await self._dataplane.call(lambda agent: write.post(agent))
        await self._finish(handle, started)
        times: list[float] = []
        for _ in range(WRITES):
            elapsed, started, handle = await self._dataplane.call(lambda agent: write.timed(agent, limit))
            if handle is None:
                times.append(elapsed)
                continue
            times.append(await self._finish(handle, started))
            break
        return times

    async def _finish(self, handle: Any, started: float) -> float:
        """Wait for a write still in flight (checked every few ms on the data
        plane); its seconds since ``started``. Cancelled at the transfer timeout."""
        timeout = self._config.transfer_timeout_seconds
        try:
            while True:
                state = await self._dataplane.call(lambda agent: agent.check(handle))
                elapsed = time.perf_counter() - started
                if state is XferState.DONE:
                    return elapsed
                if state is not XferState.PROC:
                    raise NixlError("a probe write failed")
                if elapsed > timeout:
                    raise TransferTimeout(f"a probe write did not finish in {timeout:g} s")
                await asyncio.sleep(_SLOW_CHECK_S)
        finally:
            await self._dataplane.call(lambda agent: agent.release_xfer(handle))


def _pair(verdict: TransportVerdict) -> str:
    return f"{pool_name(verdict.local)}->{pool_name(verdict.remote)}"


class _Write:
    """One probe write, slot to slot (its calls run on the data-plane thread)."""

    def __init__(
        self, buffer: StagingBuffer, offset: int, remote: peer_pb2.RemoteBuffer, remote_offset: int, nbytes: int, agent_name: str
    ) -> None:
        self.buffer = buffer
        self.local_key = (buffer.kind, buffer.device_id if buffer.kind == VRAM else 0)
        self.remote_key = (int(remote.kind), remote.device_id if remote.kind == VRAM else 0)
        self.nbytes = nbytes
        self.agent_name = agent_name
        self.remote_kind = remote.kind
        self.local = np.array([[buffer.address + offset, nbytes, buffer.device_id]], dtype=np.uint64)
        self.far = np.array([[remote.address + remote_offset, nbytes, remote.device_id]], dtype=np.uint64)

    def post(self, agent: Agent) -> tuple[float, Any]:
        if self.buffer.make_current is not None:
            self.buffer.make_current()
        started = time.perf_counter()
        return started, agent.post_write_descs(self.local, self.buffer.kind, self.far, self.remote_kind, self.agent_name, b"")

    def timed(self, agent: Agent, limit: float) -> tuple[float, float, Any]:
        """Post and check until DONE: (seconds, when posted, None); or, not
        done within ``limit`` seconds (under the floor), (0, when posted, the
        handle still in flight)."""
        started, handle = self.post(agent)
        try:
            while (state := agent.check(handle)) is XferState.PROC:
                if time.perf_counter() - started > limit:
                    return 0.0, started, handle
                time.sleep(0)  # lets the control loop take the GIL
        except BaseException:
            agent.release_xfer(handle)
            raise
        elapsed = time.perf_counter() - started
        agent.release_xfer(handle)
        if state is not XferState.DONE:
            raise NixlError("a probe write failed")
        return elapsed, started, None


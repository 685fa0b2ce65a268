"""This broker's record in etcd: how brokers and operators see the fleet (``serve --etcd``).

With ``--etcd http://HOST:PORT`` the broker keeps one key,
``{prefix}/brokers/{broker_id}``, under an etcd lease of ``--etcd-ttl``
seconds that it refreshes every third of that. The value is JSON: the
broker id, the address peers dial, the wire protocol version, the package
version, when it started, and every engine group registered with it (role,
tp and pp sizes, the ranks it holds here, the model's layers, page size,
KV heads, dtype), and whether it is draining (receivers then look for
the group elsewhere, or wait for it). The key is rewritten whenever
engines come or go or the broker starts or stops draining,
deleted (the lease revoked) on a clean stop, and gone within the TTL after
a broker is killed.

When etcd cannot be reached the broker goes on serving rooms with the
peers it knows, logs ``etcd_unreachable`` once, and registers again (a new
lease) as soon as etcd answers (``etcd_registered``). ``kvbroker fleet``
reads the records (:func:`read_fleet`).

The client is ``aetcd`` (asyncio, grpcio; it works with this project's
grpcio and protobuf 7, which the older ``etcd3`` package does not): see
docs/operations.md. Receivers resolve sender groups through these records
with ``broker.discovery.FleetView``.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import structlog

from kvbroker import __version__
from kvbroker.broker.aio import cancel_and_wait
from kvbroker.errors import InvalidArgument
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2

__all__ = [
    "ETCD_CHANNEL_OPTIONS",
    "FleetRecord",
    "broker_key",
    "brokers_prefix",
    "etcd_client",
    "parse_endpoint",
    "probe_broker",
    "read_fleet",
]

log = structlog.get_logger(__name__)


def parse_endpoint(url: str) -> tuple[str, int]:
    """``http://HOST:PORT`` (or ``HOST:PORT``) as (host, port)."""
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "") or not parsed.hostname:
        raise InvalidArgument(f"--etcd must be http://HOST:PORT, got {url!r} (TLS to etcd is not supported yet)")
    return parsed.hostname, parsed.port or 2379


#: gRPC keepalive on the connections to etcd: a connection that went silent
#: (a host or network gone without a reset) breaks within about 15 s, so the
#: watch and the lease notice it (etcd refuses pings more often than every
#: 5 s by default: ``--grpc-keepalive-min-time``).
ETCD_CHANNEL_OPTIONS = {"grpc.keepalive_time_ms": 10_000, "grpc.keepalive_timeout_ms": 5_000}


def etcd_client(host: str, port: int, timeout: float) -> Any:
    """An ``aetcd.Client`` (connected on first use) with this project's channel options."""
    import aetcd

    return aetcd.Client(host=host, port=port, timeout=timeout, options=ETCD_CHANNEL_OPTIONS)


def brokers_prefix(prefix: str) -> str:
    """The key prefix of the broker records under the fleet prefix ``prefix``."""
    return f"{prefix.rstrip('/')}/brokers/"


def broker_key(prefix: str, broker_id: str) -> bytes:
    return f"{brokers_prefix(prefix)}{broker_id}".encode()


class FleetRecord:
    """Keeps this broker's key in etcd while it serves (control loop only)."""

    def __init__(
        self,
        url: str,
        prefix: str,
        ttl_seconds: float,
        *,
        broker_id: str,
        address: str,
        groups: Callable[[], dict[str, Any]],
        draining: Callable[[], bool],
    ) -> None:
        self.host, self.port = parse_endpoint(url)
        self.prefix = prefix
        self.ttl = max(1, round(ttl_seconds))
        self.key = broker_key(prefix, broker_id)
        self._broker_id = broker_id
        self._address = address
        self._groups = groups
        self._draining = draining
        self._started = time.time()
        self._client: Any = None
        self._lease: Any = None
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Whether the key is in etcd as far as this broker knows (health, logs).
        self.registered = False

    def value(self) -> bytes:
        return json.dumps(
            {
                "broker_id": self._broker_id,
                "address": self._address,
                "protocol": PROTOCOL_VERSION,
                "version": __version__,
                "started_at": self._started,
                "groups": self._groups(),
                "draining": self._draining(),
            },
            sort_keys=True,
        ).encode()

    async def start(self) -> None:
        """Register once (waiting for etcd up to one TTL), then keep the key alive in the background."""
        try:
            await asyncio.wait_for(self._register(), self.ttl)
        except Exception as exc:  # noqa: BLE001 - etcd down at start: serve anyway, keep trying
            log.warning("etcd_unreachable", etcd=f"{self.host}:{self.port}", error=str(exc) or type(exc).__name__)
        self._task = asyncio.create_task(self._keep(), name="kvbroker-etcd")

    def changed(self) -> None:
        """Engines came or went: rewrite the key soon."""
        self._dirty.set()

    async def stop(self) -> None:
        """Delete the key (revoke the lease) and close."""
        if self._task is not None:
            await cancel_and_wait([self._task])
        if self._lease is not None:
            try:
                await asyncio.wait_for(self._lease.revoke(), 2.0)
                log.info("etcd_unregistered", key=self.key.decode())
            except Exception as exc:  # noqa: BLE001 - stopping: the lease expires anyway
                log.warning("etcd_unregister_failed", error=str(exc) or type(exc).__name__)
        await self._close()

    async def _register(self) -> None:
        await self._close()
        self._client = etcd_client(self.host, self.port, self.ttl)
        self._lease = await self._client.lease(ttl=self.ttl)
        await self._client.put(self.key, self.value(), lease=self._lease)
        self.registered = True
        log.info("etcd_registered", key=self.key.decode(), ttl=self.ttl, lease=self._lease.id)

    async def _close(self) -> None:
        client, self._client = self._client, None
        self._lease = None
        self.registered = False
        if client is not None:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - a broken connection closes badly
                pass

    async def _keep(self) -> None:
        interval = self.ttl / 3
        while True:
            try:
                await asyncio.wait_for(self._dirty.wait(), interval)
            except asyncio.TimeoutError:
                pass
            dirty = self._dirty.is_set()
            self._dirty.clear()
            try:
                if not self.registered:
                    await asyncio.wait_for(self._register(), self.ttl)
                elif dirty:
                    await asyncio.wait_for(self._client.put(self.key, self.value(), lease=self._lease), self.ttl)
                else:
                    await asyncio.wait_for(self._lease.refresh(), self.ttl)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd gone or lease lost: register again later
                if self.registered:
                    log.warning("etcd_unreachable", etcd=f"{self.host}:{self.port}", error=str(exc) or type(exc).__name__)
                await self._close()
                self._dirty.set()  # the record to write once etcd is back
                await asyncio.sleep(interval)


def groups_of(engines: Any) -> dict[str, Any]:
    """The engine groups registered with a broker, for its record (``EngineTable``)."""
    out: dict[str, Any] = {}
    for engine in engines.by_id.values():
        layout = engine.layout
        group = out.setdefault(
            engine.key.group,
            {
                "role": common_pb2.Role.Name(layout.role).removeprefix("ROLE_").lower(),
                "tp_size": layout.tp_size,
                "pp_size": layout.pp_size,
                "num_layers": layout.num_layers,
                "page_size": layout.page_size_tokens,
                "kv_heads": layout.total_kv_heads,
                "dtype": layout.dtype,
                "mla": layout.mla,
                "ranks": [],
            },
        )
        group["ranks"].append(f"tp{engine.key.tp_rank}/pp{engine.key.pp_rank}")
    for group in out.values():
        group["ranks"].sort()
    return out


async def read_fleet(url: str, prefix: str = "/kvbroker", *, probe: bool = False) -> list[dict[str, Any]]:
    """Every broker record under ``prefix``, with its lease's remaining TTL.
    ``probe``: also ask each broker itself (:func:`probe_broker`)."""
    host, port = parse_endpoint(url)
    records = []
    async with etcd_client(host, port, 5) as client:
        for kv in await client.get_prefix(brokers_prefix(prefix).encode()):
            record = json.loads(kv.value)
            ttl = await client.get_lease_info(kv.lease) if kv.lease else None
            record["lease_ttl"] = getattr(ttl, "TTL", None)
            record["lease_granted"] = getattr(ttl, "grantedTTL", None)
            records.append(record)
    if probe:
        answers = await asyncio.gather(*(probe_broker(str(r["address"])) for r in records))
        for record, answer in zip(records, answers, strict=True):
            record.update(answer)
    return sorted(records, key=lambda r: str(r.get("address")))


async def probe_broker(address: str, timeout_seconds: float = 3.0) -> dict[str, Any]:
    """What a broker says of itself: ``health`` (its gRPC health status, or
    why it did not answer), ``open_rooms``, ``draining`` and ``etcd``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvbroker.v1 import admin_pb2, admin_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        try:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_seconds)
            stats = await admin_pb2_grpc.AdminStub(channel).GetStats(admin_pb2.GetStatsRequest(), timeout=timeout_seconds)
        except grpc.aio.AioRpcError as exc:
            return {"health": f"UNREACHABLE ({exc.code().name}: {exc.details()})", "open_rooms": None}
    return {
        "health": health_pb2.HealthCheckResponse.ServingStatus.Name(health.status),
        "open_rooms": stats.open_rooms,
        "draining": stats.draining,
        "etcd": stats.etcd,
    }

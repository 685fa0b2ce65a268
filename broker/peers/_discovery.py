"""Finding senders by group through etcd: this broker's view of the fleet.

With ``serve --etcd``, :class:`FleetView` lists every broker record under
``{prefix}/brokers/`` (``FleetRecord`` writes them) and keeps
the list current with an etcd watch. A receiving room whose ``SenderRef``
names a group and no broker address is resolved through it
(:func:`find_in_fleet`):

1. the brokers whose record lists the group, newest first, that speak
   this broker's protocol version, are not draining and answer (the others
   are passed over, and the error says why when only they serve the group);
2. a handshake with the newest one gives the group's layout; the receiving
   rank's sources (``mapping.plan_sources``) are looked up rank by rank, so
   a group whose ranks live on several hosts resolves each receiving rank
   to the broker(s) that hold its sources;
3. the room bootstraps with that broker as it would with a named address;
   a rank whose sources are on several brokers registers the room with
   each, for the sources it holds (``SenderLeg``).

A broker's key leaving etcd (its lease expired: it was killed or cut off;
or revoked: it stopped) is a lost peer: :class:`FleetView` calls
``on_left`` and the runtime fails the rooms with that broker with a PEER
cause naming it, as a lost heartbeat does. While etcd cannot be reached the
view keeps what it last saw (rooms between known peers go on), logs
``etcd_watch_lost`` once, and lists and watches again when etcd is back
(``etcd_watching``); brokers that vanished meanwhile are lost then.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from kvbroker.broker.aio import cancel_and_wait
from kvbroker.broker.peers._fleet import brokers_prefix, etcd_client, parse_endpoint
from kvbroker.errors import GroupNotFound, KvBrokerError, Unavailable
from kvbroker.plan import GroupShape, Layout, RankKey, RoomTimeouts, plan_sources
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import admin_pb2

if TYPE_CHECKING:
    from kvbroker.broker.peers._client import PeerClient
    from kvbroker.broker.peers._table import Peer

__all__ = ["FleetView", "Found", "Member", "find_in_fleet"]

log = structlog.get_logger(__name__)

_RANK = re.compile(r"tp(\d+)/pp(\d+)")

#: The sender brokers of a receiving rank: each peer, with the (tp, pp) of
#: the sender ranks it holds for the rank (None: one broker holds them all).
Found = list[tuple["Peer", frozenset[tuple[int, int]] | None]]


@dataclass(frozen=True)
class Member:
    """One broker record in etcd."""

    broker_id: str
    address: str
    protocol: int
    version: str
    started_at: float
    lease: int
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    draining: bool = False
    #: group -> (tp rank, pp rank) of its ranks registered with this broker.
    held: dict[str, frozenset[tuple[int, int]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: bytes, lease: int = 0) -> Member:
        record = json.loads(value)
        groups = dict(record.get("groups", {}))
        return cls(
            broker_id=str(record["broker_id"]),
            address=str(record["address"]),
            protocol=int(record.get("protocol", 0)),
            version=str(record.get("version", "")),
            started_at=float(record.get("started_at", 0.0)),
            lease=lease,
            groups=groups,
            draining=bool(record.get("draining", False)),
            held={
                name: frozenset((int(m[1]), int(m[2])) for m in map(_RANK.fullmatch, info.get("ranks", ())) if m)
                for name, info in groups.items()
            },
        )

    def ranks(self, group: str) -> frozenset[tuple[int, int]]:
        """(tp rank, pp rank) of every rank of ``group`` registered with this broker."""
        return self.held.get(group, frozenset())


class FleetView:
    """The brokers etcd lists, kept current by a watch. Control loop only."""

    def __init__(self, url: str, prefix: str, *, self_id: str, on_left: Callable[[Member], None]) -> None:
        self.host, self.port = parse_endpoint(url)
        self.prefix = brokers_prefix(prefix)
        self._self_id = self_id
        self._on_left = on_left
        #: broker id -> its record, as etcd last said.
        self.members: dict[str, Member] = {}
        #: Whether the watch is running (etcd answers).
        self.watching = False
        self._task: asyncio.Task[None] | None = None
        self._client: Any = None
        self._warned_protocol: set[str] = set()

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvbroker-etcd-watch")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        await self._close()

    async def _close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except Exception:  # noqa: BLE001 - a broken connection closes badly
                pass

    async def _run(self) -> None:
        delay = 0.2
        while True:
            try:
                self._client = etcd_client(self.host, self.port, 5)
                listing = await self._client.get_prefix(self.prefix.encode())
                fresh: dict[str, Member] = {}
                for kv in listing:
                    member = self._parse(kv.key, kv.value, kv.lease)
                    if member is not None:
                        fresh[member.broker_id] = member
                gone = [m for b, m in self.members.items() if b not in fresh]
                self.members = fresh
                for member in gone:
                    self._left(member)
                watch = await self._client.watch_prefix(self.prefix.encode(), start_revision=listing.header.revision + 1)
                self.watching = True
                delay = 0.2
                log.info("etcd_watching", prefix=self.prefix, brokers=len(fresh))
                async for event in watch:
                    self._event(event)
                raise Unavailable("the etcd watch ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd gone: keep the last view, list and watch again later
                if self.watching:
                    log.warning("etcd_watch_lost", etcd=f"{self.host}:{self.port}", error=str(exc) or type(exc).__name__)
                self.watching = False
            await self._close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _parse(self, key: bytes, value: bytes, lease: int) -> Member | None:
        try:
            return Member.parse(value, lease)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("etcd_bad_record", key=key.decode(errors="replace"), error=str(exc))
            return None

    def _event(self, event: Any) -> None:
        broker_id = event.kv.key.decode(errors="replace").removeprefix(self.prefix)
        if event.kind == "PUT":
            member = self._parse(event.kv.key, event.kv.value, event.kv.lease)
            if member is not None:
                self.members[member.broker_id] = member
            return
        member = self.members.pop(broker_id, None)
        if member is not None:
            self._left(member)

    def _left(self, member: Member) -> None:
        if member.broker_id == self._self_id:
            return  # our own lease lapsed (etcd was away): FleetRecord registers again
        log.warning("etcd_broker_left", broker=member.broker_id, address=member.address)
        try:
            self._on_left(member)
        except Exception:  # a bug in handling it is not an etcd outage: say so, keep watching
            log.exception("fleet_member_left_failed", broker=member.broker_id)

    # -- what the operator sees (Admin ListPeers / ListEngines) ------------------
    def groups(self, member: Member) -> list[admin_pb2.FleetGroup]:
        return [
            admin_pb2.FleetGroup(
                group=name,
                role=str(info.get("role", "")),
                tp_size=int(info.get("tp_size", 0)),
                pp_size=int(info.get("pp_size", 0)),
                ranks=list(info.get("ranks", ())),
                broker_id=member.broker_id,
                address=member.address,
            )
            for name, info in sorted(member.groups.items())
        ]

    async def describe(self) -> list[admin_pb2.FleetBroker]:
        """Every broker of the last view, with what etcd says of its lease now (-1 if it cannot)."""
        out = []
        for member in sorted(self.members.values(), key=lambda m: m.address):
            ttl = granted = -1
            if self._client is not None and self.watching and member.lease:
                try:
                    info = await asyncio.wait_for(self._client.get_lease_info(member.lease), 1.0)
                    ttl, granted = int(info.TTL), int(info.grantedTTL)
                except Exception:  # noqa: BLE001 - shown as unknown
                    pass
            out.append(
                admin_pb2.FleetBroker(
                    broker_id=member.broker_id,
                    address=member.address,
                    protocol=member.protocol,
                    version=member.version,
                    started_at=member.started_at,
                    lease_ttl_seconds=ttl,
                    lease_granted_seconds=granted,
                    draining=member.draining,
                    groups=self.groups(member),
                    usable=member.protocol == PROTOCOL_VERSION and not member.draining,
                )
            )
        return out

    # -- resolution ------------------------------------------------------------
    def serving(self, group: str) -> list[Member]:
        """Brokers whose record lists ``group``, speak our protocol and are not
        draining, newest first."""
        members = [m for m in self.members.values() if group in m.groups]
        for m in members:
            if m.protocol != PROTOCOL_VERSION and m.broker_id not in self._warned_protocol:
                self._warned_protocol.add(m.broker_id)
                log.warning("etcd_broker_skipped", broker=m.broker_id, address=m.address, protocol=m.protocol, speaks=PROTOCOL_VERSION)
        usable = (m for m in members if m.protocol == PROTOCOL_VERSION and not m.draining)
        return sorted(usable, key=lambda m: -m.started_at)

    def owner(self, group: str, tp_rank: int, pp_rank: int, skip: Collection[str] = ()) -> Member | None:
        """The newest usable broker that holds rank (tp, pp) of ``group`` (not at an address in ``skip``)."""
        return next(
            (m for m in self.serving(group) if (tp_rank, pp_rank) in m.ranks(group) and m.address not in skip), None
        )

    def why_none(self, group: str) -> str:
        """Why no broker can be used for ``group``."""
        others = [m for m in self.members.values() if group in m.groups and m.protocol != PROTOCOL_VERSION]
        if others:
            listed = ", ".join(f"{m.address} (protocol {m.protocol})" for m in others)
            return f"engine group {group!r} is served only by brokers of another protocol version: {listed}; this broker speaks {PROTOCOL_VERSION}"
        where = "" if self.watching else " (etcd is unreachable: this is the last view)"
        draining = [m.address for m in self.members.values() if group in m.groups and m.draining]
        if draining:
            return f"engine group {group!r} is served only by draining brokers ({', '.join(draining)}){where}"
        listed = ", ".join(sorted(m.address for m in self.members.values())) or "none"
        return f"no broker in etcd under {self.prefix} serves engine group {group!r} yet (brokers there: {listed}){where}"


async def find_in_fleet(
    client: PeerClient,
    view: FleetView,
    group: str,
    receiver: Layout,
    receiver_key: RankKey,
    *,
    stop: Callable[[], bool] = lambda: False,
    missed: Callable[[KvBrokerError], None] = lambda _e: None,
    timeouts: RoomTimeouts | None = None,
) -> tuple[Found, list[Layout]]:
    """The brokers that hold the sources of receiving rank ``receiver_key``
    of ``group`` (one, unless the group's ranks live on several hosts),
    handshaken, and the group's layouts; retried with backoff until the
    bootstrap timeout (the receiving engine's ``timeouts``, else the flag;
    the sender may still be starting; ``missed`` hears why each retried try
    failed)."""

    async def attempt() -> tuple[Found, list[Layout]]:
        # Brokers that did not answer in this attempt: a killed broker stays in
        # etcd until its lease expires, and an older one may hold the group too.
        down: set[str] = set()
        while (found := await _resolve(client, view, group, receiver, receiver_key, down)) is None:
            pass
        return found

    return await client.until_found(attempt, stop, missed, timeouts)


async def _resolve(
    client: PeerClient, view: FleetView, group: str, receiver: Layout, key: RankKey, down: set[str]
) -> tuple[Found, list[Layout]] | None:
    """One try, skipping the brokers in ``down``; None: one more did not answer (now in ``down``)."""
    serving = view.serving(group)
    if not serving:
        raise GroupNotFound(view.why_none(group))
    members = [m for m in serving if m.address not in down]
    if not members:
        raise Unavailable(f"no broker etcd lists for engine group {group!r} answers ({', '.join(sorted(down))})")
    first = await _connect(client, members[0].address, down)
    if first is None:
        return None
    layouts = await client.group_layouts(first, group)
    try:
        plans = plan_sources(GroupShape.of(layouts[0]), group, GroupShape.of(receiver), key.tp_rank, key.pp_rank)
    except KvBrokerError:
        return [(first, None)], layouts  # the room fails on the plan, with its reason (ReceiverCore.bootstrap.sender_found)
    owners: dict[str, set[tuple[int, int]]] = {}
    for plan in plans:
        rank = (plan.rank.tp_rank, plan.rank.pp_rank)
        owner = view.owner(group, *rank, skip=down)
        if owner is None:
            raise GroupNotFound(f"no broker in etcd holds rank tp{rank[0]}/pp{rank[1]} of engine group {group!r}")
        owners.setdefault(owner.address, set()).add(rank)
    found: Found = []
    for address, needed in sorted(owners.items()):
        peer = first if address == first.address else await _connect(client, address, down)
        if peer is None:
            return None
        layouts = await client.group_layouts(peer, group, needed)
        found.append((peer, frozenset(needed) if len(owners) > 1 else None))
    return found, layouts


async def _connect(client: PeerClient, address: str, down: set[str]) -> Peer | None:
    """The handshaken peer at ``address``, or None (and ``address`` in ``down``) if it does not answer."""
    try:
        return await client.connect(address)
    except Unavailable as exc:
        log.info("etcd_broker_unreachable", address=address, error=exc.message)
        down.add(address)
        return None

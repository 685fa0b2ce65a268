"""Receive credits, carried out: grants asked for and given, parts placed, ranges handed back.

The books are ``memory.CreditLedger`` (the receiver's) and
``memory.CreditWindow`` (the sender's); see ``memory/_credits.py`` for why.
This module makes the calls around them, on the control loop:

Sender side, per (peer, receive buffer):

- :meth:`Credits.acquire` places a packed part in the window; parts that do
  not fit wait, first come first served, while the window grows by one
  ``GrantCredits`` call at a time (a quarter of the peer's buffer, or the
  part, up to the whole buffer); a part that waits longer than
  ``--staging-wait`` fails, as a reservation did;
- :meth:`Credits.release`: a part that never reached the receiver (it failed
  before its write, or its write failed) frees its range here;
- :meth:`Credits.returned`: the receiver's ``CreditReturn`` notifications free
  the ranges it scattered; with ``pressure`` (others wait for its buffer) the
  window gives its grants back as they empty, and asks again for what it
  still needs, behind them;
- a grant wholly free for ``IDLE_SECONDS`` goes back (``ReturnCredits``).

Receiver side: :meth:`Credits.grant` and :meth:`Credits.take_back` answer the
two calls; :meth:`Credits.hand_back` queues a part's range for its sender once
the part is scattered or dropped (one notification per peer and loop pass).

A lost or restarted peer's windows and grants go (:meth:`Credits.peer_gone`).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

import structlog

from kvbroker.broker.aio import await_grant
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.execution._bundles import Transport
from kvbroker.broker.execution._tasks import TaskSet
from kvbroker.broker.memory import (
    Credit,
    CreditLedger,
    CreditRange,
    CreditWindow,
    FreeList,
    Grant,
    StagingPool,
    kept_for_classes,
)
from kvbroker.broker.peers import Peer, PoolKey, pool_name
from kvbroker.broker.scheduling import FairQueue, Priority, Ticket, Waiter
from kvbroker.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    KvBrokerError,
    ResourceExhausted,
    Unavailable,
)
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import peer_pb2

__all__ = ["CREDIT_RETURN", "Credits", "returned_credit"]

log = structlog.get_logger(__name__)

#: The first byte of a CreditReturn notification (a TransferNotice never starts with it).
CREDIT_RETURN = b"\x00"
#: A grant wholly free this long goes back to its receiver.
IDLE_SECONDS = 1.0

_WindowKey = tuple[str, PoolKey]


class Credits:
    """Both sides of receive credits. Control loop only."""

    def __init__(
        self,
        *,
        broker_id: str,
        config: BrokerConfig,
        transport: Transport,
        tasks: TaskSet,
        ledger: CreditLedger,
    ) -> None:
        self._id = broker_id
        self._config = config
        self._dataplane = transport.dataplane
        self._peers = transport.peers
        self._client = transport.client
        self._pools = transport.pools
        self._tasks = tasks
        #: The receiver's book (shared with the receiver's state machine, which checks ranges).
        self.ledger = ledger
        self._windows: dict[_WindowKey, CreditWindow] = {}
        #: Parts waiting for room in a window, in the order they will be placed.
        self._waiting: dict[_WindowKey, FairQueue[Waiter[Credit]]] = {}
        self._asking: set[_WindowKey] = set()
        self._observer = self._pools.queue_observer("credits")
        #: Placed credits by id: their window (a return names the id).
        self._placed: dict[int, _WindowKey] = {}
        self._idle_checks: dict[_WindowKey, asyncio.TimerHandle] = {}
        #: Ranges to hand back, by sending peer.
        self._returns: dict[str, list[peer_pb2.ReturnedCredit]] = {}
        self._flush_scheduled = False
        #: Told the ids of credits that came back, or went with their peer.
        self._on_returned: list[Callable[[list[int]], None]] = []

    def on_returned(self, listener: Callable[[list[int]], None]) -> None:
        """Have ``listener`` told the ids of placed credits that came back from
        their receiver, or went with it (it was lost)."""
        self._on_returned.append(listener)

    def is_placed(self, credit_id: int) -> bool:
        """Whether credit ``credit_id`` is placed and not back yet."""
        return credit_id in self._placed

    def _tell_returned(self, credit_ids: list[int]) -> None:
        for listener in self._on_returned:
            listener(credit_ids)

    # -- the sender's side ----------------------------------------------------------------
    async def acquire(
        self, peer: Peer, pool: PoolKey, nbytes: int, ticket: Ticket | None = None
    ) -> tuple[peer_pb2.RemoteBuffer, Credit]:
        """A range for a part of ``nbytes`` in ``peer``'s receive buffer ``pool``:
        the buffer and the credit. Waits for room, served in the order of the
        parts' tickets (none: first come, first served)."""
        assert peer.broker_id is not None
        buffer = peer.receive_staging.get(pool)
        if buffer is None:
            raise FailedPrecondition(f"broker {peer.address} announced no receive buffer for {pool_name(pool)}")
        if FreeList.aligned(nbytes) > buffer.size_bytes:
            raise ResourceExhausted(f"{nbytes} bytes can never fit in the peer's {buffer.size_bytes}-byte receive buffer")
        got = self.try_acquire(peer, pool, nbytes, ticket)
        if got is not None:
            return got
        key = (peer.broker_id, pool)
        window = self._windows.setdefault(key, CreditWindow())
        waiting = self._waiting.setdefault(key, FairQueue(observer=self._observer))
        future: asyncio.Future[Credit] = asyncio.get_running_loop().create_future()
        entry = Waiter(nbytes, future)
        waiting.push(entry, ticket or Ticket(Priority.STANDARD, "", nbytes))
        self._serve(key)  # it may come first, and fit
        timeout = self._config.staging_wait_seconds

        def give_up() -> None:
            if waiting.remove(entry):
                self._serve(key)

        credit = await await_grant(future, timeout, give_up=give_up, undo=self.release)
        if credit is None:
            raise DeadlineExceeded(
                f"the peer's receive buffer {pool_name(pool)} had no room for {timeout:g} s "
                f"({window.granted_bytes} of its {buffer.size_bytes} bytes granted to this broker)"
            )
        return buffer, credit

    def try_acquire(
        self, peer: Peer, pool: PoolKey, nbytes: int, ticket: Ticket | None = None
    ) -> tuple[peer_pb2.RemoteBuffer, Credit] | None:
        """:meth:`acquire` where it needs no wait (nobody waits before it, and its
        window has room now); else None."""
        buffer = peer.receive_staging.get(pool)
        if buffer is None or peer.broker_id is None:
            return None
        key = (peer.broker_id, pool)
        window = self._windows.get(key)
        if window is None or self._waiting.get(key):
            return None
        credit = window.place(nbytes, _keep(self._config, ticket, buffer.size_bytes))
        if credit is None:
            return None
        self._placed[credit.credit_id] = key
        return buffer, credit

    def release(self, credit: Credit) -> None:
        """A part that never reached the receiver frees its range."""
        key = self._placed.pop(credit.credit_id, None)
        window = self._windows.get(key) if key is not None else None
        if window is not None and key is not None and window.give_back(credit.offset, credit.credit_id):
            self._freed(key)

    def returned(self, agent_name: str, payload: bytes) -> None:
        """A receiver's CreditReturn notification: its ranges are free again."""
        try:
            message = peer_pb2.CreditReturn.FromString(payload[len(CREDIT_RETURN) :])
        except Exception:  # noqa: BLE001 - a bad notification is dropped, as a bad notice
            log.warning("bad_credit_return", agent=agent_name, size=len(payload))
            return
        freed: set[_WindowKey] = set()
        for item in message.credits:
            key = self._placed.pop(item.credit_id, None)
            window = self._windows.get(key) if key is not None else None
            if window is not None and key is not None and window.give_back(item.offset, item.credit_id):
                freed.add(key)
        self._tell_returned([item.credit_id for item in message.credits])
        if message.pressure:
            peer_id = next((p.broker_id for p in self._peers.by_id.values() if p.agent_name == agent_name), None)
            for key, window in self._windows.items():
                if key[0] == peer_id:
                    window.retire_all()
                    freed.add(key)
        for key in freed:
            self._freed(key)

    def _freed(self, key: _WindowKey) -> None:
        """Room came back in a window: serve its waiters; give back what is to go."""
        self._serve(key)
        self._give_back(key, IDLE_SECONDS)
        if key not in self._idle_checks and key in self._windows:
            loop = asyncio.get_running_loop()
            self._idle_checks[key] = loop.call_later(IDLE_SECONDS, self._idle_check, key)

    def _idle_check(self, key: _WindowKey) -> None:
        self._idle_checks.pop(key, None)
        window = self._windows.get(key)
        if window is None:
            return
        self._give_back(key, IDLE_SECONDS)
        if window.grant_ids():
            self._idle_checks[key] = asyncio.get_running_loop().call_later(IDLE_SECONDS, self._idle_check, key)

    def _serve(self, key: _WindowKey) -> None:
        """Place the waiting parts that fit, in their order; ask for more room for
        the rest (a bulk part first in line that only the kept room would fit lets
        a waiting part of a class above it have it)."""
        window, waiting = self._windows.get(key), self._waiting.get(key)
        if window is None or not waiting:
            return
        peer = self._peers.by_id.get(key[0])
        remote = peer.receive_staging.get(key[1]) if peer is not None else None
        size = remote.size_bytes if remote is not None else 0
        while (entry := waiting.peek()) is not None:
            if entry.future.done():
                waiting.pop()
                continue
            keep = _keep(self._config, waiting.ticket(entry), size)
            credit = window.place(entry.nbytes, keep)
            if credit is None and keep:
                above = next((w for w in waiting if not w.future.done() and not _keep(self._config, waiting.ticket(w), size)), None)
                if above is not None and (credit := window.place(above.nbytes)) is not None:
                    waiting.remove(above)
                    self._placed[credit.credit_id] = key
                    above.future.set_result(credit)
                    continue
            if credit is None:
                break
            waiting.pop()
            self._placed[credit.credit_id] = key
            entry.future.set_result(credit)
        if waiting and remote is not None:
            self._grow(key, size)

    def _grow(self, key: _WindowKey, buffer_bytes: int) -> None:
        """Ask for one more grant for the window's next waiter (one call at a time)."""
        window, waiting = self._windows[key], self._waiting.get(key)
        if key in self._asking or not waiting:
            return
        head = waiting.peek()
        assert head is not None
        room = buffer_bytes - window.granted_bytes
        want = min(max(FreeList.aligned(head.nbytes), buffer_bytes // 4), room)
        if want < FreeList.aligned(head.nbytes):
            return  # the whole buffer is ours: wait for ranges to come back
        self._asking.add(key)
        self._tasks.spawn(self._ask(key, want), name=f"credits-{pool_name(key[1])}")

    async def _ask(self, key: _WindowKey, nbytes: int) -> None:
        peer_id, pool = key
        request = peer_pb2.GrantCreditsRequest(
            protocol_version=PROTOCOL_VERSION, sender_broker_id=self._id, kind=pool[0], device_id=pool[1], bytes=nbytes  # type: ignore[arg-type]
        )
        try:
            response = await self._client.grant_credits(peer_id, request)
        except KvBrokerError as exc:
            window = self._windows.get(key)
            if window is not None and not window.granted_bytes:
                # Nothing will come back to this window: its parts fail with the cause.
                for entry in self._waiting.pop(key, ()):
                    if not entry.future.done():
                        entry.future.set_exception(exc)
            log.info("credits_not_granted", peer=peer_id, pool=pool_name(pool), error=exc.message)
            return
        finally:
            self._asking.discard(key)
        window = self._windows.get(key)
        if window is None:  # the peer is gone meanwhile: its grant went with it
            return
        window.add_grant(response.grant_id, response.offset, response.bytes)
        self._serve(key)

    def _give_back(self, key: _WindowKey, idle_seconds: float) -> None:
        window = self._windows.get(key)
        if window is None:
            return
        grants = window.free_grants(idle_seconds)
        if not grants:
            return
        for grant_id in grants:
            window.remove_grant(grant_id)
        self._tasks.spawn(self._return(key[0], grants), name="credits-return")
        self._serve(key)

    async def _return(self, peer_id: str, grant_ids: list[str]) -> None:
        try:
            await self._client.return_credits(peer_id, grant_ids)
        except KvBrokerError as exc:  # the peer is gone (its grants went with it) or will take them back when it drops us
            log.info("credits_not_returned", peer=peer_id, grants=len(grant_ids), error=exc.message)

    def waiting_parts(self) -> int:
        """Packed parts waiting for room in their receiver's buffer (our credits there)."""
        return sum(len(waiting) for waiting in self._waiting.values())

    def awaiting_returns(self) -> bool:
        """Whether parts sit in our credits at a peer (its CreditReturn notifications are due)."""
        return bool(self._placed)

    # -- the receiver's side --------------------------------------------------------------
    async def grant(self, request: peer_pb2.GrantCreditsRequest) -> peer_pb2.GrantCreditsResponse:
        """Room in a receive buffer for a sending peer's packed parts (waits while it is full)."""
        self._peers.get(request.sender_broker_id)
        key = (int(request.kind), request.device_id)
        pool = self._pools.pool("receive", *key)
        if pool is None:
            raise FailedPrecondition(f"this broker has no receive buffer for {pool_name(key)}")
        reservation = await pool.reserve_slot(request.bytes, self._config.staging_wait_seconds)
        if request.sender_broker_id not in self._peers.by_id:  # lost while it waited
            pool.release(reservation)
            raise Unavailable(f"broker {request.sender_broker_id} was dropped while it waited for credits")
        grant = Grant(secrets.token_hex(8), request.sender_broker_id, key, reservation)
        self.ledger.add(grant)
        return peer_pb2.GrantCreditsResponse(
            grant_id=grant.grant_id, offset=reservation.offset, bytes=reservation.nbytes, buffer=pool.buffer.descriptor()
        )

    def take_back(self, request: peer_pb2.ReturnCreditsRequest) -> None:
        """A sending peer gives whole grants back. Idempotent."""
        for grant_id in request.grant_ids:
            grant = self.ledger.take(request.sender_broker_id, grant_id)
            if grant is not None:
                self._release(grant)

    def hand_back(self, kind: int, device: int, credit: CreditRange) -> None:
        """A part's range in its sender's grant is free here (scattered or
        dropped): it goes back to the sender with the next notification."""
        self._returns.setdefault(credit.sender, []).append(returned_credit(kind, device, credit))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def return_now(self, agent_name: str, item: peer_pb2.ReturnedCredit, pool: StagingPool | None) -> None:
        """Send one range back to its sender at once (any thread: a lane's, as soon
        as the part in it is scattered), saying whether others wait for ``pool``.
        ``Unavailable`` if the data plane is stopping."""
        message = peer_pb2.CreditReturn(protocol_version=PROTOCOL_VERSION, credits=[item], pressure=bool(pool is not None and pool.waiting))
        self._dataplane.send(agent_name, CREDIT_RETURN + message.SerializeToString())

    def _flush(self) -> None:
        self._flush_scheduled = False
        returns, self._returns = self._returns, {}
        for peer_id, items in returns.items():
            peer = self._peers.by_id.get(peer_id)
            if peer is None or peer.agent_name is None:
                continue  # the peer is gone: its grants went with it
            pressure = any(
                (pool := self._pools.pool("receive", item.kind, item.device_id)) is not None and pool.waiting for item in items
            )
            message = peer_pb2.CreditReturn(protocol_version=PROTOCOL_VERSION, credits=items, pressure=pressure)
            payload = CREDIT_RETURN + message.SerializeToString()
            try:
                self._dataplane.send(peer.agent_name, payload)
            except KvBrokerError as exc:  # the data plane is stopping
                log.warning("credit_return_lost", peer=peer_id, error=exc.message)

    def _release(self, grant: Grant) -> None:
        pool = self._pools.pool("receive", *grant.pool)
        if pool is not None:
            pool.release(grant.slot)

    # -- peers ----------------------------------------------------------------------------
    def has_business(self, peer_id: str) -> bool:
        """Whether credits tie this broker to ``peer_id`` (the monitor pings it then)."""
        return peer_id in self.ledger.peers() or any(key[0] == peer_id and w.granted_bytes for key, w in self._windows.items())

    def peer_gone(self, peer_id: str, why: Callable[[], KvBrokerError]) -> None:
        """``peer_id`` is lost or restarted: its grants here go back to the
        pools, our windows at it go, and parts waiting for them fail."""
        for grant in self.ledger.drop_peer(peer_id):
            self._release(grant)
        for key in [k for k in self._windows if k[0] == peer_id]:
            del self._windows[key]
            timer = self._idle_checks.pop(key, None)
            if timer is not None:
                timer.cancel()
            for entry in self._waiting.pop(key, ()):
                if not entry.future.done():
                    entry.future.set_exception(why())
        gone = [cid for cid, key in self._placed.items() if key[0] == peer_id]
        self._placed = {cid: key for cid, key in self._placed.items() if key[0] != peer_id}
        self._returns.pop(peer_id, None)
        self._tell_returned(gone)


def returned_credit(kind: int, device: int, credit: CreditRange) -> peer_pb2.ReturnedCredit:
    """``credit`` (in the receive buffer of ``kind`` on ``device``) as its sender hears it back."""
    return peer_pb2.ReturnedCredit(
        credit_id=credit.credit_id, kind=kind, device_id=device, offset=credit.offset, bytes=credit.nbytes  # type: ignore[arg-type]
    )


def _keep(config: BrokerConfig, ticket: Ticket | None, buffer_bytes: int) -> int:
    """What a part with ``ticket`` must leave free of its credit window: a bulk part,
    a part's room for the classes above it."""
    if ticket is None or ticket.priority != Priority.BULK or not config.priorities:
        return 0
    return kept_for_classes(config.device_part_bytes, buffer_bytes)

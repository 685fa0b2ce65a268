"""Driving NIXL: the one task that polls posted transfers and notifications.

NIXL's progress thread is off (PERF_NOTES.md), so the broker drives progress
itself, on its event-loop thread (the agent's owner):

- while transfers are in flight it polls without sleeping, yielding to the
  event loop between passes (UCX moves shared-memory bytes inside these
  calls, so sleeping here would stall the copy);
- while rooms wait for data but nothing is in flight it polls every
  ``idle_poll_interval_millis``;
- otherwise it sleeps until woken: an idle broker uses no CPU.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from kvbroker.broker.nixl_agent import Agent, NixlError, XferState
from kvbroker.errors import KvBrokerError

__all__ = ["InflightTransfer", "ProgressLoop", "TransferTimeout"]


class TransferTimeout(NixlError):
    """A posted transfer did not finish in time and was cancelled."""

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class InflightTransfer:
    """A posted transfer and what to do when it settles."""

    handle: Any
    bytes: int
    #: Called once with DONE or ERR, the descriptor count if known, and the
    #: error when the broker cancelled the transfer.
    on_settled: Callable[[XferState, int | None, KvBrokerError | None], None]
    #: The remote agent it writes to.
    remote_agent: str = ""
    posted_at: float = field(default_factory=time.monotonic)


class ProgressLoop:
    """Polls in-flight transfers and notifications for one agent."""

    def __init__(
        self,
        agent: Agent,
        *,
        on_notification: Callable[[str, bytes], None],
        awaiting_data: Callable[[], bool],
        idle_poll_interval_millis: float,
    ) -> None:
        self._agent = agent
        self._on_notification = on_notification
        self._awaiting_data = awaiting_data
        self._idle_s = idle_poll_interval_millis / 1000.0
        self.inflight: list[InflightTransfer] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="nixl-progress")

    def track(self, transfer: InflightTransfer) -> None:
        """Poll ``transfer`` until it settles."""
        self.inflight.append(transfer)
        self._wake.set()

    def wake(self) -> None:
        """Something may now await data: start polling."""
        self._wake.set()

    def poll_once(self) -> bool:
        """One pass over transfers and notifications; True if anything happened."""
        active = False
        if self.inflight:
            still: list[InflightTransfer] = []
            for transfer in self.inflight:
                state = self._agent.check(transfer.handle)
                if state is XferState.PROC:
                    still.append(transfer)
                    continue
                active = True
                descs = self._agent.descriptor_count(transfer.handle)
                self._agent.release_xfer(transfer.handle)
                self._settle(transfer, state, descs, None)
            self.inflight = still
        for agent_name, payload in self._agent.get_notifs():
            active = True
            try:
                self._on_notification(agent_name, payload)
            except Exception:
                log.exception("notification_handler_failed", agent=agent_name)
        return active

    def cancel(self, predicate: Callable[[InflightTransfer], bool], why: Callable[[InflightTransfer], KvBrokerError]) -> int:
        """Cancel every in-flight transfer matching ``predicate``.

        NIXL cancels a transfer when its handle is released; one it cannot
        cancel stays in flight (its pages stay unsettled) and is tried again
        on the next call. Returns how many were cancelled.
        """
        cancelled = 0
        for transfer in [t for t in self.inflight if predicate(t)]:
            try:
                self._agent.release_xfer(transfer.handle)
            except KvBrokerError as exc:
                log.warning("transfer_cancel_failed", remote=transfer.remote_agent, error=exc.message)
                continue
            self.inflight.remove(transfer)
            self._settle(transfer, XferState.ERR, None, why(transfer))
            cancelled += 1
        return cancelled

    def cancel_overdue(self, now: float, timeout_seconds: float) -> int:
        """Cancel transfers in flight for longer than ``timeout_seconds`` (hung)."""
        return self.cancel(
            lambda t: now - t.posted_at > timeout_seconds,
            lambda t: TransferTimeout(
                f"a NIXL write of {t.bytes} bytes to {t.remote_agent or 'a peer'} did not finish in {timeout_seconds:g} s"
            ),
        )

    def _settle(self, transfer: InflightTransfer, state: XferState, descs: int | None, error: KvBrokerError | None) -> None:
        try:
            transfer.on_settled(state, descs, error)
        except Exception:
            log.exception("transfer_callback_failed")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def _run(self) -> None:
        while not self._stopping:
            try:
                self.poll_once()
            except Exception:
                # One bad poll must not stop progress for every other room.
                log.exception("progress_poll_failed")
                await asyncio.sleep(self._idle_s)
            if self.inflight:
                await asyncio.sleep(0)
            elif self._awaiting_data():
                await asyncio.sleep(self._idle_s)
            else:
                self._wake.clear()
                # A notification may still arrive for a room that just ended;
                # a slow heartbeat drains it without a busy loop.
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass

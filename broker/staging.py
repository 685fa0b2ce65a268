"""Staging buffers (DESIGN.md section 6): broker-owned, registered, carved into reservations.

A broker with staging on owns one host buffer, registered with NIXL and
announced to peers in the handshake. As a sender it gathers head slices into
reservations of its own buffer; as a receiver it reserves room for a
sender's packed block (the prefetch, ``PeerBroker.ReserveStaging``) and
scatters the block into the decode pages when it lands. Reservations are
first-fit, 4 KiB aligned; a reservation that does not fit now waits until
another is released.

Owner: the broker's event-loop thread. ``close`` deregisters and unmaps.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbroker.broker.memory import array_at, map_anonymous, unmap
from kvbroker.broker.nixl_agent import Agent
from kvbroker.errors import DeadlineExceeded, ResourceExhausted
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["Reservation", "StagingPool"]

_ALIGN = 4096


@dataclass(frozen=True)
class Reservation:
    """``nbytes`` at ``offset`` of a staging pool, until released."""

    offset: int
    nbytes: int


class StagingPool:
    """A registered host buffer handed out in reservations."""

    def __init__(self, agent: Agent, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.address = map_anonymous(size_bytes)
        self._agent = agent
        try:
            self._registration: Any = agent.register(self.address, size_bytes, common_pb2.MEMORY_KIND_DRAM, 0)
        except BaseException:
            unmap(self.address, size_bytes)
            raise
        self._free: list[tuple[int, int]] = [(0, size_bytes)]
        self._released = asyncio.Event()
        self.in_use_bytes = 0
        self.reservations = 0

    def descriptor(self) -> peer_pb2.RemoteBuffer:
        """How peers address this buffer (handshake)."""
        return peer_pb2.RemoteBuffer(
            address=self.address, size_bytes=self.size_bytes, kind=common_pb2.MEMORY_KIND_DRAM, device_id=0
        )

    def try_reserve(self, nbytes: int) -> Reservation | None:
        """A reservation of ``nbytes`` now, or None if no free span fits."""
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        for i, (offset, span) in enumerate(self._free):
            if span >= size:
                if span == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, span - size)
                self.in_use_bytes += size
                self.reservations += 1
                return Reservation(offset=offset, nbytes=size)
        return None

    async def reserve(self, nbytes: int, timeout_seconds: float) -> Reservation:
        """A reservation of ``nbytes``, waiting for releases up to the timeout.

        ``ResourceExhausted`` if it can never fit; ``DeadlineExceeded`` if the
        pool stayed too full.
        """
        if nbytes > self.size_bytes:
            raise ResourceExhausted(f"{nbytes} bytes can never fit in the {self.size_bytes}-byte staging buffer")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        while True:
            reservation = self.try_reserve(nbytes)
            if reservation is not None:
                return reservation
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"the staging buffer stayed full for {timeout_seconds:g} s "
                    f"({self.in_use_bytes} of {self.size_bytes} bytes reserved)"
                )
            self._released.clear()
            try:
                await asyncio.wait_for(self._released.wait(), timeout=remaining)
            except asyncio.TimeoutError:
                pass

    def release(self, reservation: Reservation) -> None:
        """Give ``reservation`` back (merging free neighbours)."""
        self._free.append((reservation.offset, reservation.nbytes))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for offset, span in self._free:
            if merged and merged[-1][0] + merged[-1][1] == offset:
                merged[-1] = (merged[-1][0], merged[-1][1] + span)
            else:
                merged.append((offset, span))
        self._free = merged
        self.in_use_bytes -= reservation.nbytes
        self.reservations -= 1
        self._released.set()

    def view(self, reservation: Reservation, nbytes: int | None = None) -> npt.NDArray[np.uint8]:
        """The reserved bytes as a numpy array (the first ``nbytes`` of them)."""
        return array_at(self.address + reservation.offset, reservation.nbytes if nbytes is None else nbytes)

    def close(self) -> None:
        self._agent.deregister(self._registration)
        unmap(self.address, self.size_bytes)

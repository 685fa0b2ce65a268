"""Broker-wide counters reported by ``Admin.GetStats``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvbroker.broker.telemetry._queues import QueueStats

__all__ = ["Counters"]


@dataclass
class Counters:
    """Monotonic counters since the broker started."""

    #: The queues' depth, waits and bytes by class and engine group (the
    #: broker's one ``QueueStats``, which its queues report to).
    queues: QueueStats
    rooms_succeeded: int = 0
    rooms_failed: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_posted: int = 0
    #: Head-sliced parts written through staging, and with per-token descriptors.
    transfers_staged: int = 0
    transfers_per_token: int = 0
    #: Parts that moved token runs between different page sizes.
    transfers_token_runs: int = 0
    #: Packed parts sent on the device path (gathered, one write, scattered).
    transfers_packed: int = 0
    #: Descriptors NIXL used for finished transfers (telemetry).
    descriptors_transferred: int = 0
    #: Notifications for rooms this broker no longer (or never) had.
    late_notices: int = 0
    #: Notifications that were not a TransferNotice.
    bad_notices: int = 0
    #: Chunks whose bytes differed from the sender's checksum (or came without one).
    checksum_mismatches: int = 0
    #: Packed parts whose checksum (sent by the sender) the receiver compared before scattering.
    packed_checksums_checked: int = 0
    #: Packed parts whose notice the data-plane thread took itself (through its rank's gate).
    parts_taken_off_loop: int = 0
    #: PeerBroker calls this broker answered, by method.
    peer_calls_answered: Counter[str] = field(default_factory=Counter)

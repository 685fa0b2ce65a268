"""Broker configuration: one frozen dataclass, units in the field names."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

__all__ = ["BrokerConfig", "default_socket_dir"]


def default_socket_dir() -> str:
    """Where sockets go when no path is given: $XDG_RUNTIME_DIR or the temp dir."""
    return os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()


@dataclass(frozen=True)
class BrokerConfig:
    """Everything ``kvbroker serve`` can set. Defaults suit one host in production."""

    #: TCP address for peers and operators (gRPC). Port 0 picks a free port.
    listen_address: str = "127.0.0.1:50051"
    #: Address peers should dial to reach this broker; defaults to the bound
    #: listen address (set it when listening on 0.0.0.0).
    advertise_address: str | None = None
    #: gRPC unix socket for engines on this host (faster than TCP); None: none.
    engine_socket_path: str | None = None
    #: Unix socket for fd uploads; None: next to the engine socket, or in
    #: default_socket_dir() named after the process id.
    fd_socket_path: str | None = None
    #: UCX error handling mode of the NIXL backend: "peer" detects dead peers,
    #: "none" is faster and blind (docs/performance.md).
    ucx_error_mode: str = "peer"
    #: Prefix of the NIXL agent name; a random suffix makes it unique per process.
    agent_name_prefix: str = "kvbroker"
    #: How long finished and failed rooms stay pollable before eviction.
    finished_room_ttl_seconds: float = 30.0
    #: How long a failed receiving room whose pages were never confirmed
    #: settled (its sender's broker neither reported nor was lost) stays
    #: pollable before it is evicted anyway (logged; never reported settled).
    unsettled_room_ttl_seconds: float = 600.0
    #: How long transfer infos wait for a BeginSend that never comes.
    orphan_room_timeout_seconds: float = 300.0
    #: How long an evicted room id is remembered, so a late message for it
    #: is refused instead of recreating it.
    tombstone_ttl_seconds: float = 60.0
    #: Period of the housekeeping pass (eviction, timeouts).
    housekeeping_interval_seconds: float = 0.25
    #: How long a receiving room retries reaching the sender's broker and
    #: finding its engine group before it fails (the handshake timeout).
    bootstrap_timeout_seconds: float = 30.0
    #: How long a sending room waits for the transfer infos of the receivers
    #: it serves (it is BOOTSTRAPPING until they all registered).
    sender_info_timeout_seconds: float = 120.0
    #: How long a receiving room waits, once registered with the sender's
    #: broker, for all its data to land.
    receiver_data_timeout_seconds: float = 300.0
    #: Leases a waiting decode renews (``AnnounceRoom``): this broker renews
    #: the sending sources' leases of the rooms its decode engines announced
    #: every third of the lease the sender's broker answers, and at least
    #: this often.
    lease_renew_max_seconds: float = 5.0
    #: How long one posted NIXL transfer may stay in flight before the broker
    #: cancels it and fails the room (a hung transfer).
    transfer_timeout_seconds: float = 60.0
    #: How often the broker pings the peers it has open rooms with.
    peer_heartbeat_seconds: float = 1.0
    #: A peer that has not answered a ping for this long (or answers as a
    #: different broker: it restarted) is lost: its rooms fail, its handshake
    #: and NIXL remote agent are dropped.
    peer_dead_after_seconds: float = 5.0
    #: Deadline of broker-to-broker calls.
    peer_rpc_timeout_seconds: float = 10.0
    #: Verify every room this broker receives end to end (chunk checksums;
    #: ExpectRoomRequest.verify_checksum asks for it per room).
    verify_checksums: bool = False
    #: Serve queued work by the rooms' priority classes, deadlines and fair
    #: shares between engines (``scheduling``); False: first come, first served.
    priorities: bool = True
    #: How long UnregisterEngine waits for posted transfers to settle before
    #: it deregisters anyway.
    unregister_settle_timeout_seconds: float = 10.0
    #: Staging buffers for head-sliced transfers (different tp sizes): the
    #: bytes this broker reserves to gather what it sends, and to receive
    #: what peers send. 0 for either turns staging off (the per-token
    #: descriptor path is used then). A chunk whose packed heads exceed a
    #: buffer falls back to per-token descriptors.
    staging_send_bytes: int = 64 * 1024 * 1024
    staging_receive_bytes: int = 64 * 1024 * 1024
    #: How long a staged or packed part waits for room in a full staging or transfer buffer.
    staging_wait_seconds: float = 30.0
    #: The device path (docs/architecture.md): per GPU an engine's memory lives
    #: on, a send and a receive transfer buffer (cudaMalloc, registered with
    #: NIXL once; engine VRAM never is), this many bytes each, but at most
    #: 1/32 of the GPU's memory each (``memory.DEVICE_SHARE``: 2.5 GB of an
    #: 80 GB H100, so the default stands there; 256 MiB on an 8 GB GPU).
    #: Eight parts each by default: the parts in flight between a pair of GPUs
    #: must cover one part's cycle (slot, gather, write, notice, scatter, its
    #: credit back), about seven times one part's GPU time on the modelled
    #: H200 (docs/benchmarks.md: 128 MiB x 8 moved 75 GB/s there, x 4 62).
    device_send_bytes: int = 1024 * 1024 * 1024
    device_receive_bytes: int = 1024 * 1024 * 1024
    #: The largest packed part (one NIXL write): a chunk packed larger than
    #: this (or than half a transfer buffer) is split into several parts, so
    #: gathers, writes and scatters of consecutive parts overlap. On an H100
    #: one write moved 48-52 GB/s with 32 MiB chunks and 89-96 GB/s with
    #: 128 MiB (../shared/gpu figures, docs/benchmarks.md).
    device_part_bytes: int = 128 * 1024 * 1024
    #: The largest part written straight between engines' pages (one NIXL
    #: write): a chunk's pages beyond it are cut into parts, so that a room
    #: of a higher class passes a large one between two of its parts. 0: a
    #: chunk's pages go in one write.
    part_bytes: int = 4 * 1024 * 1024
    #: The bytes of such parts posted to NIXL and not yet settled, at most
    #: (the rest wait, in their tickets' order, for posted ones to settle; a
    #: part larger than this goes alone). 0: no bound (first come, first
    #: served on the wire).
    send_window_bytes: int = 16 * 1024 * 1024
    #: Mutual TLS on the TCP port (peers and operators): this broker's
    #: certificate chain and key, and the CA that signs every broker's (and
    #: operator's) certificate. All three set: the TCP port accepts only
    #: clients with a certificate from that CA, and calls to peers present
    #: this broker's. None (default): plaintext, for loopback and trusted
    #: networks. The engine unix socket is always plaintext (file permissions
    #: guard it).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    #: The transport self-test (docs/architecture.md, "The device path"): a
    #: pair of transfer buffers where either side is a GPU's that writes
    #: slower than this (GB/s) moves through the host ("host fallback": UCX
    #: found no CUDA transport), logged once as a warning. Probe writes are
    #: this many bytes (at most half of either buffer).
    transport_floor_gbps: float = 20.0
    transport_probe_bytes: int = 64 * 1024 * 1024
    #: Largest gRPC message accepted or sent (page index lists are the bulk).
    max_message_bytes: int = 64 * 1024 * 1024
    #: etcd endpoint (http://HOST:PORT) to keep this broker's record in
    #: (broker/fleet.py); None: no etcd.
    etcd_url: str | None = None
    #: Key prefix of the fleet in etcd.
    etcd_prefix: str = "/kvbroker"
    #: TTL of the record's lease: a killed broker's record goes this long after.
    etcd_ttl_seconds: float = 5.0

    @property
    def tls(self) -> bool:
        """Whether mutual TLS is configured (all three files set)."""
        return bool(self.tls_cert_file and self.tls_key_file and self.tls_ca_file)

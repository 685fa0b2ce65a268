"""The NIXL write each kind of part posts.

Each function here takes a part (and where it writes from or to) and returns
the function the data-plane thread calls to build the part's descriptors and
post its write (``DataPlane.post``): the descriptors are built on that
thread, never on the control loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvbroker.broker.dataplane import Agent
from kvbroker.broker.memory import StagingBuffer
from kvbroker.broker.rooms import Part
from kvbroker.plan import page_blocks, run_descriptors, token_descriptors
from kvbroker.v1 import peer_pb2

__all__ = ["notice_bytes", "packed_write", "whole_write", "write_from_staging", "write_into_staging", "write_runs", "write_tokens"]


def notice_bytes(part: Part, checksum: int | None = None, packed_checksum: int | None = None) -> bytes:
    """``part``'s notice as it goes on the wire, with what execution learnt of the
    part after the room wrote it (its chunk's ``checksum``, its ``packed_checksum``)
    appended as a second message: a parser merges the two, the later field wins.
    The room's own record is never written outside rooms/."""
    body = part.notice.SerializeToString()
    if checksum is None and packed_checksum is None:
        return body
    return body + peer_pb2.TransferNotice(checksum=checksum, packed_checksum=packed_checksum).SerializeToString()


def whole_write(part: Part, agent_name: str, notif: bytes) -> Callable[[Agent], Any]:
    """Build and post a prepared-list write (runs on the data-plane thread)."""
    spec, local_dlists, remote = part.spec, part.source.engine.dlists, part.remote

    def make(agent: Agent) -> Any:
        assert spec.local_indices is not None and spec.remote_indices is not None
        return agent.post_write(
            local_dlists[spec.local_kind],
            spec.local_indices,
            remote.dlist(agent, agent_name, spec.remote_kind),
            spec.remote_indices,
            notif,
        )

    return make


def write_tokens(part: Part, agent_name: str, notif: bytes) -> Callable[[Agent], Any]:
    """Build one descriptor per (region, page, token) and post (data-plane thread)."""
    spec, src_table, dst_table = part.spec, part.source.engine.table, part.remote.table

    def make(agent: Agent) -> Any:
        assert spec.src_pages is not None and spec.dst_pages is not None and spec.slice is not None
        local_kind, remote_kind, local, remote = token_descriptors(
            src_table, dst_table, list(spec.pairs), spec.src_pages, spec.dst_pages, spec.slice
        )
        return agent.post_write_descs(local, local_kind, remote, remote_kind, agent_name, notif)

    return make


def write_runs(part: Part, agent_name: str, notif: bytes) -> Callable[[Agent], Any]:
    """Build one descriptor per (region, token run), merged where adjacent, and post (data-plane thread)."""
    spec, src_table, dst_table = part.spec, part.source.engine.table, part.remote.table

    def make(agent: Agent) -> Any:
        assert spec.runs is not None and spec.geometry is not None
        local, remote = run_descriptors(src_table, dst_table, spec.pairs, spec.runs, *spec.geometry)
        return agent.post_write_descs(local, spec.local_kind, remote, spec.remote_kind, agent_name, notif)

    return make


def write_into_staging(part: Part, agent_name: str, notif: bytes) -> Callable[[Agent], Any]:
    """Write the source's whole pages into the receiver's staging reservation
    (runs on the data-plane thread)."""
    spec, table = part.spec, part.source.engine.table
    remote = part.staging_buffer
    assert spec.src_pages is not None and spec.slice is not None and remote is not None

    def make(agent: Agent) -> Any:
        page_bytes = spec.slice.src.page_size * spec.slice.src.token_bytes  # type: ignore[union-attr]
        local, far = page_blocks(
            table, tuple(s for s, _ in spec.pairs), spec.src_pages, page_bytes,  # type: ignore[arg-type]
            remote.address + part.staging_offset, remote.device_id,
        )
        return agent.post_write_descs(local, spec.local_kind, far, remote.kind, agent_name, notif)

    return make


def write_from_staging(
    part: Part, buffer: StagingBuffer, offset: int, agent_name: str, notif: bytes
) -> Callable[[Agent], Any]:
    """Write each packed page at ``offset`` of the local send ``buffer`` into the
    receiver's page (descriptors built on the data-plane thread)."""
    spec, table = part.spec, part.remote.table
    assert spec.dst_pages is not None and spec.slice is not None

    def make(agent: Agent) -> Any:
        page_bytes = spec.slice.dst.page_size * spec.slice.dst.token_bytes  # type: ignore[union-attr]
        far, local = page_blocks(
            table, tuple(d for _, d in spec.pairs), spec.dst_pages, page_bytes,  # type: ignore[arg-type]
            buffer.address + offset, buffer.device_id,
        )
        return agent.post_write_descs(local, buffer.kind, far, spec.remote_kind, agent_name, notif)

    return make


def packed_write(part: Part, buffer: StagingBuffer, offset: int, agent_name: str, notif: bytes) -> Callable[[Agent], Any]:
    """One descriptor: the packed part's slot here to the slot the receiver
    reserved (its transfer buffer; data-plane thread)."""
    remote = part.staging_buffer
    assert remote is not None

    def make(agent: Agent) -> Any:
        if buffer.make_current is not None:
            # A GPU's buffer: post under its own device's context (with two
            # GPUs, registration left the thread on the last one's).
            buffer.make_current()
        local = np.array([[buffer.address + offset, part.nbytes, buffer.device_id]], dtype=np.uint64)
        far = np.array([[remote.address + part.staging_offset, part.nbytes, remote.device_id]], dtype=np.uint64)
        return agent.post_write_descs(local, buffer.kind, far, remote.kind, agent_name, notif)

    return make

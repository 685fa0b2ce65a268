"""The NIXL seam: a small agent protocol, and the real UCX-backed agent.

This is the only module that imports ``nixl``. The broker talks to an
:class:`Agent`; tests swap in ``kvbroker.testing.FakeAgent``, which follows
the same protocol.

Thread-safety: NIXL is not guaranteed thread-safe. An agent has one owner, the
broker's data-plane thread (:mod:`kvbroker.broker.dataplane`), and every
call below runs there. Progress is driven by that thread (``check`` and
``get_notifs``); NIXL's own progress thread is off, because on small hosts
it costs notification round trips of 8-24 ms and half the throughput
(docs/performance.md). The calls that move bytes (``transfer``) or register
memory release the GIL while NIXL works, so the event loop keeps answering
gRPC meanwhile (``bench/nixl_gil_probe.py``).

Prepared descriptor lists are passed to NIXL in its strided form: one row
``(address, item_bytes, device, stride, count)`` per region stands for all
of the region's items, so preparing the list of an engine of 2^24 pages costs
microseconds rather than the seconds an N x 3 array takes to convert.

Ownership: every handle an agent returns has one owner and an explicit
release (``deregister``, ``release_dlist``, ``release_xfer``,
``remove_remote``); ``close`` releases what is left, in reverse order.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvbroker.errors import Internal, InvalidArgument, NixlError
from kvbroker.plan import IndexArray
from kvbroker.v1 import common_pb2

__all__ = ["Agent", "AgentConfig", "UcxAgent", "XferState", "import_nixl"]


class XferState(enum.Enum):
    """The state of a posted transfer."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


@dataclass(frozen=True)
class AgentConfig:
    """How to create the broker's NIXL agent."""

    #: Agent name; unique per broker process (peers key metadata by it).
    name: str
    #: UCX error handling mode: "peer" reports dead peers (notifications go
    #: over TCP, about 5x slower round trips); "none" is faster and blind to
    #: peer failure.
    ucx_error_mode: str = "peer"
    #: Record per-transfer telemetry (descriptor counts, durations).
    capture_telemetry: bool = True


class Agent(Protocol):
    """What the broker needs of a NIXL agent. Handles are opaque."""

    @property
    def name(self) -> str: ...

    def metadata(self) -> bytes:
        """This agent's metadata, including every current registration."""

    def register(self, address: int, size_bytes: int, kind: int, device_id: int) -> Any:
        """Register memory; returns a registration handle for ``deregister``."""

    def deregister(self, registration: Any) -> None: ...

    def add_remote(self, metadata: bytes) -> str:
        """Load (or refresh) a peer's metadata; returns its agent name."""

    def remove_remote(self, name: str) -> None: ...

    def prep_dlist(self, agent: str | None, rows: np.ndarray, kind: int) -> Any:
        """Prepare a descriptor list from strided rows (K x 5 uint64:
        address, item bytes, device, stride, count; item ``i`` of the list is
        the ``i``-th item when the rows are expanded in order): ``agent`` None
        for local memory, a remote agent's name (or our own, for loopback) for
        remote memory."""

    def release_dlist(self, dlist: Any) -> None: ...

    def post_write(
        self,
        local: Any,
        local_indices: IndexArray,
        remote: Any,
        remote_indices: IndexArray,
        notif: bytes,
    ) -> Any:
        """Make and post a WRITE; ``notif`` reaches the remote after the data.
        Raises ``NixlError`` if NIXL rejects it (nothing was posted then)."""

    def post_write_descs(
        self,
        local_descs: np.ndarray,
        local_kind: int,
        remote_descs: np.ndarray,
        remote_kind: int,
        remote_agent: str,
        notif: bytes,
    ) -> Any:
        """Post a WRITE of transient N x 3 descriptor lists (no prepared lists):
        for per-token head slices and staged blocks. Raises ``NixlError``."""

    def check(self, xfer: Any) -> XferState:
        """Progress and report a posted transfer."""

    def release_xfer(self, xfer: Any) -> None:
        """Release a transfer handle (NIXL tries to cancel one still in flight)."""

    def descriptor_count(self, xfer: Any) -> int | None:
        """Descriptors NIXL used for a finished transfer, if telemetry is on."""

    def send_notif(self, agent: str, message: bytes) -> None: ...

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Progress and return the notifications that arrived, oldest first."""

    def close(self) -> None: ...


def import_nixl() -> Any:
    """NIXL's Python API module, without importing torch where it can be avoided.

    ``import nixl`` picks the build for the CUDA version of the host's torch;
    when torch is a CPU build it finds none on disk and imports torch (about
    240 MiB of resident memory) only to learn that. Here the choice is:
    ``KVBROKER_NIXL_MODULE`` if set (e.g. ``nixl_cu12``); ``nixl`` when a CUDA
    stack is already loaded or torch on disk is a CUDA build (its own
    detection, which then reads torch's version without importing it); else
    the first installed build of ``nixl_cu13``, ``nixl_cu12`` (a CPU host).
    """
    import importlib
    import sys

    forced = os.environ.get("KVBROKER_NIXL_MODULE")
    if forced:
        return importlib.import_module(f"{forced}._api")
    if any(m in sys.modules for m in ("torch", "cuda.bindings", "cupy")) or _torch_on_disk_is_cuda():
        return importlib.import_module("nixl._api")
    for name in ("nixl_cu13", "nixl_cu12"):
        try:
            return importlib.import_module(f"{name}._api")
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    return importlib.import_module("nixl._api")


def _torch_on_disk_is_cuda() -> bool:
    try:
        from nixl_meta_utils import _torch_cuda_version_from_disk
    except ImportError:
        return False
    return bool(_torch_cuda_version_from_disk())


_MEM_TYPE: dict[int, str] = {common_pb2.MEMORY_KIND_DRAM: "DRAM", common_pb2.MEMORY_KIND_VRAM: "VRAM"}


def _mem_type(kind: int) -> str:
    try:
        return _MEM_TYPE[kind]
    except KeyError:
        raise InvalidArgument(f"memory kind {kind} is not DRAM or VRAM") from None


class UcxAgent:
    """The real agent: ``nixl`` with the UCX backend, no progress thread."""

    def __init__(self, config: AgentConfig) -> None:
        nixl_api = import_nixl()
        nixl_agent, nixl_agent_config = nixl_api.nixl_agent, nixl_api.nixl_agent_config

        # NIXL configures its own logger at import (INFO, plain text, stdout)
        # and logs every agent and backend creation; keep that out of our
        # structured logs. This must come after the import.
        logging.getLogger("nixl").setLevel(logging.WARNING)

        self._config = config
        conf = nixl_agent_config(
            enable_prog_thread=False,
            backends=[],
            capture_telemetry=config.capture_telemetry,
        )
        self._agent = nixl_agent(config.name, conf)
        try:
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": config.ucx_error_mode})
        except Exception as exc:  # nixl raises its own exception types
            raise NixlError(
                f"cannot create the NIXL UCX backend (error mode {config.ucx_error_mode!r}, "
                f"UCX_TLS={os.environ.get('UCX_TLS', '<unset>')}): {exc}"
            ) from exc
        self._registrations: list[Any] = []
        self._remotes: set[str] = set()

    @property
    def name(self) -> str:
        return self._config.name

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def register(self, address: int, size_bytes: int, kind: int, device_id: int) -> Any:
        try:
            reg = self._agent.register_memory([(address, size_bytes, device_id, "")], _mem_type(kind))
        except InvalidArgument:
            raise
        except Exception as exc:
            raise NixlError(f"NIXL could not register {size_bytes} bytes at {address:#x}: {exc}") from exc
        self._registrations.append(reg)
        return reg

    def deregister(self, registration: Any) -> None:
        self._registrations.remove(registration)
        self._agent.deregister_memory(registration)

    def add_remote(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise InvalidArgument(f"NIXL rejected a peer's agent metadata: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        if name in self._remotes:
            self._remotes.discard(name)
            self._agent.remove_remote_agent(name)

    def prep_dlist(self, agent: str | None, rows: np.ndarray, kind: int) -> Any:
        try:
            return self._agent.prep_xfer_dlist(agent or "NIXL_INIT_AGENT", rows, _mem_type(kind))
        except InvalidArgument:
            raise
        except Exception as exc:
            items = int(rows[:, 4].sum()) if len(rows) else 0
            raise NixlError(f"NIXL could not prepare {items} descriptors for {agent or 'local'}: {exc}") from exc

    def release_dlist(self, dlist: Any) -> None:
        self._agent.release_dlist_handle(dlist)

    def post_write(
        self,
        local: Any,
        local_indices: IndexArray,
        remote: Any,
        remote_indices: IndexArray,
        notif: bytes,
    ) -> Any:
        try:
            xfer = self._agent.make_prepped_xfer("WRITE", local, local_indices, remote, remote_indices, notif)
        except Exception as exc:
            raise NixlError(f"NIXL could not make the transfer: {exc}") from exc
        return self._post(xfer)

    def _post(self, xfer: Any) -> Any:
        try:
            state = self._agent.transfer(xfer)
        except Exception as exc:
            self._agent.release_xfer_handle(xfer)
            raise NixlError(f"NIXL could not post the transfer: {exc}") from exc
        if state == "ERR":
            self._agent.release_xfer_handle(xfer)
            raise NixlError("NIXL rejected the transfer when posting it")
        return xfer

    def post_write_descs(
        self,
        local_descs: np.ndarray,
        local_kind: int,
        remote_descs: np.ndarray,
        remote_kind: int,
        remote_agent: str,
        notif: bytes,
    ) -> Any:
        try:
            xfer = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(local_descs, _mem_type(local_kind)),
                self._agent.get_xfer_descs(remote_descs, _mem_type(remote_kind)),
                remote_agent,
                notif,
            )
        except InvalidArgument:
            raise
        except Exception as exc:
            raise NixlError(f"NIXL could not make a transfer of {len(local_descs)} descriptors: {exc}") from exc
        return self._post(xfer)

    def check(self, xfer: Any) -> XferState:
        try:
            return XferState(self._agent.check_xfer_state(xfer))
        except Exception as exc:
            # NIXL raises (e.g. NIXL_ERR_REMOTE_DISCONNECT when the peer died)
            # rather than returning ERR; for the broker both are a failed transfer.
            logging.getLogger(__name__).debug("nixl check_xfer_state raised: %s", exc)
            return XferState.ERR

    def release_xfer(self, xfer: Any) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception as exc:
            raise Internal(f"NIXL could not release a transfer handle: {exc}") from exc

    def descriptor_count(self, xfer: Any) -> int | None:
        if not self._config.capture_telemetry:
            return None
        try:
            return int(self._agent.get_xfer_telemetry(xfer).descCount)
        except Exception:
            return None

    def send_notif(self, agent: str, message: bytes) -> None:
        try:
            self._agent.send_notif(agent, message)
        except Exception as exc:
            raise NixlError(f"NIXL could not notify {agent}: {exc}") from exc

    def get_notifs(self) -> list[tuple[str, bytes]]:
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as exc:
            raise NixlError(f"NIXL could not read notifications: {exc}") from exc
        return [(name, bytes(msg)) for name, msgs in notifs.items() for msg in msgs]

    def close(self) -> None:
        for name in list(self._remotes):
            self.remove_remote(name)
        for reg in reversed(list(self._registrations)):
            self.deregister(reg)

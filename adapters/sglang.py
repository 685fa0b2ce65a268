"""SGLang transfer backend: disaggregated prefill and decode through kvbroker.

Switch it on with ``--disaggregation-transfer-backend kvbroker`` on both
engines, once kvbroker is installed in SGLang's environment. SGLang's backend
list is closed (``TransferBackend`` is an enum), so kvbroker registers itself
through SGLang's plugin framework: the ``sglang.srt.plugins`` entry point
``kvbroker`` (pyproject.toml) names :func:`install`, which every SGLang
process runs at start (``load_plugins``). ``install`` patches exactly this:

- adds ``"kvbroker"`` to SGLang's transfer-backend choices
  (``add_disagg_transfer_backend_choices``) and a ``KVBROKER`` member to
  ``TransferBackend``;
- wraps ``get_kv_class`` (AROUND hook, applied by SGLang's ``HookRegistry``
  to every module that imported it) to answer kvbroker's classes for that
  member, and SGLang's own for every other backend;
- wraps ``sglang.srt.mem_cache.utils.maybe_init_custom_mem_pool`` (SGLang's
  custom memory pool setting): on CUDA, with this backend, KV pools allocate
  from kvbroker's VMM allocator (:mod:`kvbroker.vmmpool`; ``KVBROKER_VMM_POOL=0``
  turns it off), for every other backend and on CPU SGLang's own answer;
- wraps ``PrefillBootstrapQueue._init_kv_manager`` and
  ``DecodePreallocQueue._init_kv_manager`` (AROUND hooks) so that the
  manager they build sees the queue: it needs the KV pool's tensors and the
  metadata buffers, where SGLang's managers get raw pointers only
  (those hooks but ``get_kv_class``'s: ``_sglang_hooks.py``).

Environment of each engine process (every tp rank of one engine the same):

- ``KVBROKER_ADDRESS``: this host's broker (its ``--listen``), default
  ``127.0.0.1:50051``;
- ``KVBROKER_ADVERTISE_ADDRESS``: the address decode hosts reach that broker
  at, published to them (prefill only; default: what the broker advertises,
  its ``--advertise`` or listen address);
- ``KVBROKER_GROUP``: the engine's group name, unique among the engines of a
  broker (default ``sglang-<mode>-<http port>``);
- ``KVBROKER_ENFORCE_COMPATIBILITY``: ``0`` declares no compatibility digest
  (SGLang's version, model, dtypes, attention backend), so a
  decode of another model with the same shapes is not refused;
- ``KVBROKER_SENDER_INFO_TIMEOUT`` (else SGLang's
  ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``), ``KVBROKER_BOOTSTRAP_TIMEOUT``,
  ``KVBROKER_RECEIVER_DATA_TIMEOUT`` (else
  ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``): this engine's room timeouts in
  seconds (:data:`kvbroker.adapters._timeouts.SGLANG_TIMEOUT_ENV`); unset,
  the broker's flags;
- ``KVBROKER_INTERACTIVE_PRIORITY``, ``KVBROKER_BULK_PRIORITY``: a request
  whose SGLang priority (``Req.priority``) is at least as urgent as the
  first opens its room interactive, at most as urgent as the second bulk,
  else standard, in SGLang's direction (larger is more urgent, lower with
  ``--schedule-low-priority-values-first``); neither set, or no priority:
  unspecified (:mod:`kvbroker.adapters._priorities`). ``install`` also wraps
  the queues' ``create_sender`` and ``_create_receiver_and_enqueue`` so a
  sender or receiver finds its request (``_sglang_hooks.request_priority``).

The flow, in SGLang's terms: the prefill's ranks register their KV pool with
their broker and publish ``{broker, group, tp_size, ...}`` to the bootstrap
server (:mod:`kvbroker.adapters.bootstrap`, on
``--disaggregation-bootstrap-port``). A prefill sender opens its room at once
(``BeginSend`` with no page count): it is Bootstrapping until the decode's
broker has registered the room, then WaitingForInput, and
``pop_decode_prefix_len`` is the decode's held prefix in tokens. A decode
receiver's ``init`` reads the prefill's record from the bootstrap server and
announces the room (``KVReceiver.announce``): while the request waits in
SGLang's prealloc queue for pages, the decode's broker renews the prefill's
lease on its pages; an abort there, or the request let go, ends the
announcement with an empty room aborted at once, which the prefill's broker
fails at once. ``send_metadata`` opens the room (``ExpectRoom`` with the pages after the
prefix and the metadata-buffer row as aux row). The brokers move the pages
and the aux row; both sides report Success when the room is whole. A room
that fails reports Failed only once the broker says its pages are settled
(no write in flight), so SGLang frees or reuses them safely.

Memory: when the manager is built, the pool's K/V tensors (or MLA tensors)
and SGLang's metadata buffers are handed to the broker
(``EngineMemory.adopt``): host tensors move into shared memory in place;
a CUDA pool stays where it lies and its allocations are exported (fds for
kvbroker's VMM pool, CUDA IPC handles for PyTorch's ``cudaMalloc``
segments), which has never run on a GPU. A hybrid model's pool
(``HybridLinearKVPool``) registers KV on its attention layers only
(``ModelSpec.kv_layers``) and its Mamba state (conv and SSM per Mamba
layer, one item per slot) as the state component "mamba"; the state
indices SGLang's queues compute per component go with the last chunk and in
``send_metadata``. Not supported yet, refused by name: other state types
(SWA, DSA, ...), draft (speculative) KV, pipeline parallelism, attention
data parallelism, host (hicache) destinations.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)

from kvbroker.adapters._priorities import sglang_priority_rule
from kvbroker.adapters._sglang_hooks import (
    BACKEND,
    QUEUE,
    add_enum_member,
    custom_mem_pool,
    request_priority,
    with_queue,
    with_request,
)
from kvbroker.adapters._sglang_pool import (
    adopt_pool,
    compatibility_of,
    kv_tensors,
    moved_state,
    state_of,
)
from kvbroker.adapters._timeouts import sglang_timeouts
from kvbroker.adapters.bootstrap import BootstrapServer, EngineRecord, fetch_record, publish_rank
from kvbroker.client import (
    BrokerClient,
    RankSpec,
    RoomState,
    SenderRef,
)
from kvbroker.client.rooms import KVReceiver, KVSender
from kvbroker.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvBrokerError,
    RoomFailed,
    Unimplemented,
)

__all__ = [
    "BACKEND",
    "KVBrokerBootstrapServer",
    "KVBrokerKVManager",
    "KVBrokerKVReceiver",
    "KVBrokerKVSender",
    "install",
]

logger = logging.getLogger(__name__)

ENV_ADDRESS = "KVBROKER_ADDRESS"
ENV_ADVERTISE = "KVBROKER_ADVERTISE_ADDRESS"
ENV_GROUP = "KVBROKER_GROUP"
ENV_ENFORCE_COMPATIBILITY = "KVBROKER_ENFORCE_COMPATIBILITY"
DEFAULT_ADDRESS = "127.0.0.1:50051"

_STATES: dict[RoomState, int] = {
    RoomState.FAILED: int(KVPoll.Failed),
    RoomState.BOOTSTRAPPING: int(KVPoll.Bootstrapping),
    RoomState.WAITING_FOR_INPUT: int(KVPoll.WaitingForInput),
    RoomState.TRANSFERRING: int(KVPoll.Transferring),
    RoomState.SUCCESS: int(KVPoll.Success),
}


# -- install ------------------------------------------------------------------------
def install() -> None:
    """Register the ``kvbroker`` backend with SGLang (the plugin entry point).

    Idempotent. ``load_plugins`` calls it and then applies the hooks; a
    caller outside SGLang's start-up calls ``HookRegistry.apply_hooks()``
    after it."""
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    if BACKEND not in TransferBackend._value2member_map_:
        add_enum_member(TransferBackend, "KVBROKER", BACKEND)
    targets = {
        "sglang.srt.disaggregation.utils.get_kv_class": _get_kv_class,
        "sglang.srt.mem_cache.utils.maybe_init_custom_mem_pool": custom_mem_pool,
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager": with_queue,
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager": with_queue,
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.create_sender": with_request,
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._create_receiver_and_enqueue": with_request,
    }
    registered = HookRegistry._hooks
    for target, hook in targets.items():
        if all(h is not hook for _, h, _ in registered.get(target, [])):
            HookRegistry.register(target, hook, HookType.AROUND)


def _get_kv_class(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", None) != BACKEND or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    return {
        KVClassType.MANAGER: KVBrokerKVManager,
        KVClassType.SENDER: KVBrokerKVSender,
        KVClassType.RECEIVER: KVBrokerKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: KVBrokerBootstrapServer,
    }[class_type]


# -- the manager -----------------------------------------------------------------------
@dataclass
class PrefillInfo:
    """A prefill engine, as the decode queue reads it (``prefill_info_table``)."""

    record: EngineRecord
    dp_size: int = 1
    follow_bootstrap_room: bool = True


class KVBrokerKVManager(BaseKVManager):
    """One engine rank registered with its broker: its pool, its rooms' home."""

    supports_host_destination = False
    enable_deferred_decode_kv_release = False

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False) -> None:
        from sglang.srt.runtime_context import get_parallel, get_schedule, get_serving

        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.is_prefill = str(getattr(disaggregation_mode, "value", disaggregation_mode)) == "prefill"
        # Read by SGLang's queues; kvbroker has no per-room state here.
        self.transfer_infos: dict[int, Any] = {}
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self.attn_cp_size, self.attn_cp_rank = 1, 0
        self.enable_all_cp_ranks_for_transfer = False
        self.is_dummy_cp_rank = False

        queue = QUEUE.get()
        if queue is None:
            raise FailedPrecondition(
                "kvbroker's SGLang manager was built outside PrefillBootstrapQueue/DecodePreallocQueue._init_kv_manager: "
                "install() was not run in this process or its hooks were not applied (SGLang's load_plugins does both)"
            )
        parallel = get_parallel()
        for name, size in (("pp_size", parallel.pp_size), ("attn_dp_size", parallel.attn_dp_size), ("attn_cp_size", parallel.attn_cp_size)):
            if size != 1:
                raise Unimplemented(f"kvbroker's SGLang backend does not support {name} {size} yet")
        if args.num_draft_entries or getattr(queue, "draft_token_to_kv_pool", None) is not None:
            raise Unimplemented("kvbroker's SGLang backend does not move draft (speculative decoding) KV yet")
        unsupported = [t for t in getattr(args, "state_types", []) or [] if t is not None and moved_state(t) is None]
        if unsupported:
            raise Unimplemented(f"kvbroker's SGLang backend moves Mamba state only, not {unsupported}")

        mode: Literal["prefill", "decode"] = "prefill" if self.is_prefill else "decode"
        self.address = os.environ.get(ENV_ADDRESS, DEFAULT_ADDRESS)
        self.group = os.environ.get(ENV_GROUP) or f"sglang-{mode}-{get_serving().port}"
        self.rank = RankSpec(group=self.group, role=mode, tp_size=parallel.attn_tp_size, tp_rank=parallel.attn_tp_rank)
        self.pool = queue.token_to_kv_pool
        self.page_size = int(self.pool.page_size)
        timeouts = sglang_timeouts(os.environ)
        #: How a request's SGLang priority maps to its room's class (SGLang's own direction).
        self.priorities = sglang_priority_rule(os.environ, bool(get_schedule().schedule_low_priority_values_first))
        enforce = os.environ.get(ENV_ENFORCE_COMPATIBILITY, "1") != "0"
        compatibility = compatibility_of(server_args, self.is_mla_backend) if enforce else ""
        self.memory = adopt_pool(
            self.rank, self.pool, args, queue.metadata_buffers, queue.scheduler.model_config, self.is_mla_backend, compatibility
        )
        self.client = BrokerClient(self.address)
        #: Where decode hosts reach this host's broker: what the broker advertises
        #: (``serve --advertise``, else its listen address), unless the environment says.
        self.advertise = os.environ.get(ENV_ADVERTISE) or self.client.info.listen_address or self.address
        try:
            self.engine = self.client.register_engine(self.rank, self.memory, timeouts=timeouts)
        except BaseException:
            self.client.close()
            raise
        logger.info(
            "kvbroker: %s rank tp%d/%d of group %s registered with broker %s (%d KV layers, page size %d)",
            mode, self.rank.tp_rank, self.rank.tp_size, self.group, self.address, len(kv_tensors(self.pool, self.is_mla_backend)), self.page_size,
        )
        if self.is_prefill:
            self.register_to_bootstrap()

    # -- bootstrap -------------------------------------------------------------
    def bootstrap_address(self) -> str:
        """Where this prefill engine's bootstrap server listens (its first node)."""
        from sglang.srt.runtime_context import get_disagg, get_parallel

        dist = get_parallel().dist_init_addr
        host = str(dist).rsplit(":", 1)[0] if dist else "127.0.0.1"
        return f"{host}:{get_disagg().disaggregation_bootstrap_port}"

    def register_to_bootstrap(self) -> None:
        publish_rank(
            self.bootstrap_address(),
            {
                "group": self.group,
                "broker": self.advertise,
                "tp_size": self.rank.tp_size,
                "pp_size": 1,
                "page_size": self.page_size,
                "rank": self.rank.tp_rank,
            },
        )

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Read the prefill engine's record once every rank of it has registered."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            record = fetch_record(bootstrap_addr)
        except KvBrokerError as exc:
            logger.warning("kvbroker: %s", exc)
            return False
        if record is None or not record.complete:
            return False
        self.prefill_info_table[bootstrap_addr] = PrefillInfo(record)
        return True

    def submit_prefill_recompute(self, receiver: Any, payload: Any) -> None:
        """SGLang's rebootstrap of a retracted request (the prefill recomputes
        it): not supported yet. The request fails through SGLang's own path
        (its receiver polls Failed, ``failure_exception`` names why), never
        by an exception in the middle of scheduling."""
        receiver._fail(Unimplemented("kvbroker's SGLang backend does not rebootstrap retracted requests yet"))

    def close(self) -> None:
        """Unregister from the broker and release the shared memory (idempotent)."""
        try:
            self.engine.close()
        finally:
            self.client.close()
            self.memory.close()


# -- rooms --------------------------------------------------------------------------
class _RoomSide:
    """What a sender and a receiver share: the room, a local error, the state."""

    kv_mgr: KVBrokerKVManager
    bootstrap_room: int
    _room: KVSender | KVReceiver | None

    def _init_side(self, mgr: KVBrokerKVManager, bootstrap_room: int | None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room or 0)
        #: The room's class (``RoomPriority``), from the priority of the request SGLang builds this side for.
        self._priority = mgr.priorities.classify(request_priority())
        self.conclude_state: int | None = None
        self._room = None
        self._error: KvBrokerError | None = None
        #: When the transfer started: the first chunk (sender) or the room's opening (receiver).
        self._started: float | None = None
        self._status: Any = None

    def _fail(self, error: KvBrokerError) -> None:
        """A local refusal: fail the room here and at the peer, once."""
        logger.warning("kvbroker: room %d: %s", self.bootstrap_room, error)
        if self._error is None:
            self._error = error
            if self._room is not None:
                self._room.abort(f"refused on the {'prefill' if self.kv_mgr.is_prefill else 'decode'} engine: {error}")

    def _poll_room(self, before: int) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._room is None:
            if self._error is not None:
                self.conclude_state = int(KVPoll.Failed)
                return self.conclude_state
            return before
        status = self._room.status()
        self._status = status
        state = RoomState(status.state)
        if state is RoomState.FAILED and not status.pages_settled:
            # The broker may still be writing or reading these pages: not yet.
            return int(KVPoll.Transferring)
        if state in (RoomState.FAILED, RoomState.SUCCESS):
            self.conclude_state = _STATES[state]
        return _STATES[state]

    def failure_exception(self) -> None:
        if self._error is not None:
            raise self._error
        status = self._status if self._status is not None else (self._room.status() if self._room is not None else None)
        if status is not None and RoomState(status.state) is RoomState.FAILED:
            raise RoomFailed(self.bootstrap_room, status.cause)
        raise FailedPrecondition(f"room {self.bootstrap_room} has not failed")

    def abort(self) -> None:
        if self._room is None:
            self.conclude_state = int(KVPoll.Failed)
            if self._error is None:
                self._error = FailedPrecondition(f"room {self.bootstrap_room} aborted by SGLang before it opened")
            return
        self._room.abort("aborted by SGLang")

    def clear(self) -> None:
        self._room = None

    def get_transfer_metric(self) -> KVTransferMetric:
        status = self._status
        if status is None or RoomState(status.state) is not RoomState.SUCCESS:
            return KVTransferMetric()
        latency = None if self._started is None else time.monotonic() - self._started
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=int(status.bytes))


class KVBrokerKVSender(_RoomSide, BaseKVSender):
    """The prefill side of one room (one SGLang request) on one rank."""

    def __init__(self, mgr: KVBrokerKVManager, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self._init_side(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self._early_send_wait_event: Any = None
        self._num_pages: int | None = None
        self._prefix_pages = 0
        self._sent = 0
        self._chunks = 0
        #: The scheduler's word on the next chunk (should_send_kv_chunk's last_chunk).
        self._next_last: bool | None = None
        room = mgr.engine.sender(self.bootstrap_room)
        try:
            # No page count yet: SGLang gives it after the handshake (init).
            room.init(0, priority=self._priority)
        except KvBrokerError as exc:
            self._fail(exc)
            return
        self._room = room

    def poll(self) -> int:
        return self._poll_room(int(KVPoll.Bootstrapping))

    def pop_decode_prefix_len(self) -> int:
        """The decode's held prefix, in tokens: whole pages of this engine."""
        if self._room is None:
            return 0
        self._prefix_pages = int(self._room.status().prefix_pages)
        return self._prefix_pages * self.kv_mgr.page_size

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._num_pages = int(num_kv_indices)
        if self._room is None:
            return
        assert isinstance(self._room, KVSender)
        try:
            self._room.set_aux_row(aux_index)
        except KvBrokerError as exc:
            self._fail(exc)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # SGLang asks this right before each send: remember which one is last.
        # A zero-page last chunk still carries the aux row and ends the room.
        self._next_last = last_chunk
        return num_pages > 0 or last_chunk

    def mark_prefill_complete(self) -> None:
        return

    def send(self, kv_indices: Any, state_indices: Sequence[Any] | None = None, num_kv_tokens: int | None = None, **_: Any) -> None:
        if self._room is None or self._error is not None:
            return
        assert isinstance(self._room, KVSender)
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        try:
            if self._num_pages is None:
                raise FailedPrecondition(f"room {self.bootstrap_room}: send before init")
            state = state_of(self.kv_mgr.kv_args.state_types, state_indices)
            # The scheduler says which chunk is last: a chunk that reaches the
            # page count may be followed by a zero-page last one. Without its
            # word, SGLang's rule: the chunk that reaches the count.
            last = self._sent + pages.size >= self._num_pages if self._next_last is None else self._next_last
            self._next_last = None
            room_page = self._prefix_pages if self._chunks == 0 else None
            if self._started is None:
                self._started = time.monotonic()
            self._room.send(pages, is_last=last, room_page=room_page, state=state if last else None)
        except KvBrokerError as exc:
            self._fail(exc)
            return
        self._sent += pages.size
        self._chunks += 1


class KVBrokerKVReceiver(_RoomSide, BaseKVReceiver):
    """The decode side of one room (one SGLang request) on one rank."""

    def __init__(self, mgr: KVBrokerKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self._init_side(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr
        self.abort_notified = False
        self.require_staging = False
        self.bootstrap_infos: list[EngineRecord] = []
        self._sender: SenderRef | None = None
        #: The room announced in ``init`` and not opened yet (``send_metadata``) nor given up.
        self._announced: KVReceiver | None = None

    def init(self, prefill_dp_rank: int) -> None:
        """The prefill is known (SGLang calls this once, as the request enters its prealloc
        queue or once the prefill's record is there): the request waits for pages next, so its
        room is announced; an announcement refused is only logged (the prefill's lease alone)."""
        mgr = self.kv_mgr
        if not mgr.try_ensure_parallel_info(self.bootstrap_addr):
            self._fail(FailedPrecondition(f"no complete kvbroker record of the prefill engine at {self.bootstrap_addr} yet"))
            return
        record = mgr.prefill_info_table[self.bootstrap_addr].record
        self.bootstrap_infos = [record]
        self._sender = SenderRef(record.broker, record.group)
        room = mgr.engine.receiver(self.bootstrap_room, self._sender)
        try:
            room.announce()
        except KvBrokerError as exc:
            logger.warning("kvbroker: room %d: announcing it refused: %s", self.bootstrap_room, exc)
            return
        self._announced = room

    def _withdraw(self, reason: str) -> None:
        """The request no longer waits for the announced room: an empty room, aborted at once,
        ends the announcement and tells the prefill's broker, which fails its side now (the
        prefill frees its pages without waiting for its lease)."""
        room, self._announced = self._announced, None
        if room is None or self._room is not None:
            return
        try:
            room.init([])
            room.abort(reason)
        except KvBrokerError as exc:
            logger.warning("kvbroker: room %d: giving it up failed: %s", self.bootstrap_room, exc)

    def abort(self) -> None:
        self._withdraw("aborted by SGLang before the decode allocated its pages")
        super().abort()

    def clear(self) -> None:
        self._withdraw("SGLang let the request go before the decode allocated its pages")
        super().clear()

    def poll(self) -> int:
        before = int(KVPoll.Bootstrapping if self._sender is None else KVPoll.WaitingForInput)
        state = self._poll_room(before)
        # The room opens in the broker's handshake: still waiting, for SGLang.
        return int(KVPoll.WaitingForInput) if state == KVPoll.Bootstrapping and self._room is not None else state

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Sequence[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = KVTransferDestination.DEVICE,
        **_: Any,
    ) -> None:
        if self._error is not None or self._room is not None:
            return
        try:
            if self._sender is None:
                raise FailedPrecondition(f"room {self.bootstrap_room}: send_metadata before init")
            if destination != KVTransferDestination.DEVICE:
                raise Unimplemented("kvbroker's SGLang backend does not receive into host (hicache) destinations yet")
            state = state_of(self.kv_mgr.kv_args.state_types, state_indices)
            prefix = int(decode_prefix_len or 0)
            if prefix % self.kv_mgr.page_size:
                raise InvalidArgument(f"decode prefix of {prefix} tokens is not whole pages of {self.kv_mgr.page_size}")
            room = self._announced or self.kv_mgr.engine.receiver(self.bootstrap_room, self._sender)
            room.init(
                np.asarray(kv_indices, dtype=np.int64).reshape(-1),
                aux_row=aux_index,
                state=state,
                prefix_pages=prefix // self.kv_mgr.page_size,
                priority=self._priority,
            )
        except KvBrokerError as exc:
            self._fail(exc)
            return
        self._announced = None  # ExpectRoom ended the announcement
        self._room = room
        self._started = time.monotonic()

    def is_abort_release_safe(self) -> bool:
        return self._room is None or bool(self._room.status().pages_settled)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Aborting the room tells the prefill's broker; nothing more to arm."""
        return


class KVBrokerBootstrapServer(BootstrapServer, BaseKVBootstrapServer):
    """SGLang starts it on the prefill at ``--disaggregation-bootstrap-port``."""

    def __init__(self, host: str, port: int) -> None:
        BootstrapServer.__init__(self, host or "0.0.0.0", port)

    def poll(self) -> int:
        return int(KVPoll.Success)

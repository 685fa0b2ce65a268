"""vLLM KV connector: disaggregated prefill and decode through kvbroker.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBrokerConnector",
                           "kv_connector_module_path": "kvbroker.adapters.vllm",
                           "kv_role": "kv_both" | "kv_producer" | "kv_consumer",
                           "kv_connector_extra_config": {"broker": "127.0.0.1:50051",
                                                         "group": "prefill-0"}}'

``broker`` is the address of the kvbroker on this host (its ``--listen``,
or its engine socket as ``unix:PATH``), ``group`` this engine's group name
(unique per engine; its tp ranks share it). ``kv_both`` (NixlConnector's
usual config, on both engines) registers the ranks for either direction:
each request's ``kv_transfer_params`` say which way its KV moves.
``advertise_address`` (or ``KVBROKER_ADVERTISE_ADDRESS``) is the address
decode hosts reach this host's broker at, published with each finished
prefill; by default the broker's own (``kvbroker serve --advertise``, else
its listen address), asked of the broker once. Each rank declares a
compatibility digest (:func:`compatibility_of`: vLLM version, model,
dtypes, KV layout, attention backend); a decode whose digest
differs from the prefill's has the room refused, naming both
(``"enforce_compatibility": false`` declares none, so nothing is checked).
``sender_info_timeout`` (the prefill's lease: seconds a finished request's
blocks wait for its decode to open the room or renew the lease; NixlConnector's
``kv_lease_duration`` is read as the same), ``bootstrap_timeout`` and
``receiver_data_timeout`` (the decode's waits for the prefill's broker and
for its KV) bound this engine's rooms instead of its broker's flags of the
same names. The flow is vLLM's push mode: the prefill finishes a request
(``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}`` from
the proxy), its scheduler keeps the blocks and returns the parameters the
decode needs (``remote_broker``, ``remote_group``, ``remote_request_id``,
``remote_block_ids``, and NIXL's ``remote_host``/``remote_port``/
``remote_engine_id``/``tp_size`` for proxies that read those), and its
worker opens a kvbroker room and sends the blocks. The proxy passes the
parameters to the decode request; the decode scheduler asks for the prompt's
tokens beyond its own prefix-cache hits, its worker opens the room with its
newly allocated blocks (``prefix_pages``: the blocks it already holds), and
the broker writes the rest. A decode request that waits in vLLM's queue
before its blocks are allocated has its room announced
(``KVReceiver.announce``, once, from ``on_new_request``): the decode's broker
renews the prefill's lease on its blocks until the room opens, the request
ends (its room aborted) or the engine goes away. A room that fails reports the blocks that did not
arrive (``get_block_ids_with_load_errors``), so vLLM's load-failure policy
(recompute or fail) applies.

Each room opens with its request's class and deadline (``RoomPriority``;
:mod:`kvbroker.adapters._priorities`): ``kvbroker_priority`` (a class name
or a RoomPriority value) and ``kvbroker_deadline_ms`` in the request's
``kv_transfer_params`` where present (the prefill returns them with its
parameters, so the proxy carries them to the decode), else its vLLM priority
(``Request.priority``: lower is more urgent, default 0) through
``kvbroker_interactive_at_most`` and ``kvbroker_bulk_at_least`` in
``kv_connector_extra_config``: at most the first, interactive; at least
the second, bulk; else standard. Neither set (the default): unspecified.
The scheduler side decides (vLLM's scheduler hooks hold the request) and
its metadata carries the class to the workers; a value the mapping does not
take refuses the room, as any room refused at once (logged with the value).
The decode's class, where it has one, wins on both brokers.

The KV cache is vLLM's CPU layout: one tensor per layer, ``[blocks, kv
heads, block_size, 2 * head_dim]``, moved into shared memory in place at
registration (``EngineMemory.adopt``). The tensor-parallel sizes of the two
sides may differ (the broker moves each head's part of a block); the block
sizes may not (inside a block the attention kernel orders the tokens).
On GPUs (written, never run on one): FlashAttention's and MLA's CUDA caches
are exported where they lie (:func:`kv_layout_of`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from kvbroker.adapters._priorities import (
    DEADLINE_KEY,
    PRIORITY_KEY,
    RoomClass,
    room_class_of,
    vllm_priority_rule,
)
from kvbroker.adapters._vllm_config import (
    check_parallel,
    compatibility_of,
    kv_layout_of,
    room_timeouts_of,
)
from kvbroker.adapters._vllm_meta import KVBrokerMetadata, _Abort, _Announce, _Recv, _Send
from kvbroker.adapters._vllm_stats import KVBrokerPromMetrics, KVBrokerStats
from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.errors import InvalidArgument, KvBrokerError, Unimplemented

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVBrokerConnector", "check_parallel", "compatibility_of", "kv_layout_of", "room_of"]

logger = init_logger(__name__)


#: The environment variable that overrides the broker address published to decode hosts.
ENV_ADVERTISE = "KVBROKER_ADVERTISE_ADDRESS"


def _role_of(kv_role: str | None) -> Literal["prefill", "decode", "both"]:
    """kvbroker's role for vLLM's ``kv_role``."""
    roles: dict[str | None, Literal["prefill", "decode", "both"]] = {
        "kv_producer": "prefill",
        "kv_consumer": "decode",
        "kv_both": "both",
    }
    if kv_role not in roles:
        raise Unimplemented(f"kv_role {kv_role!r}: kvbroker's connector takes kv_producer, kv_consumer or kv_both")
    return roles[kv_role]


def room_of(request_id: str) -> int:
    """The kvbroker room of a prefill request: both sides derive it from its id."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def _allow_amx() -> None:
    """Let this process use the CPU's AMX tiles, where it has them.

    Linux lets a process use AMX only once it has asked (``arch_prctl
    ARCH_REQ_XCOMP_PERM``; torch's ``torch.cpu._init_amx``). vLLM's CPU attention
    kernel uses AMX tiles for bf16 caches and does not ask; an engine whose
    first steps compute whole prompts runs fine (oneDNN, by our reading, asks
    at its first AMX matmul), but a decode engine whose prompts' KV comes
    through kvbroker runs only one-token steps, and its worker died of SIGILL
    in ``cpu_attention_with_kv_cache`` at its first step (vLLM 0.32.0's CPU
    build, unbound tp 1 workers, a Xeon with amx_bf16). A fresh vLLM engine
    whose first prompt is one token dies the same way, kvbroker or not, and
    lives if the process asked first. Asking is free where AMX is absent."""
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


class KVBrokerConnector(KVConnectorBase_V1):
    """vLLM's connector interface over kvbroker (scheduler and worker sides)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_parallel(vllm_config.parallel_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._broker = str(extra.get("broker", "127.0.0.1:50051"))
        self._group = str(extra.get("group") or self._kv_transfer_config.engine_id or "vllm")
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._block_size = vllm_config.cache_config.block_size
        self._role: Literal["prefill", "decode", "both"] = _role_of(self._kv_transfer_config.kv_role)
        self._advertise = str(extra.get("advertise_address") or os.environ.get(ENV_ADVERTISE, ""))
        self._enforce_compatibility = bool(extra.get("enforce_compatibility", True))
        self._vmm_pool = bool(extra.get("vmm_pool", True))
        self._timeouts = room_timeouts_of(extra)
        self._priorities = vllm_priority_rule(extra)
        self._scheduler = _Scheduler(self) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _Worker(self, vllm_config) if role == KVConnectorRole.WORKER else None

    # -- scheduler side ------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        if self._scheduler is not None:
            self._scheduler.new(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.meta()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids)

    # -- metrics ---------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVBrokerStats | None:
        """The rooms this rank saw end since vLLM last asked (then forgotten)."""
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBrokerStats:
        return KVBrokerStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVBrokerPromMetrics:
        return KVBrokerPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.received(connector_output.finished_recving)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pending()

    # -- worker side ---------------------------------------------------------------
    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        """On CUDA, kvbroker's VMM allocator for the KV cache (exported to the
        broker as fds). ``"vmm_pool": false`` in ``kv_connector_extra_config``
        leaves vLLM's own allocator (its caches then go as CUDA IPC handles)."""
        if self._worker is None or not self._vmm_pool or not torch.cuda.is_available():
            return None
        from kvbroker import vmmpool

        return torch.cuda.use_mem_pool(vmmpool.mem_pool(torch.cuda.current_device()))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBrokerMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


class _Scheduler:
    """The scheduler side: which tokens load remotely, which blocks to send."""

    def __init__(self, connector: KVBrokerConnector) -> None:
        self.c = connector
        self._sends: dict[str, _Send] = {}
        self._recvs: dict[str, _Recv] = {}
        self._aborts: list[_Abort] = []
        #: Decode requests that arrived since the last step and are not allocated yet: their rooms
        #: are announced by the workers if they are still waiting when the step's metadata is built.
        self._announces: dict[str, _Announce] = {}
        #: Decode requests whose room is open (handed to the worker), until it reports them received.
        self._loading: set[str] = set()

    def new(self, request: Request) -> None:
        """A request entered vLLM's queue (``on_new_request``, once per request). A decode
        request's KV waits at the prefill for the prefill's lease only; while this one waits for
        its blocks (a full KV cache, or more requests than ``max_num_seqs``: vLLM does not even
        ask ``get_num_new_matched_tokens`` then), its room is announced so that its broker renews
        that lease. Allocated in the same step (the usual case), it is not announced at all."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and params.get("remote_broker"):
            self._announces[request.request_id] = _Announce(request.request_id, dict(params))

    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._announces.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        if num_external_tokens <= 0:
            # vLLM computes the whole prompt here (its own cache holds what the prefill would
            # send): the prefill's room is aborted now, which ends an announcement too.
            params["do_remote_prefill"] = False
            self._aborts.append(_Abort(request.request_id, dict(params), holds_blocks=False))
            return
        (local,) = blocks.get_unhashed_block_ids_all_groups()
        # The prompt's blocks (this engine's size) that are not new are its prefix-cache hits.
        prompt_blocks = -(-len(request.prompt_token_ids or []) // self.c._block_size)
        held = max(0, prompt_blocks - len(local))
        room_class, refusal = self.room_class(request)
        self._recvs[request.request_id] = _Recv(request.request_id, list(local), dict(params), held, room_class, refusal)
        self._loading.add(request.request_id)
        params["do_remote_prefill"] = False  # a second call (after the load) changes nothing

    def meta(self) -> KVBrokerMetadata:
        meta = KVBrokerMetadata(
            sends=list(self._sends.values()),
            recvs=list(self._recvs.values()),
            aborts=self._aborts,
            announces=list(self._announces.values()),
        )
        self._sends.clear()
        self._recvs.clear()
        self._aborts = []
        self._announces.clear()
        return meta

    def received(self, finished_recving: set[str] | None) -> None:
        """What the workers reported received (or failed) this step: no longer loading."""
        self._loading -= finished_recving or set()

    def finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        self._announces.pop(request.request_id, None)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and params.get("remote_broker"):
            # Finished (aborted) before its blocks were allocated: the prefill
            # still holds its blocks for the room; an empty room, aborted at
            # once, tells its broker (NixlConnector notifies the same way) and
            # ends the room's announcement.
            params["do_remote_prefill"] = False
            self._aborts.append(_Abort(request.request_id, dict(params), holds_blocks=False))
            return False, None
        if request.request_id in self._loading:
            # Finished before its KV arrived: abort the room. vLLM keeps the
            # blocks until the worker reports the room received, which it does
            # once nothing can land in them any more.
            self._loading.discard(request.request_id)
            self._aborts.append(_Abort(request.request_id, dict(params or {}), holds_blocks=True))
            return False, None
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        blocks = list(block_ids[0]) if block_ids and isinstance(block_ids[0], (list, tuple)) else list(block_ids)
        if not blocks:
            return False, None
        room_class, refusal = self.room_class(request)
        self._sends[request.request_id] = _Send(request.request_id, blocks, room_class, refusal)
        address = self.advertised()
        host, _, port = address.rpartition(":")
        # The request's own class and deadline go on to its decode with the rest (the proxy
        # hands the decode these parameters): both sides then open its room alike.
        own = {key: params[key] for key in (PRIORITY_KEY, DEADLINE_KEY) if params.get(key) is not None}
        return True, {
            **own,
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_broker": address,
            "remote_group": self.c._group,
            "remote_request_id": request.request_id,
            "remote_block_ids": blocks,
            "remote_engine_id": self.c._group,
            "remote_host": host,
            "remote_port": int(port) if port.isdigit() else 0,
            "tp_size": self.c._tp_size,
        }

    def room_class(self, request: Request) -> tuple[RoomClass, str]:
        """The class and deadline ``request``'s room opens with: its ``kv_transfer_params``'
        ``kvbroker_priority`` and ``kvbroker_deadline_ms``, else its vLLM priority through the
        connector's rule. A value the mapping does not take: no class, and why (the worker
        refuses the room with it; the scheduler must not raise)."""
        try:
            return room_class_of(request.kv_transfer_params, request.priority, self.c._priorities, request.request_id), ""
        except InvalidArgument as exc:
            return RoomClass(), exc.message

    def advertised(self) -> str:
        """Where decode hosts reach this host's broker: ``advertise_address``
        or the environment's, else what the broker advertises (asked once)."""
        if not self.c._advertise:
            with BrokerClient(self.c._broker) as client:
                self.c._advertise = client.info.listen_address or self.c._broker
            logger.info("kvbroker: publishing broker address %s to decode engines", self.c._advertise)
        return self.c._advertise

    def pending(self) -> bool:
        """Rooms not handed to the worker yet. (vLLM steps anyway while a finished
        request holds its blocks: its scheduler counts it until they are freed.)"""
        return bool(self._sends or self._recvs or self._aborts or self._announces)


class _Worker:
    """The worker side: the engine rank registered with its broker, and its rooms."""

    def __init__(self, connector: KVBrokerConnector, vllm_config: VllmConfig) -> None:
        self.c = connector
        self._config = vllm_config
        self._lock = threading.Lock()
        self._client: BrokerClient | None = None
        self._memory: EngineMemory | None = None
        self._device: torch.device | None = None
        self._engine: Any = None
        self._sending: dict[str, Any] = {}
        self._receiving: dict[str, tuple[Any, list[int]]] = {}
        self._load_errors: set[int] = set()
        #: Rooms the client refused at once: reported by the next ``finished``.
        self._refused_sends: set[str] = set()
        #: Receives aborted because vLLM finished their requests first.
        self._abandoned: set[str] = set()
        #: When each open room was opened (its time in the metrics).
        self._opened: dict[str, float] = {}
        self._stats = KVBrokerStats()
        self._refused_recvs: set[str] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        layers = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        block_size = self.c._block_size
        total_heads = self._config.model_config.get_total_num_kv_heads()
        model, kv = kv_layout_of([t for _, t in layers], total_heads=total_heads, block_size=block_size)
        if self.c._enforce_compatibility:
            model = replace(model, compatibility=compatibility_of(self._config, model, layers[0][1].device.type))
        role = self.c._role
        rank = RankSpec(group=self.c._group, role=role, tp_size=self.c._tp_size, tp_rank=get_tensor_model_parallel_rank())
        self._device = layers[0][1].device
        if self._device.type == "cpu":
            _allow_amx()
        self._memory = EngineMemory.adopt(rank, model, kv=kv)
        self._client = BrokerClient(self.c._broker)
        self._engine = self._client.register_engine(rank, self._memory, timeouts=self.c._timeouts)
        logger.info(
            "kvbroker: registered %s rank tp%d of group %s with broker %s: %d layers, %s, blocks of %d tokens on %s",
            role, rank.tp_rank, rank.group, self.c._broker, len(layers), model.kv_layout, block_size, layers[0][1].device,
        )

    def start(self, meta: KVBrokerMetadata) -> None:
        """Open this step's rooms and announce its waiting ones. A room the
        client refuses at once (a bad block id, parameters that name no
        broker) ends at once: a send is reported finished (vLLM frees its
        blocks), a receive as not loaded. An announcement refused is only
        logged: the request still waits, on the prefill's lease alone."""
        if meta.sends and self._device is not None and self._device.type == "cuda":
            # The broker reads the blocks from its own stream: the forward
            # passes that wrote them, queued on the compute stream, must be
            # done first (docs/client.md: a sender makes its writes visible).
            torch.cuda.current_stream(self._device).synchronize()
        for send in meta.sends:
            try:
                if send.refusal:
                    raise InvalidArgument(send.refusal)
                sender = self._engine.sender(room_of(send.request_id))
                sender.init(
                    len(send.block_ids), priority=send.room_class.priority, deadline_seconds=send.room_class.deadline_seconds
                )
                sender.send(send.block_ids)
            except KvBrokerError as exc:
                logger.warning("kvbroker: sending request %s refused: %s", send.request_id, exc)
                self._refused_sends.add(send.request_id)
                self._stats.record("sent", False, 0, 0.0)
                continue
            self._sending[send.request_id] = sender
            self._opened[send.request_id] = time.monotonic()
        for announce in meta.announces:
            try:
                self._receiver(announce.params).announce()
            except (KvBrokerError, KeyError, TypeError, ValueError) as exc:
                logger.warning("kvbroker: announcing request %s refused: %s", announce.request_id, exc)
        for recv in meta.recvs:
            try:
                if recv.refusal:
                    raise InvalidArgument(recv.refusal)
                receiver = self._receiver(recv.params)
                receiver.init(
                    recv.local_block_ids,
                    prefix_pages=recv.prefix_blocks,
                    priority=recv.room_class.priority,
                    deadline_seconds=recv.room_class.deadline_seconds,
                )
            except (KvBrokerError, KeyError, TypeError, ValueError) as exc:
                logger.warning("kvbroker: receiving request %s refused: %s", recv.request_id, exc)
                self._load_errors |= set(recv.local_block_ids)
                self._refused_recvs.add(recv.request_id)
                self._stats.record("received", False, 0, 0.0)
                continue
            self._receiving[recv.request_id] = (receiver, recv.local_block_ids)
            self._opened[recv.request_id] = time.monotonic()
        for abort in meta.aborts:
            self._abort(abort)

    def _abort(self, abort: _Abort) -> None:
        """A decode request vLLM finished before its KV arrived: abort its room
        (its broker tells the prefill's, which frees the prefill's blocks)."""
        reason = f"the decode finished request {abort.request_id} before its KV arrived"
        known = self._receiving.get(abort.request_id)
        try:
            if known is not None:
                # Reported in finished_recving once its pages are settled, as any failed room.
                known[0].abort(reason)
                self._abandoned.add(abort.request_id)
                return
            if abort.holds_blocks:
                return  # its room ended already (reported received): nothing can land
            receiver = self._receiver(abort.params)
            receiver.init([])
            receiver.abort(reason)
        except (KvBrokerError, KeyError, TypeError, ValueError) as exc:
            logger.warning("kvbroker: aborting request %s failed: %s", abort.request_id, exc)

    def _receiver(self, params: dict[str, Any]) -> Any:
        """The receiving side of the room a decode request's ``kv_transfer_params`` name."""
        return self._engine.receiver(room_of(params["remote_request_id"]), SenderRef(params["remote_broker"], params["remote_group"]))

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        sent, received = self._refused_sends, self._refused_recvs
        self._refused_sends, self._refused_recvs = set(), set()
        for rid, sender in list(self._sending.items()):
            status = sender.status()
            if status.state in (RoomState.SUCCESS, RoomState.FAILED) and status.pages_settled:
                if status.state == RoomState.FAILED:
                    logger.warning("kvbroker: sending request %s failed: %s", rid, status.cause.message)
                sent.add(rid)
                del self._sending[rid]
                self._ended(rid, "sent", status)
        for rid, (receiver, blocks) in list(self._receiving.items()):
            status = receiver.status()
            if status.state == RoomState.SUCCESS:
                received.add(rid)
            elif status.state == RoomState.FAILED and status.pages_settled:
                if rid in self._abandoned:
                    self._abandoned.discard(rid)  # vLLM finished it: nothing to load or report missing
                else:
                    landed = set(receiver.landed_pages().tolist())
                    self._load_errors |= {b for b in blocks if b not in landed}
                    logger.warning("kvbroker: receiving request %s failed: %s", rid, status.cause.message)
                received.add(rid)
            else:
                continue
            del self._receiving[rid]
            self._ended(rid, "received", status)
        return sent or None, received or None

    def _ended(self, rid: str, direction: str, status: Any) -> None:
        started = self._opened.pop(rid, None)
        took = time.monotonic() - started if started is not None else 0.0
        self._stats.record(direction, status.state == RoomState.SUCCESS, int(status.bytes), took)

    def take_stats(self) -> KVBrokerStats | None:
        """The interval's stats (None when no room ended), and a fresh interval."""
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVBrokerStats()
        return stats

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self._engine is not None:
            try:
                self._engine.close()
            except Exception as exc:  # noqa: BLE001 - shutting down: report and go on
                logger.warning("kvbroker: unregistering failed: %s", exc)
        if self._client is not None:
            self._client.close()
        if self._memory is not None:
            self._memory.close()

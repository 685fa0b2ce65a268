"""vLLM KV connector: disaggregated prefill and decode through kvbroker.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBrokerConnector",
                           "kv_connector_module_path": "kvbroker.adapters.vllm",
                           "kv_role": "kv_producer" (prefill) | "kv_consumer" (decode),
                           "kv_connector_extra_config": {"broker": "127.0.0.1:50051",
                                                         "group": "prefill-0"}}'

``broker`` is the address of the kvbroker on this host (its ``--listen``),
``group`` this engine's group name (unique per engine; its tp ranks share
it). The flow is vLLM's push mode: the prefill finishes a request
(``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}`` from
the proxy), its scheduler keeps the blocks and returns the parameters the
decode needs (``remote_broker``, ``remote_group``, ``remote_request_id``,
``remote_block_ids``, and NIXL's ``remote_host``/``remote_port``/
``remote_engine_id``/``tp_size`` for proxies that read those), and its
worker opens a kvbroker room and sends the blocks. The proxy passes the
parameters to the decode request; the decode scheduler asks for the prompt's
tokens beyond its own prefix-cache hits, its worker opens the room with its
newly allocated blocks (``prefix_pages``: the blocks it already holds), and
the broker writes the rest. A room that fails reports the blocks that did not
arrive (``get_block_ids_with_load_errors``), so vLLM's load-failure policy
(recompute or fail) applies.

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
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from kvbroker.client import BrokerClient, EngineMemory, ModelSpec, RankSpec, RoomState, SenderRef
from kvbroker.errors import KvBrokerError, Unimplemented

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVBrokerConnector", "kv_layout_of", "room_of"]

logger = init_logger(__name__)


def kv_layout_of(
    caches: list[torch.Tensor], *, total_heads: int, block_size: int
) -> tuple[ModelSpec, dict[int, list[torch.Tensor]]]:
    """The model's KV layout and kvbroker's view of vLLM's per-layer KV caches.

    - CPU (vLLM's CPU attention): ``[blocks, kv heads, block_size, 2 *
      head_dim]`` per layer, the fused layout.
    - CUDA, FlashAttention's layout ``[2, blocks, block_size, kv heads,
      head_dim]``: K and V are the two halves, token-major pages ("nhd").
    - CUDA, MLA ``[blocks, block_size, latent dim]``: one latent tensor.

    Other layouts (FlashInfer's ``[blocks, 2, ...]`` interleaves K and V per
    block; stride-permuted HND caches) raise ``Unimplemented`` naming the
    shape. CUDA caches are exported where they lie (``EngineMemory.adopt``);
    that path has not run on a GPU."""
    first = caches[0]
    shape = tuple(first.shape)
    if first.device.type == "cpu":
        _blocks, _heads, size, fused = shape
        model = ModelSpec(
            num_layers=len(caches), total_kv_heads=total_heads, head_dim=fused // 2, dtype=first.dtype,
            page_size=size, kv_layout="hnd_fused",
        )
        return model, {i: [t] for i, t in enumerate(caches)}
    if first.dim() == 5 and shape[0] == 2 and shape[2] == block_size:
        model = ModelSpec(num_layers=len(caches), total_kv_heads=total_heads, head_dim=shape[4], dtype=first.dtype, page_size=block_size)
        return model, {i: [t[0], t[1]] for i, t in enumerate(caches)}
    if first.dim() == 3 and shape[1] == block_size:
        model = ModelSpec(num_layers=len(caches), total_kv_heads=1, head_dim=shape[2], dtype=first.dtype, page_size=block_size, mla=True)
        return model, {i: [t] for i, t in enumerate(caches)}
    raise Unimplemented(
        f"vLLM's {first.device.type} KV cache of shape {shape} is not a layout kvbroker moves: it takes "
        "FlashAttention's (2, blocks, block_size, kv heads, head_dim) and MLA's (blocks, block_size, dim)"
    )


def room_of(request_id: str) -> int:
    """The kvbroker room of a prefill request: both sides derive it from its id."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


@dataclass
class _Send:
    request_id: str
    block_ids: list[int]


@dataclass
class _Recv:
    request_id: str
    local_block_ids: list[int]
    params: dict[str, Any]
    #: Leading blocks of the prompt this engine holds already (its prefix cache).
    prefix_blocks: int = 0


@dataclass
class KVBrokerMetadata(KVConnectorMetadata):
    """What one step asks of the workers: rooms to send, rooms to receive."""

    sends: list[_Send] = field(default_factory=list)
    recvs: list[_Recv] = field(default_factory=list)


class KVBrokerConnector(KVConnectorBase_V1):
    """vLLM's connector interface over kvbroker (scheduler and worker sides)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._broker = str(extra.get("broker", "127.0.0.1:50051"))
        self._group = str(extra.get("group") or self._kv_transfer_config.engine_id or "vllm")
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._block_size = vllm_config.cache_config.block_size
        self._producer = self._kv_transfer_config.is_kv_producer
        self._vmm_pool = bool(extra.get("vmm_pool", True))
        self._scheduler = _Scheduler(self) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _Worker(self, vllm_config) if role == KVConnectorRole.WORKER else None

    # -- scheduler side ------------------------------------------------------------
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
        self._sends: dict[str, list[int]] = {}
        self._recvs: dict[str, _Recv] = {}

    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or []) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        (local,) = blocks.get_unhashed_block_ids_all_groups()
        # The prompt's blocks (this engine's size) that are not new are its prefix-cache hits.
        prompt_blocks = -(-len(request.prompt_token_ids or []) // self.c._block_size)
        held = max(0, prompt_blocks - len(local))
        self._recvs[request.request_id] = _Recv(request.request_id, list(local), dict(params), held)
        params["do_remote_prefill"] = False  # a second call (after the load) changes nothing

    def meta(self) -> KVBrokerMetadata:
        meta = KVBrokerMetadata(
            sends=[_Send(rid, blocks) for rid, blocks in self._sends.items()], recvs=list(self._recvs.values())
        )
        self._sends.clear()
        self._recvs.clear()
        return meta

    def finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        blocks = list(block_ids[0]) if block_ids and isinstance(block_ids[0], (list, tuple)) else list(block_ids)
        if not blocks:
            return False, None
        self._sends[request.request_id] = blocks
        host, _, port = self.c._broker.rpartition(":")
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_broker": self.c._broker,
            "remote_group": self.c._group,
            "remote_request_id": request.request_id,
            "remote_block_ids": blocks,
            "remote_engine_id": self.c._group,
            "remote_host": host,
            "remote_port": int(port) if port.isdigit() else 0,
            "tp_size": self.c._tp_size,
        }

    def pending(self) -> bool:
        """Rooms not handed to the worker yet. (vLLM steps anyway while a finished
        request holds its blocks: its scheduler counts it until they are freed.)"""
        return bool(self._sends or self._recvs)


class _Worker:
    """The worker side: the engine rank registered with its broker, and its rooms."""

    def __init__(self, connector: KVBrokerConnector, vllm_config: VllmConfig) -> None:
        self.c = connector
        self._config = vllm_config
        self._lock = threading.Lock()
        self._client: BrokerClient | None = None
        self._memory: EngineMemory | None = None
        self._engine: Any = None
        self._sending: dict[str, Any] = {}
        self._receiving: dict[str, tuple[Any, list[int]]] = {}
        self._load_errors: set[int] = set()
        #: Rooms the client refused at once: reported by the next ``finished``.
        self._refused_sends: set[str] = set()
        self._refused_recvs: set[str] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        layers = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        block_size = self.c._block_size
        total_heads = self._config.model_config.get_total_num_kv_heads()
        model, kv = kv_layout_of([t for _, t in layers], total_heads=total_heads, block_size=block_size)
        role: Literal["prefill", "decode"] = "prefill" if self.c._producer else "decode"
        rank = RankSpec(group=self.c._group, role=role, tp_size=self.c._tp_size, tp_rank=get_tensor_model_parallel_rank())
        self._memory = EngineMemory.adopt(rank, model, kv=kv)
        self._client = BrokerClient(self.c._broker)
        self._engine = self._client.register_engine(rank, self._memory)
        logger.info(
            "kvbroker: registered %s rank tp%d of group %s with broker %s: %d layers, %s, blocks of %d tokens on %s",
            role, rank.tp_rank, rank.group, self.c._broker, len(layers), model.kv_layout, block_size, layers[0][1].device,
        )

    def start(self, meta: KVBrokerMetadata) -> None:
        """Open this step's rooms. A room the client refuses at once (a bad
        block id, parameters that name no broker) ends at once: a send is
        reported finished (vLLM frees its blocks), a receive as not loaded."""
        for send in meta.sends:
            try:
                sender = self._engine.sender(room_of(send.request_id))
                sender.init(len(send.block_ids))
                sender.send(send.block_ids)
            except KvBrokerError as exc:
                logger.warning("kvbroker: sending request %s refused: %s", send.request_id, exc)
                self._refused_sends.add(send.request_id)
                continue
            self._sending[send.request_id] = sender
        for recv in meta.recvs:
            try:
                receiver = self._engine.receiver(
                    room_of(recv.params["remote_request_id"]),
                    SenderRef(recv.params["remote_broker"], recv.params["remote_group"]),
                )
                receiver.init(recv.local_block_ids, prefix_pages=recv.prefix_blocks)
            except (KvBrokerError, KeyError, TypeError, ValueError) as exc:
                logger.warning("kvbroker: receiving request %s refused: %s", recv.request_id, exc)
                self._load_errors |= set(recv.local_block_ids)
                self._refused_recvs.add(recv.request_id)
                continue
            self._receiving[recv.request_id] = (receiver, recv.local_block_ids)

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
        for rid, (receiver, blocks) in list(self._receiving.items()):
            status = receiver.status()
            if status.state == RoomState.SUCCESS:
                received.add(rid)
            elif status.state == RoomState.FAILED and status.pages_settled:
                landed = set(receiver.landed_pages().tolist())
                self._load_errors |= {b for b in blocks if b not in landed}
                logger.warning("kvbroker: receiving request %s failed: %s", rid, status.cause.message)
                received.add(rid)
            else:
                continue
            del self._receiving[rid]
        return sent or None, received or None

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

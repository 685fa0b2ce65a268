"""SGLang's own disaggregation code, driven in one process over kvbroker.

A prefill and a decode "engine" of tp 1 share this process (SGLang's runtime
context is per process, and both read the same settings): each has SGLang's
real KV pool (``MHATokenToKVPool`` on CPU), page allocator, request-to-token
table, radix cache, metadata buffers and disaggregation queues
(``PrefillBootstrapQueue``, the prefill scheduler mixin's ``send_kv_chunk``
and ``process_disagg_prefill_inflight_queue``, ``DecodePreallocQueue``,
``DecodeTransferQueue``), built the way SGLang's scheduler builds them. The
schedulers here hold only the attributes those queues read. The model's
forward pass is the one thing not SGLang's: :func:`prefill_forward` writes a
known KV pattern (:func:`kv_pattern`) and a first token where the model
would. Importing this module loads SGLang's plugins (kvbroker's among them).
"""

from __future__ import annotations

import tempfile
import time
from array import array
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.plugins import load_plugins

load_plugins()

from sglang.srt.disaggregation import decode as sg_decode  # noqa: E402
from sglang.srt.disaggregation import prefill as sg_prefill  # noqa: E402
from sglang.srt.disaggregation.utils import (  # noqa: E402
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    TransferBackend,
)
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.runtime_context import get_context, get_disagg, get_parallel  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 8, 4
POOL_TOKENS = 256
METADATA_ROWS = 8


#: The hybrid model: Mamba layers 0 and 2, attention layers 1 and 3.
HYBRID_LAYERS, MAMBA_LAYERS, ATTENTION_LAYERS = 4, [0, 2], [1, 3]


class ModelConfig:
    def __init__(self, num_hidden_layers: int = LAYERS) -> None:
        self.num_hidden_layers = num_hidden_layers
        hybrid = num_hidden_layers == HYBRID_LAYERS
        self.hf_text_config = SimpleNamespace(full_attention_layer_ids=ATTENTION_LAYERS) if hybrid else SimpleNamespace()

    def get_total_num_kv_heads(self) -> int:
        return HEADS


def _mamba_params() -> Any:
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape

    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=4, head_dim=8, state_size=8, conv_kernel=4
    )
    return Mamba2CacheParams(shape=shape, layers=MAMBA_LAYERS)


def _kv_pool() -> tuple[MHATokenToKVPool, PagedTokenToKVPoolAllocator]:
    pool = MHATokenToKVPool(
        size=POOL_TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=HEADS, head_dim=HEAD_DIM,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False,
    )
    return pool, PagedTokenToKVPoolAllocator(POOL_TOKENS, PAGE, torch.bfloat16, "cpu", pool, need_sort=False)


class _Streamer:
    def __init__(self) -> None:
        self.streamed: list[Any] = []

    def stream_output(self, reqs: list[Any], *args: Any, **kwargs: Any) -> None:
        self.streamed.extend(reqs)


class _Metrics:
    enable_metrics = False


class _SchedulerParts:
    """What both engines' schedulers hold: the KV pool and its allocator, the
    metadata buffers, and the bookkeeping SGLang's queues touch. ``hybrid``:
    the hybrid model (SGLang's HybridLinearKVPool over a Mamba pool)."""

    def _req_to_token_pool(self) -> Any:
        raise NotImplementedError

    def __init__(self, server_args: Any, hybrid: bool = False) -> None:
        self.server_args = server_args
        self.hybrid = hybrid
        self.model_config = ModelConfig(HYBRID_LAYERS if hybrid else LAYERS)
        self.req_to_token_pool = self._req_to_token_pool()
        if hybrid:
            from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

            self.token_to_kv_pool = HybridLinearKVPool(
                size=POOL_TOKENS, dtype=torch.bfloat16, page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM,
                full_attention_layer_ids=ATTENTION_LAYERS, device="cpu", mamba_pool=self.req_to_token_pool.mamba_pool,
            )
            self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(
                POOL_TOKENS, PAGE, torch.bfloat16, "cpu", self.token_to_kv_pool, need_sort=False
            )
        else:
            self.token_to_kv_pool, self.token_to_kv_pool_allocator = _kv_pool()
        self.tp_worker = SimpleNamespace(
            model_runner=SimpleNamespace(effective_logical_max_total_num_tokens=POOL_TOKENS, kv_cache_dtype_str="auto"),
            is_hybrid_swa=False,
        )
        self.scheduler_stage_metrics = None
        self.waiting_queue: list[Any] = []
        self.output_streamer = _Streamer()
        self.metrics_reporter = _Metrics()
        self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(METADATA_ROWS)
        self.disagg_metadata_buffers = MetadataBuffers(
            METADATA_ROWS, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=4
        )

    def _backend(self) -> dict[str, Any]:
        """The queue arguments every disaggregation queue takes alike."""
        return {
            "req_to_metadata_buffer_idx_allocator": self.req_to_metadata_buffer_idx_allocator,
            "metadata_buffers": self.disagg_metadata_buffers,
            "gpu_id": 0,
            "bootstrap_port": get_disagg().disaggregation_bootstrap_port,
            "max_total_num_tokens": POOL_TOKENS,
            "transfer_backend": TransferBackend(get_disagg().disaggregation_transfer_backend),
        }


class PrefillScheduler(_SchedulerParts, sg_prefill.SchedulerDisaggregationPrefillMixin):
    """The parts of SGLang's Scheduler its prefill mixin reads."""

    _release_aborted_request = Scheduler._release_aborted_request

    def _req_to_token_pool(self) -> Any:
        if not self.hybrid:
            return ReqToTokenPool(size=8, max_context_len=POOL_TOKENS, device="cpu", enable_memory_saver=False)
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

        return HybridReqToTokenPool(
            size=8, mamba_size=8, mamba_spec_state_size=8, max_context_len=POOL_TOKENS, device="cpu",
            enable_memory_saver=False, cache_params=_mamba_params(), mamba_layer_ids=MAMBA_LAYERS,
            enable_mamba_extra_buffer=False,
        )

    def __init__(self, server_args: Any, hybrid: bool = False) -> None:
        super().__init__(server_args, hybrid)
        self.tree_cache = _tree_cache(self.req_to_token_pool, self.token_to_kv_pool_allocator, enabled=False)
        self.kv_shard_widening = 1
        self.processed_tokens_counter = 0
        self.rust_server = None
        self.attn_cp_cpu_group = None
        self.attn_tp_cpu_group = None
        self.enable_staging = False
        self.disagg_prefill_inflight_queue: list[Any] = []
        self.disagg_prefill_pending_chunk_rids: set[str] = set()
        self.disagg_prefill_bootstrap_queue = sg_prefill.PrefillBootstrapQueue(
            token_to_kv_pool=self.token_to_kv_pool,
            draft_token_to_kv_pool=None,
            scheduler=self,
            scheduler_stage_metrics=None,
            **self._backend(),
        )


class DecodeScheduler(_SchedulerParts, sg_decode.SchedulerDisaggregationDecodeMixin):
    """The parts of SGLang's Scheduler its decode queues read (a radix cache:
    its prefix hits make ``decode_prefix_len``)."""

    def _req_to_token_pool(self) -> Any:
        if not self.hybrid:
            return sg_decode.DecodeReqToTokenPool(
                size=8, max_context_len=POOL_TOKENS, device="cpu", enable_memory_saver=False, pre_alloc_size=8,
            )
        return sg_decode.HybridMambaDecodeReqToTokenPool(
            size=8, max_context_len=POOL_TOKENS, device="cpu", enable_memory_saver=False, cache_params=_mamba_params(),
            mamba_layer_ids=MAMBA_LAYERS, speculative_num_draft_tokens=0, enable_mamba_extra_buffer=False,
            pre_alloc_size=8, enable_overlap_schedule=False, mamba_size=16,
        )

    def __init__(self, server_args: Any, hybrid: bool = False) -> None:
        super().__init__(server_args, hybrid)
        self.tree_cache = _tree_cache(self.req_to_token_pool, self.token_to_kv_pool_allocator, enabled=True)
        self.random_seed = 0
        self.last_batch = None
        self.batch_result_processor = SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a, **k: None)
        self.enable_hisparse = False
        self.enable_decode_hicache = False
        self.enable_priority_scheduling = False
        self.enable_lora = False
        self.spec_algorithm = SimpleNamespace(is_none=lambda: True)
        self.running_batch = SimpleNamespace(reqs=[])
        self.kv_checksum_computer = None
        self.disagg_decode_prealloc_queue = None
        self.disagg_decode_transfer_queue = sg_decode.DecodeTransferQueue(
            req_to_metadata_buffer_idx_allocator=self.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=self.disagg_metadata_buffers,
            scheduler=self,
            tree_cache=self.tree_cache,
        )
        self.disagg_decode_prealloc_queue = sg_decode.DecodePreallocQueue(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            draft_token_to_kv_pool=None,
            scheduler=self,
            transfer_queue=self.disagg_decode_transfer_queue,
            tree_cache=self.tree_cache,
            num_reserved_decode_tokens=16,
            **self._backend(),
        )


def kv_pattern(token_ids: Sequence[int], start: int = 0) -> torch.Tensor:
    """The KV a prefill computes for ``token_ids`` at positions ``start...``:
    ``[layers, 2 (k, v), tokens, heads, head_dim]``, small integers (exact in
    bf16) that differ per token, position, layer, K/V, head and dim."""
    ids = torch.tensor(list(token_ids), dtype=torch.int64)
    pos = torch.arange(start, start + len(ids), dtype=torch.int64)
    layer = torch.arange(LAYERS).view(-1, 1, 1, 1, 1)
    kv = torch.arange(2).view(1, -1, 1, 1, 1)
    token = (ids * 31 + pos * 7).view(1, 1, -1, 1, 1)
    head = torch.arange(HEADS).view(1, 1, 1, -1, 1)
    dim = torch.arange(HEAD_DIM).view(1, 1, 1, 1, -1)
    return ((token + layer * 13 + kv * 5 + head * 3 + dim) % 251).to(torch.bfloat16)


def kv_of(pool: Any, slots: torch.Tensor) -> torch.Tensor:
    """What ``pool`` (or a hybrid pool's attention sub-pool) holds at token
    ``slots``, shaped like :func:`kv_pattern`."""
    full = getattr(pool, "full_kv_pool", pool)
    return torch.stack(
        [torch.stack([full.k_buffer[layer][slots], full.v_buffer[layer][slots]]) for layer in range(LAYERS)]
    )


def mamba_pattern(token_ids: Sequence[int], entry: int, shape: Sequence[int]) -> torch.Tensor:
    """The Mamba state a prefill leaves for a request (one state entry of SGLang's list)."""
    seed = (sum(token_ids) * 7 + entry) % (2**31)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def mamba_of(sched: Any, req: Req) -> list[torch.Tensor]:
    """The request's Mamba state slot, per state entry (SGLang's transfer order)."""
    pool = sched.req_to_token_pool
    slot = int(pool.req_index_to_mamba_index_mapping[req.kv.req_pool_idx])
    return [tensor[slot] for _, tensor, _, _ in pool.mamba_pool._iter_transfer_state_entries()]


def prefill_forward(sched: PrefillScheduler, req: Req, first_token: int) -> torch.Tensor:
    """What the prefill's forward pass leaves: the request's KV in its pool
    slots (``kv_pattern``) and its first output token. Returns the slots."""
    n = len(req.origin_input_ids)
    assert sched.req_to_token_pool.alloc([req]) is not None
    pages = -(-n // PAGE)
    slots = sched.token_to_kv_pool_allocator.alloc(pages * PAGE)[:n]
    sched.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, n)), slots.to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = n
    req.extend_end = n
    kv = kv_pattern(req.origin_input_ids)
    full = getattr(sched.token_to_kv_pool, "full_kv_pool", sched.token_to_kv_pool)
    for layer in range(LAYERS):
        full.k_buffer[layer][slots] = kv[layer, 0]
        full.v_buffer[layer][slots] = kv[layer, 1]
    if sched.hybrid:
        for entry, state in enumerate(mamba_of(sched, req)):
            state.copy_(mamba_pattern(req.origin_input_ids, entry, state.shape).to(state.dtype))
    req.output_ids.append(first_token)
    return slots


def _tree_cache(req_to_token_pool: Any, allocator: Any, *, enabled: bool) -> RadixCache:
    return RadixCache(
        CacheInitParams(disable=not enabled, req_to_token_pool=req_to_token_pool, token_to_kv_pool_allocator=allocator, page_size=PAGE)
    )


def publish(*, bootstrap_port: int, port: int, **fields: Any) -> Any:
    """SGLang's runtime context for tp-1 engine ranks in this process: the
    kvbroker backend, CPU, pages of ``PAGE`` tokens, the decode's radix cache
    on (its prefix hits are what ``decode_prefix_len`` carries), and any
    other server-args ``fields``; all-reduces over a gloo group of one.
    Returns the published ServerArgs."""
    if not dist.is_initialized():
        store = tempfile.mktemp(prefix="kvbroker-sglang-pg-")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    server_args = get_context().override_server_args(
        disaggregation_mode="prefill",
        disaggregation_transfer_backend="kvbroker",
        device="cpu",
        page_size=PAGE,
        disaggregation_bootstrap_port=bootstrap_port,
        disaggregation_decode_enable_radix_cache=True,
        port=port,
        **fields,
    ).install()
    get_parallel().override_permanently(
        tp_rank=0, pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_rank=0, dp_rank=0,
        attn_tp_group=SimpleNamespace(cpu_group=None),
    )
    return server_args


class Pair:
    """A prefill and a decode scheduler, and the loop that drives their queues."""

    def __init__(self, prefill: PrefillScheduler, decode: DecodeScheduler, bootstrap_port: int) -> None:
        self.prefill = prefill
        self.decode = decode
        self.bootstrap_port = bootstrap_port
        self.bootstrapped: list[Req] = []
        self.prefilled: list[Req] = []
        self.received: list[Req] = []

    def request(self, rid: str, room: int, ids: Sequence[int], priority: int | None = None) -> tuple[Req, Req]:
        """The same request as the router hands it to both engines (``priority``: SGLang's
        request priority); queued on both."""

        def req() -> Req:
            return Req(
                rid, "", array("q", ids), SamplingParams(max_new_tokens=4),
                bootstrap_host="127.0.0.1", bootstrap_port=self.bootstrap_port, bootstrap_room=room, priority=priority,
            )

        preq, dreq = req(), req()
        self.prefill.disagg_prefill_bootstrap_queue.add(preq, HEADS)
        self.decode.disagg_decode_prealloc_queue.add(dreq)
        return preq, dreq

    def step(self) -> None:
        """One scheduler iteration of each engine (the queue calls of SGLang's event loops)."""
        self.bootstrapped += self.prefill.disagg_prefill_bootstrap_queue.pop_bootstrapped()
        preallocated, _failed = self.decode.disagg_decode_prealloc_queue.pop_preallocated()
        self.decode.disagg_decode_transfer_queue.extend(preallocated)
        self.prefilled += self.prefill.process_disagg_prefill_inflight_queue()
        self.received += self.decode.disagg_decode_transfer_queue.pop_transferred()

    def decode_stage(self, req: Req) -> str | None:
        """Where the decode engine holds ``req``: ``"pending"`` (its prefill's DP rank not yet
        resolved), ``"prealloc"``, ``"transfer"``, or ``None`` once it left them all. The queues
        hold SGLang's ``DecodeRequest`` wrappers, so a plain ``req in queue`` is never true."""
        prealloc = self.decode.disagg_decode_prealloc_queue
        for stage, queue in (
            ("pending", prealloc.pending_reqs),
            ("prealloc", prealloc.queue),
            ("transfer", self.decode.disagg_decode_transfer_queue.queue),
        ):
            if any(decode_req.req is req for decode_req in queue):
                return stage
        return None

    def run_until(self, done: Callable[[], bool], timeout_seconds: float = 30.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout_seconds
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"not done in {timeout_seconds} s: {what}")
            self.step()
            time.sleep(0.01)

    def prefill_only(self, req: Req, first_token: int) -> None:
        """The prefill's forward pass; the request waits on the inflight queue."""
        prefill_forward(self.prefill, req, first_token)
        self.prefill.disagg_prefill_inflight_queue.append(req)

    def prefill_and_send(self, req: Req, first_token: int, chunk_ends: Sequence[int] = ()) -> None:
        """The prefill's forward pass, then SGLang's sends: a chunk per entry of
        ``chunk_ends`` (chunked prefill), then the last chunk."""
        self.prefill_only(req, first_token)
        for end in chunk_ends:
            self.prefill.send_kv_chunk(req, last_chunk=False, end_idx=end)
        self.prefill.send_kv_chunk(req, last_chunk=True)

    def decode_kv(self, req: Req) -> torch.Tensor:
        """The KV the decode holds for ``req``'s prompt, shaped like :func:`kv_pattern`."""
        n = len(req.origin_input_ids)
        slots = self.decode.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
        return kv_of(self.decode.token_to_kv_pool, slots)

"""The negative control's connector: kvbroker's, but it overwrites the prefill's KV blocks with
noise just before they are sent. If the decode's tokens still matched, the KV would not be in use."""

from __future__ import annotations

from typing import Any

import torch

from kvbroker.adapters.vllm import KVBrokerConnector, KVBrokerMetadata


class CorruptingKVBrokerConnector(KVBrokerConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBrokerMetadata) and self._worker is not None
        memory = self._worker._memory
        assert memory is not None
        generator = torch.Generator().manual_seed(1234)
        for send in meta.sends:
            for tensor in memory.kv.values():
                for block in send.block_ids:
                    noise = torch.randn(tensor[block].shape, generator=generator).to(tensor.dtype)
                    tensor[block].copy_(noise)
        super().start_load_kv(forward_context, **kwargs)

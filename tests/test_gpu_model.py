"""The timing-faithful fake GPU (``kvbroker.testing.gpu_model``): the model, and the device path on it.

The model says when copies and writes finish; the broker's GPU lanes wait
for it through their real copy and waiter threads. The last tests run whole
rooms through two in-process brokers on a modelled GPU whose every job and
write takes tens of milliseconds (far above this machine's scheduling
noise), and read the model's timelines: parts in flight must overlap.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvbroker.broker.dataplane import DataPlane, Workers
from kvbroker.broker.device import ArrayViews, Extent, Lanes, Work
from kvbroker.client import EngineMemory, RankSpec
from kvbroker.testing import FakeBroker
from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
from kvbroker.testing.fake_nixl import FakeAgent
from kvbroker.testing.gpu_model import (
    MODELS,
    WRITE_TAG,
    GpuModel,
    Interval,
    ModelledStreams,
    ModelSetting,
    Timelines,
    WriteClock,
)
from kvbroker.testing.scenario import Scenario, run_scenario
from kvbroker.v1 import common_pb2

VRAM = common_pb2.MEMORY_KIND_VRAM


def test_the_model_times_jobs_and_writes_by_their_bytes_and_knows_its_limit() -> None:
    """A job holds its engine for its launch plus its modelled bytes over its op's rate, a write its
    link likewise; the ideal pipeline is bound by the busiest resource or by one part's cycle over
    the slots, whichever is slower."""
    model = GpuModel(gather_gbps=100, scatter_gbps=50, launch_us=10, write_gbps=200, write_us=5, byte_scale=1000)
    assert model.job_seconds(Work("gather", 1000)) == pytest.approx(10e-6 + 1e6 / 100e9)
    assert model.job_seconds(Work("scatter", 1000)) == pytest.approx(10e-6 + 1e6 / 50e9)
    assert model.write_seconds(1000) == pytest.approx(5e-6 + 1e6 / 200e9)
    part = 1 << 20  # 1 GiB modelled: seconds-long stages, launches negligible
    gbps, bound = model.ideal_gbps(part, slots=8, one_gpu=True)
    assert "engine" in bound and gbps == pytest.approx(part * 1000 / (model.job_seconds(Work("gather", part)) + model.job_seconds(Work("scatter", part))) / 1e9)
    gbps, bound = model.ideal_gbps(part, slots=8, one_gpu=False)
    assert "scatter" in bound and gbps == pytest.approx(50, rel=0.01)
    gbps, bound = model.ideal_gbps(part, slots=1, one_gpu=False)
    assert "cycle" in bound and gbps == pytest.approx(1 / (1 / 100 + 1 / 200 + 1 / 50), rel=0.01)


def test_a_setting_reads_and_writes_its_environment_form() -> None:
    """``KVBROKER_TESTING_GPU_MODEL`` names a preset and overrides, a host and a timelines file;
    anything else is refused naming what is wrong."""
    setting = ModelSetting.parse("h200,byte_scale=1024,launch_us=50,host=1,timelines=/tmp/x")
    assert setting.model == GpuModel(byte_scale=1024, launch_us=50) and setting.host == 1 and setting.timelines == "/tmp/x"
    assert ModelSetting.parse(setting.spec()) == setting
    assert ModelSetting.parse("h200-400g").model == MODELS["h200-400g"]
    for bad, says in (("a100", "no model"), ("h200,speed=3", "no setting"), ("h200,host=99", "host 99"), ("h200,launch_us=x", "launch_us")):
        with pytest.raises(ValueError, match=says):
            ModelSetting.parse(bad)


def test_processes_of_one_modelled_host_take_turns_on_its_engine(tmp_path: Path) -> None:
    """Timelines in a shared file: a job another process launched holds the engine for this one too,
    while the link and the other device's engine stay free; another modelled host has its own."""
    path = str(tmp_path / "timelines")
    mine = Timelines(path)
    take = "import sys; from kvbroker.testing.gpu_model import Timelines; print(Timelines(sys.argv[1]).take('gather', 0, 0, 60.0))"
    theirs = float(subprocess.run([sys.executable, "-c", take, path], capture_output=True, text=True, timeout=60, check=True).stdout)
    before = time.monotonic()
    assert mine.take("scatter", 0, 0, 0.01) == pytest.approx(theirs + 0.01), "after the other process's job"
    assert mine.take("write", 0, 0, 0.01) < theirs, "the link is not the engine"
    assert mine.take("gather", 0, 1, 0.01) < theirs, "another device's engine"
    assert mine.take("gather", 1, 0, 0.01) < before + 0.1, "another host's GPU"
    mine.close()


def test_a_modelled_write_is_not_seen_before_it_could_have_landed() -> None:
    """A write's notification carries when its write ends; the receiving side holds it until then
    and hands it over unmarked; a notification nothing stamped passes at once."""
    timelines = Timelines()
    clock = WriteClock(ModelSetting(GpuModel(write_us=50_000)), timelines)
    due = clock.post(1000, device=0)
    assert due - time.monotonic() == pytest.approx(0.05, abs=0.01)
    receiving = WriteClock(ModelSetting(GpuModel()), Timelines())
    assert receiving.arrived([("peer", clock.stamp(b"notice", due)), ("peer", b"\x00credit")]) == [("peer", b"\x00credit")]
    assert receiving.next_due() == due
    time.sleep(max(0.0, due - time.monotonic()) + 0.005)
    assert receiving.arrived([]) == [("peer", b"notice")]
    assert receiving.next_due() is None


def test_a_lane_on_a_modelled_gpu_finishes_its_job_when_the_model_says() -> None:
    """A job on a modelled GPU's lane is launched from the data-plane thread, its copies run on the
    modelled GPUs' own thread (the launching thread is free at once, as a GPU's is), and its outcome
    comes from the data-plane thread once its engine time is over: jobs on one engine queue behind
    each other."""
    timelines = Timelines(history=True)
    streams = ModelledStreams(ModelSetting(GpuModel(launch_us=40_000)), timelines)
    workers = Workers()
    ran: list[str] = []

    def job(name: str) -> Callable[[], Callable[[], str]]:
        def copies() -> Callable[[], str]:
            ran.append(threading.current_thread().name)
            return lambda: f"{name} read on {threading.current_thread().name}"
        return copies

    async def go() -> tuple[list[str], float]:
        dataplane = DataPlane(FakeAgent("lane-test"), on_events=lambda events: None, take_notice=None, transfer_timeout_seconds=10)
        dataplane.start()
        lanes = Lanes(workers, ArrayViews(device_as_host=True), dataplane, streams)
        try:
            slot = Extent(0, 64, VRAM, 0)
            await lanes.open(0)
            t0 = time.monotonic()
            got = await asyncio.gather(lanes.run(slot, job("a"), work=Work("gather", 64)), lanes.run(slot, job("b"), work=Work("scatter", 64)))
            return got, time.monotonic() - t0
        finally:
            lanes.close()
            await dataplane.stop()

    try:
        got, seconds = asyncio.run(go())
    finally:
        workers.shutdown()
    assert got == ["a read on kvbroker-nixl", "b read on kvbroker-nixl"]
    assert ran == ["kvb-fakegpu_0", "kvb-fakegpu_0"]
    assert seconds >= 0.08, "two jobs of 40 ms on one engine, one after the other"
    assert [i.what for i in timelines.history or []] == ["gather", "scatter"]


# -- the device path on a modelled GPU -------------------------------------------------------------

#: Every job and write takes tens of milliseconds: what the brokers' threads add is small beside it.
SLOW = GpuModel(gather_gbps=1e6, scatter_gbps=1e6, checksum_gbps=1e6, launch_us=30_000, write_gbps=1e6, write_us=30_000)


def _overlapped(history: list[Interval]) -> int:
    """How many parts' writes overlap (by half their length or more) a job or write of another part:
    0 when parts move one at a time."""
    writes = [i for i in history if i.what == "write"]
    others = [i for i in history if i.what in ("gather", "scatter", "write")]
    count = 0
    for w in writes:
        span = w.end - w.start
        if any(o is not w and min(o.end, w.end) - max(o.start, w.start) >= span / 2 for o in others):
            count += 1
    return count


def _vram_rooms(
    fake_brokers: Callable[..., FakeBroker], streams: ModelledStreams, scenario: Scenario, **config: object
) -> tuple[FakeBroker, FakeBroker]:
    fake = FakeCudaLib(devices=2, granularity=4096)
    p = fake_brokers("p", cuda=fake, streams=streams, **config)
    d = fake_brokers("d", cuda=fake, streams=streams, **config)

    def prepare(memory: EngineMemory, spec: RankSpec) -> None:
        as_fake_vram(memory, fake, device=0 if spec.role == "prefill" else 1)

    result = run_scenario(p.address, d.address, scenario, timeout_seconds=60, prepare=prepare)
    assert result.ok, "\n".join(result.problems[:20])
    return p, d


def test_vram_rooms_on_a_modelled_gpu_move_byte_exact_with_their_parts_in_flight_together(fake_brokers) -> None:  # type: ignore[no-untyped-def]
    """Rooms whose KV lies on two modelled GPUs (prefill on one, decode on the other) move byte-exact
    through the lanes and the modelled writes, and the parts of a room overlap: while one part is
    written, another is gathered or scattered. A pipeline that moved one part at a time (a gather
    waiting for the previous part's credit to come back) has no part whose write overlaps anything."""
    timelines = Timelines(history=True)
    streams = ModelledStreams(ModelSetting(SLOW), timelines)
    # Parts of 16 KiB, room for 4 in each transfer buffer: 2 rooms x 2 chunks of 12 pages x 6 KiB
    # (SMALL_MODEL: 3 layers, 2 KiB a page and region) -> about 18 parts.
    _vram_rooms(fake_brokers, streams, Scenario(pages=24, chunks=2, rooms=2), device_part_bytes=16 << 10,
                device_send_bytes=64 << 10, device_receive_bytes=64 << 10)
    history = [i for i in timelines.history or [] if i.what != "write" or i.tag == WRITE_TAG]  # not the probes' writes
    writes = [i for i in history if i.what == "write"]
    assert len(writes) >= 8, history
    assert {i.device for i in history if i.what == "gather"} == {0} and {i.device for i in history if i.what == "scatter"} == {1}
    assert _overlapped(history) >= len(writes) // 2, [(i.what, round(i.start, 3), round(i.end, 3)) for i in history]


def test_the_overlap_measure_sees_parts_that_move_one_at_a_time() -> None:
    """The check above can fail: parts that move one at a time (each gather waiting for the last
    part's scatter, as a pipeline that waits for each credit's return would) overlap nowhere; parts
    whose write goes while the next is gathered do. (A transfer buffer always holds two parts at
    least, so a broker cannot be configured into lock-step: this is the measure itself.)"""

    def parts(step: float, n: int = 6) -> list[Interval]:
        out = []
        for k in range(n):
            t = k * step
            out += [Interval("gather", 0, 0, t, t + 1, 8), Interval("write", 0, 0, t + 1, t + 2, 8, WRITE_TAG),
                    Interval("scatter", 0, 1, t + 2, t + 3, 8)]
        return out

    assert _overlapped(parts(3.0)) == 0, "one part at a time"
    assert _overlapped(parts(1.0)) == 6, "each write beside the next part's gather and the last part's scatter"


def test_once_admitted_a_part_goes_without_the_loop_and_its_span_says_where_it_spent_its_time(fake_brokers, finished_spans) -> None:  # type: ignore[no-untyped-def]
    """In steady state a packed part meets the control loop only where it is admitted (a slot and a
    credit held) and where it settles: its write is posted from the data-plane thread, which saw its
    gather complete; at the receiver that thread reads its notice, checks it against the rank's gate
    and starts its scatter, and the scatter completes, and its credit goes back, there too (0 loop
    turns between: the receiver's loop counts it afterwards). Each part's span carries its hops'
    times, in order, the last when its credit came back to the sender."""
    timelines = Timelines(history=True)
    streams = ModelledStreams(ModelSetting(GpuModel(launch_us=2000, write_us=2000)), timelines)
    _, d = _vram_rooms(fake_brokers, streams, Scenario(pages=24, chunks=2, rooms=3), device_part_bytes=16 << 10,
                device_send_bytes=64 << 10, device_receive_bytes=64 << 10)
    spans = finished_spans.get_finished_spans()
    sent = [s for s in spans if s.name == "kvbroker.transfer" and "kvbroker.t.credit_back" in (s.attributes or {})]
    scattered = [s for s in spans if s.name == "kvbroker.staging.scatter" and (s.attributes or {}).get("kvbroker.credit_id")]
    assert len(sent) >= 12 and len(scattered) >= 12, (len(sent), len(scattered))
    posters = [s.attributes["kvbroker.posted_on"] for s in sent]
    assert posters.count("kvbroker-nixl") >= 0.9 * len(posters), posters
    assert {s.attributes["kvbroker.scattered_on"] for s in scattered} == {"kvbroker-nixl"}
    taken = d.broker.queries.counters.parts_taken_off_loop
    assert taken >= 0.9 * len(scattered), (taken, len(scattered))  # (the first parts may come before the rank's plan)
    order = ["handed_on", "slot", "credit", "gather_start", "gathered", "posted", "done", "credit_back"]
    for s in sent:
        times = [s.attributes[f"kvbroker.t.{hop}"] for hop in order]
        assert times == sorted(times), dict(zip(order, times))

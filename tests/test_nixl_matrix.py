"""The parallel-layout matrix over real NIXL: broker processes on loopback.

CI runs a representative set. The full matrix (prefill and decode tp sizes in
{1, 2, 4, 8} x total KV heads in {1, 2, 4, 8, 32}, MLA, pipeline splits, each
state type, staging on and off) is one command:

    KVBROKER_FULL_MATRIX=1 pytest tests/test_nixl_matrix.py
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from kvbroker.testing import BrokerProcess, scratch_dir
from kvbroker.testing.scenario import STATE_KINDS, Scenario, run_scenario

pytestmark = pytest.mark.nixl

FULL = os.environ.get("KVBROKER_FULL_MATRIX") == "1"

CI_CASES = [
    (Scenario(prefill_tp=2, decode_tp=1), True),
    (Scenario(prefill_tp=2, decode_tp=1), False),
    (Scenario(prefill_tp=1, decode_tp=2), True),
    (Scenario(prefill_tp=1, decode_tp=4, kv_heads=2), True),
    (Scenario(prefill_tp=4, decode_tp=1, kv_heads=2), False),
    (Scenario(prefill_tp=4, decode_tp=4, kv_heads=2), True),
    (Scenario(prefill_tp=2, decode_tp=1, mla=True, head_dim=40), True),
    (Scenario(prefill_tp=1, decode_tp=2, kv_layout="hnd_fused"), True),
    (Scenario(prefill_pp=2, decode_pp=1), True),
    (Scenario(prefill_pp=1, decode_pp=2), True),
    (Scenario(state=("mamba", "swa", "nsa"), prefill_pp=2, decode_pp=1), True),
]


def _full_cases() -> list[tuple[Scenario, bool]]:
    cases = []
    for ps, pd, heads in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8, 32)):
        for staging in (True, False):
            cases.append((Scenario(prefill_tp=ps, decode_tp=pd, kv_heads=heads, layers=2, pages=4, rooms=1), staging))
    for ps, pd in itertools.product((1, 2, 4, 8), repeat=2):
        cases.append((Scenario(prefill_tp=ps, decode_tp=pd, mla=True, head_dim=40, layers=2, pages=4, rooms=1), True))
    for pp_p, pp_d in itertools.product((1, 2, 3), repeat=2):
        cases.append((Scenario(prefill_pp=pp_p, decode_pp=pp_d, layers=6), True))
        cases.append((Scenario(prefill_tp=2, decode_tp=1, prefill_pp=pp_p, decode_pp=pp_d, layers=6), True))
    for kind in STATE_KINDS:
        for pp_p, pp_d in ((1, 1), (2, 1), (1, 2)):
            cases.append((Scenario(state=(kind,), prefill_pp=pp_p, decode_pp=pp_d), True))
        cases.append((Scenario(state=(kind,), prefill_tp=4, decode_tp=2, mla=True, head_dim=40), True))
    return cases


CASES = _full_cases() if FULL else CI_CASES


@pytest.fixture(scope="module")
def broker_pairs() -> Iterator[dict[bool, tuple[BrokerProcess, BrokerProcess]]]:
    """Two brokers with staging and two without."""
    common = ["--finished-room-ttl", "0.2", "--tombstone-ttl", "0.3", "--log-level", "warning", "--staging-mib", "16"]
    with scratch_dir("kvb-matrix-") as workdir:
        on = BrokerProcess.start_many(["p-stage", "d-stage"], workdir, common)
        off = BrokerProcess.start_many(["p-plain", "d-plain"], workdir, [*common, "--no-staging"])
        yield {True: (on[0], on[1]), False: (off[0], off[1])}
        for broker in (*on, *off):
            assert broker.stop() == 0, broker.log_tail()


@pytest.mark.parametrize(
    ("scenario", "staging"),
    CASES,
    ids=[f"{s.label}-{'staging' if st else 'per-token'}" for s, st in CASES],
)
def test_layout_byte_exact_over_nixl(broker_pairs, scenario: Scenario, staging: bool) -> None:
    """Every decode rank holds exactly the reference bytes after moving through two broker processes."""
    p, d = broker_pairs[staging]
    result = run_scenario(p.address, d.address, scenario, timeout_seconds=60)
    assert result.ok, "\n".join(result.problems[:20])
    assert result.bytes > 0

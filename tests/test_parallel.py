"""Every parallel layout byte-exact, through in-process brokers with the fake NIXL agent.

Each case registers every rank of both groups, moves chunked rooms with aux
rows (and state, where the layout allows it) and checks every received byte
against the reference computed from the model's coordinates
(``kvbroker.testing.pattern``). The same scenarios run over real NIXL in
``test_nixl_matrix.py``.
"""

from __future__ import annotations

import pytest

from kvbroker.testing.scenario import Scenario, run_scenario

CASES = [
    Scenario(prefill_tp=2, decode_tp=1),  # Pp > Pd: two head slices into one page
    Scenario(prefill_tp=1, decode_tp=2),  # Pp < Pd: each decode rank takes a slice
    Scenario(prefill_tp=4, decode_tp=2),
    Scenario(prefill_tp=2, decode_tp=8),  # T == Pd: one head per decode rank
    Scenario(prefill_tp=1, decode_tp=4, kv_heads=2),  # GQA, heads replicated on decode
    Scenario(prefill_tp=4, decode_tp=1, kv_heads=2),  # GQA, heads replicated on prefill
    Scenario(prefill_tp=8, decode_tp=2, kv_heads=4),
    Scenario(prefill_tp=2, decode_tp=4, kv_heads=1),  # one KV head: replicated both sides
    Scenario(prefill_tp=4, decode_tp=4, kv_heads=2),  # equal tp, T < tp
    Scenario(prefill_tp=2, decode_tp=1, mla=True, head_dim=40),
    Scenario(prefill_tp=1, decode_tp=4, mla=True, head_dim=40),
    Scenario(prefill_pp=2, decode_pp=1),
    Scenario(prefill_pp=1, decode_pp=2),
    Scenario(prefill_pp=2, decode_pp=2, layers=5),
    Scenario(prefill_tp=2, decode_tp=1, prefill_pp=2, decode_pp=1),
    Scenario(state=("mamba",)),
    Scenario(state=("swa",)),
    Scenario(state=("nsa",)),
    Scenario(state=("mamba", "swa", "nsa"), prefill_pp=2, decode_pp=1),
    Scenario(state=("nsa",), prefill_tp=2, decode_tp=1, mla=True, head_dim=40),
    # vLLM's CPU layout: a head's part of a page is contiguous, one piece per page.
    Scenario(prefill_tp=2, decode_tp=1, kv_layout="hnd_fused"),
    Scenario(prefill_tp=1, decode_tp=2, kv_layout="hnd_fused"),
    Scenario(prefill_tp=1, decode_tp=4, kv_heads=2, kv_layout="hnd_fused"),
    Scenario(prefill_tp=4, decode_tp=2, prefill_pp=2, decode_pp=1, kv_layout="hnd_fused"),
]


@pytest.mark.parametrize("staging", [True, False], ids=["staging", "per-token"])
@pytest.mark.parametrize("scenario", CASES, ids=[c.label for c in CASES])
def test_layout_moves_byte_exact(fake_brokers, scenario: Scenario, staging: bool) -> None:
    """The decode ranks hold exactly the reference bytes of their heads, layers, aux and state."""
    size = 8 << 20 if staging else 0
    p = fake_brokers("p", staging_send_bytes=size, staging_receive_bytes=size)
    d = fake_brokers("d", staging_send_bytes=size, staging_receive_bytes=size)
    result = run_scenario(p.address, d.address, scenario, timeout_seconds=30)
    assert result.ok, "\n".join(result.problems[:20])
    for broker in (p, d):
        broker.evict_now()
        assert not any(broker.tables().values()), broker.tables()
    counters = p.broker.queries.counters
    sliced = scenario.prefill_tp != scenario.decode_tp and not scenario.mla and scenario.kv_heads > min(scenario.prefill_tp, scenario.decode_tp)
    if sliced and scenario.kv_layout == "hnd_fused":
        assert counters.transfers_staged == 0 and counters.transfers_per_token > 0  # one piece per page: no staging
    elif sliced:
        assert (counters.transfers_staged > 0) == staging and (counters.transfers_per_token > 0) != staging
    else:
        assert counters.transfers_staged == counters.transfers_per_token == 0
    assert d.broker.queries.traffic.staging_in_use("receive") == 0 and p.broker.queries.traffic.staging_in_use("send") == 0

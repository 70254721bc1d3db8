"""Spatial domain parallelism through forge's ParallelPlan on 4 CPU ranks (gloo, fp32): domain 2 x
FSDP2 2 trains like one device (forge_domain alone: packages/forge-domain/tests/test_domain.py)."""

from __future__ import annotations

from tests.integration.domain.jobs import train_domain_data


def test_domain_2_by_fsdp2_2_trains_like_one_device(run_on_ranks):
    out = run_on_ranks(4, train_domain_data)[0]
    assert out["stages"] == ["domain", "fsdp2"]
    for i, ((l_ref, g_ref), (l_par, g_par)) in enumerate(zip(out["ref"], out["par"], strict=True)):
        assert abs(l_par - l_ref) / l_ref <= (1e-5 if i == 0 else 1e-4), (i, l_par, l_ref)
        assert abs(g_par - g_ref) / g_ref <= 1e-4, (i, g_par, g_ref)
    assert out["par"][-1][0] < out["par"][0][0]

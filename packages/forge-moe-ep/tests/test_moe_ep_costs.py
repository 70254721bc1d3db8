"""forge-moe-ep's cost terms (forge plan composes them; tests/integration/test_plan.py checks the
composition against measured runs): routed rows, the all-to-alls, the expert-load sums."""

from __future__ import annotations

from dataclasses import replace

from forge_core.costs import CollectiveTally
from forge_moe_ep.config import MOE_PRESETS, MoEModelConfig
from forge_moe_ep.costs import (
    ep_collectives,
    expert_load_collectives,
    moe_slot_activation_bytes,
    routed_rows,
)

M: MoEModelConfig = MOE_PRESETS["debug_moe"]  # 8 experts, top-2, dim 64, expert FFN 64


def test_routed_rows_dropless_and_capacity():
    assert routed_rows(M, 2, 16) == 2 * 16 * 2
    capped = replace(M, moe_dispatch="capacity", capacity_factor=1.25)
    assert routed_rows(capped, 2, 16) == 8 * 2 * 5  # ceil(1.25 * 16 * 2 / 8) = 5 per expert


def test_the_slot_keeps_the_routers_float32_copies_below_fp32():
    tok, rows = 2 * 16, routed_rows(M, 2, 16)

    def expected(e: int) -> int:
        routed = rows * (8 + 2 * 64 * e + 4 * 64 * e)
        return 4 * tok * 8 + 4 * 8 + tok * 2 * 20 + routed + 4 * tok * 1 * 64 * e

    assert moe_slot_activation_bytes(M, 2, 16, 4) == expected(4)
    assert moe_slot_activation_bytes(M, 2, 16, 2) == expected(2) + 4 * 64 * (tok + 8)


def test_all_to_alls_per_layer_pass_and_expert_loads():
    tally = CollectiveTally({"ep": 2, "dp": 4, "dp_cp": 8})
    ep_collectives(tally, M, layer_passes=3, nbytes=1000, ac=1)
    expert_load_collectives(tally, M, moe_layers=2, cp=2)
    rows = {(c.phase, c.kind, c.what): (c.count, c.bytes, c.group) for c in tally.table()}
    assert rows[("forward", "all_to_all", "EP: expert counts")] == (6, 32, "ep")
    assert rows[("forward", "all_to_all", "EP: dispatch+combine (balanced routing)")][0] == 12
    assert rows[("backward", "all_to_all", "EP: their gradients")] == (6, 1000, "ep")
    assert M.moe_bias_update_rate > 0  # the preset updates the router bias from the loads
    assert rows[("step", "all_reduce", "MoE expert loads")] == (2, 32, "dp_cp")

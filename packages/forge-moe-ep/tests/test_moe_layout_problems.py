"""forge_moe_ep.checks.moe_layout_problems: every MoE rule a layout keeps, in the layer."""

from __future__ import annotations

from dataclasses import replace

from forge_core.model_config import ModelConfig
from forge_moe_ep.checks import moe_layout_problems
from forge_moe_ep.config import MOE_PRESETS, MoEModelConfig
from forge_moe_ep.costs import active_params, ffn_slot_activation_bytes

MOE = MOE_PRESETS["debug_moe"]
DENSE = ModelConfig.preset("debug")


def test_a_fitting_layout_has_no_problem():
    assert moe_layout_problems(MOE, ep=4, cp=1) == []
    assert moe_layout_problems(DENSE, ep=1, cp=2) == []


def test_each_rule_speaks_once():
    (no_moe,) = moe_layout_problems(DENSE, ep=2, cp=1)
    assert no_moe.startswith("expert parallelism (parallelism.ep=2) on a model with no")
    (indivisible,) = moe_layout_problems(MOE, ep=3, cp=1)
    assert "does not divide moe.num_experts=8" in indivisible
    capacity = replace(MOE, moe_dispatch="capacity")
    (cp,) = moe_layout_problems(capacity, ep=1, cp=2)
    assert cp.startswith("moe.moe_dispatch='capacity' with parallelism.cp=2")
    # a dense model that names the capacity dispatch has no MoE block to drop tokens in
    dense_capacity = MoEModelConfig.from_dense(DENSE, moe_dispatch="capacity")
    assert moe_layout_problems(dense_capacity, ep=1, cp=2) == []


def test_the_cost_terms_of_a_dense_model_are_the_dense_ones():
    dense = MoEModelConfig.from_dense(DENSE)
    assert active_params(dense) == dense.num_params()
    assert ffn_slot_activation_bytes(dense, 7, 2, 16, 4) == (7, 7)
    # an MoE block keeps its routed rows instead, and a token visits top_k of 8 experts
    slots = ffn_slot_activation_bytes(MOE, 7, 2, 16, 4)
    assert len(slots) == 2 and min(slots) > 7
    idle = (8 - 2) * 3 * MOE.dim * 64 * 2
    assert active_params(MOE) == MOE.num_params() - idle

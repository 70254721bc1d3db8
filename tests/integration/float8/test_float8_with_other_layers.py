"""forge-float8's tests composed with other layers: forge-moe-ep's ``moe_transformer`` as the
model Float8 converts (its report and refusals), forge-tp-plans' tensor parallelism before Float8
(the fp8 all-gather refusals, a parent's input preparation moved to fp8) and forge-fsdp-wrap's AC
(Float8 refused after it). forge_float8 alone: packages/forge-float8/tests/test_float8.py."""

from __future__ import annotations

import pytest
import torch.nn as nn
from float8_markers import needs_torchao
from forge_core import ForgeConfigError, ModelConfig
from forge_float8 import apply_float8, float8_report
from forge_fsdp_wrap import apply_ac
from forge_mesh import build_device_mesh
from forge_moe_ep import moe_transformer
from forge_moe_ep.config import MoEModelConfig
from forge_tp_plans import apply_tensor_parallel

from tests.integration.float8.jobs import parent_input_restyled_to_fp8

pytestmark = needs_torchao


def _tp_refusals() -> list[str]:
    mesh = build_device_mesh({"tp": 2, "data": "none"}, "cpu")
    messages = []
    for kwargs in ({}, {"enable_fsdp_float8_all_gather": False, "tp_float8_all_gather": True}):
        model = moe_transformer(ModelConfig.preset("debug"))
        apply_tensor_parallel(model, mesh)
        with pytest.raises(ForgeConfigError) as err:
            apply_float8(model, **kwargs)
        messages.append(str(err.value))
    return messages


def test_fsdp_fp8_all_gather_with_tp_is_refused_at_the_api(run_on_ranks):
    fsdp, gloo = run_on_ranks(2, _tp_refusals)[0]
    assert "enable_fsdp_float8_all_gather=True with tensor parallelism" in fsdp
    assert "gloo cannot all-gather float8" in gloo


def test_float8_after_ac_is_refused():
    model = moe_transformer(ModelConfig.preset("debug"))
    apply_ac(model, "full")
    with pytest.raises(ForgeConfigError, match=r"cannot apply 'float8' after \['ac'\]"):
        apply_float8(model)


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.odd = nn.Linear(20, 64)
        self.head = nn.Linear(64, 64)


def test_skipped_modules_are_reported_with_their_reason():
    model = moe_transformer(MoEModelConfig.preset("debug_moe"))
    apply_float8(model, enable_fsdp_float8_all_gather=False)
    report = float8_report(model)
    skipped = dict(report.skipped)
    assert "grouped GEMMs" in skipped["layers.0.feed_forward.router.gate"]
    assert "grouped GEMMs" in skipped["layers.1.feed_forward.shared_expert.w2"]
    assert skipped["output"].startswith("output head")
    assert "layers.0.attention.wq" in report.converted
    odd = _Odd()
    apply_float8(odd, enable_fsdp_float8_all_gather=False, filter_fqns=["head"])
    skipped = dict(float8_report(odd).skipped)
    assert "fp8 GEMMs need multiples of 16" in skipped["odd"]
    assert "filter_fqns entry 'head'" in skipped["head"]
    assert float8_report(odd).converted == ("proj",)
    assert "skipped odd: in_features=20" in str(float8_report(odd))


def test_bad_recipe_and_options_are_refused_with_the_fix():
    model = moe_transformer(ModelConfig.preset("debug"))
    with pytest.raises(ForgeConfigError, match=r"recipe='rowwize'.*did you mean 'rowwise'"):
        apply_float8(model, recipe="rowwize")
    with pytest.raises(ForgeConfigError, match=r"needs recipe='tensorwise'"):
        apply_float8(model, recipe="rowwise")  # fp8 all-gather defaults to on
    with pytest.raises(ForgeConfigError, match=r"must be a list of strings"):
        apply_float8(model, filter_fqns="output")


def test_a_parents_input_preparation_moves_to_fp8_without_private_hooks(run_on_ranks):
    """Float8 tensorwise after TP: the parent's ``PrepareModuleInput`` becomes torchao's
    ``PrepareFloat8ModuleInput`` through TP's swappable input stand-in (the children then get an
    already fp8-cast input), the new Float8Linears get Float8 styles, and the run matches the
    plain-style one: the input is replicated, so both cast it with the same scale (measured
    2026-11-24: identical outputs and gradients; the bounds allow for a different summation
    order of the row-parallel all-reduce)."""
    out = run_on_ranks(2, parent_input_restyled_to_fp8)[0]
    assert dict(out["styles"]) == {
        "attention.wq": "Float8ColwiseParallel",
        "attention.wk": "Float8ColwiseParallel",
        "attention.wo": "Float8RowwiseParallel",
        "attention": "PrepareFloat8ModuleInput",
    }
    assert dict(out["plain_styles"]) == {
        "attention.wq": "ColwiseParallel",
        "attention.wk": "ColwiseParallel",
        "attention.wo": "RowwiseParallel",
    }
    # Before Float8 the stand-in hands over a plain DTensor, after it an fp8-cast one (once: the
    # plain preparation no longer runs).
    assert out["seen"] == ["DTensor:hp", "DTensor:fp8"], out["seen"]
    assert out["linears"] == ["Float8Linear"] * 3 and out["is_dtensor"]
    assert out["modules"] == ["", "attention", "attention.wq", "attention.wk", "attention.wo"]
    assert out["out_diff"] <= 1e-3 * out["out_scale"], out
    assert out["grad_diff"] <= 1e-2 * out["grad_scale"], out
    assert "can only be replaced by another one" in out["slot_refusal"]
    assert "torch has no public way to remove a style's hooks" in out["same_object_refusal"]

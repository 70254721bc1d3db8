"""Plan selection (explicit, import path, registry, errors) and validation (the refusals on CPU
ranks and the order contract, composed with forge-fsdp-wrap:
tests/integration/tp_plans/test_plans_with_fsdp2.py)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from forge_core import ForgeConfigError, ModelConfig, Transformer
from forge_mesh import build_device_mesh
from forge_tp_plans import (
    applied_tp_plan,
    apply_tensor_parallel,
    check_transformer_tp,
    describe_tp_plan,
    register_tp_plan,
)
from forge_tp_plans.checks import pipeline_stage_problems
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def _meta(**overrides: object) -> Transformer:
    with torch.device("meta"):
        return Transformer(ModelConfig.preset("debug", **overrides))


def _error(fn, *args, **kwargs) -> str:  # noqa: ANN001
    try:
        fn(*args, **kwargs)
    except ForgeConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"n_heads": 6, "n_kv_heads": 6, "dim": 96},
            "tp=4 does not divide n_heads=6; choose tp in {1, 2}",
        ),
        ({}, "tp=4 does not divide n_kv_heads=2; choose tp in {1, 2}"),
        (
            {"n_kv_heads": 4, "ffn_dim": 130},
            "tp=4 does not divide ffn_dim=130; choose tp in {1, 2}",
        ),
        (
            {"n_kv_heads": 4, "vocab_size": 250},
            "tp=4 does not divide vocab_size=250; choose tp in {1, 2}",
        ),
    ],
)
def test_reference_sizes_are_validated_before_sharding(overrides, message):
    cfg = ModelConfig.preset("debug", **overrides)
    with pytest.raises(ForgeConfigError, match=message.replace("{", r"\{").replace("}", r"\}")):
        check_transformer_tp(cfg, 4)


def test_sequence_length_must_divide_under_sp():
    with pytest.raises(ForgeConfigError, match=r"sequence length 15 is not divisible by tp=2"):
        check_transformer_tp(ModelConfig.preset("debug"), 2, seq_len=15, sequence_parallel=True)
    check_transformer_tp(ModelConfig.preset("debug"), 2, seq_len=15, sequence_parallel=False)


def test_pipeline_stage_refusals_have_one_wording():
    """The config check (with pp), ParallelPlan.parallelize_stages (with pp) and
    apply_tensor_parallel (on a stage module) all say it through this function."""
    assert pipeline_stage_problems(sequence_parallel=None, loss_parallel=False, pp=2) == []
    assert pipeline_stage_problems(sequence_parallel=False, loss_parallel=False) == []
    sp, loss = pipeline_stage_problems(sequence_parallel=True, loss_parallel=True, pp=4)
    assert sp.startswith("tp.sequence_parallel=true with parallelism.pp=4: what passes between")
    assert loss.startswith("tp.loss_parallel=true with parallelism.pp=4: the last pipeline stage")


def _tp1_is_a_logged_no_op(caplog_level: int) -> tuple[list, str]:
    logger = logging.getLogger("forge_tp_plans")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(caplog_level)
    model = _meta()
    apply_tensor_parallel(model, build_device_mesh({}, "cpu"))
    logger.removeHandler(handler)
    return records, describe_tp_plan(model)


def test_tp1_is_a_no_op_with_a_log_line(run_on_ranks):
    records, described = run_on_ranks(2, _tp1_is_a_logged_no_op, logging.INFO)[0]
    assert records == ["tensor parallelism not applied: the mesh has no tp axis of size > 1"]
    assert described == "tensor parallelism not applied"


def _explicit_plans() -> dict[str, object]:
    mesh = build_device_mesh({"tp": 2, "data": "none"}, "cpu")
    out: dict[str, object] = {}
    m = _meta()
    apply_tensor_parallel(
        m,
        mesh,
        plan={
            "layers.*.feed_forward.w1": ColwiseParallel(),
            "layers.*.feed_forward.w3": "colwise",
            "layers.*.feed_forward.w2": RowwiseParallel(),
        },
    )
    out["dict"] = (applied_tp_plan(m).source, sorted(applied_tp_plan(m).styles))
    m = _meta()
    apply_tensor_parallel(
        m, mesh, plan="tp_plan_fixtures:ffn_only_plan", allow_import=("tp_plan_fixtures",)
    )
    out["import_fn"] = applied_tp_plan(m).source
    m = _meta()
    apply_tensor_parallel(m, mesh, plan="tp_plan_fixtures:FFN_ONLY", allow_import=True)
    out["import_dict"] = len(applied_tp_plan(m).styles)
    out["not_allowed"] = _error(
        apply_tensor_parallel, _meta(), mesh, plan="tp_plan_fixtures:FFN_ONLY"
    )
    out["other_prefix"] = _error(
        apply_tensor_parallel,
        _meta(),
        mesh,
        plan="tp_plan_fixtures:FFN_ONLY",
        allow_import=("mypkg",),
    )
    out["missing"] = _error(
        apply_tensor_parallel, _meta(), mesh, plan="tp_plan_nope:X", allow_import=True
    )
    out["bad_path"] = _error(
        apply_tensor_parallel, _meta(), mesh, plan="no_colon_here", allow_import=True
    )
    out["wrong_type"] = _error(
        apply_tensor_parallel,
        _meta(),
        mesh,
        plan="tp_plan_fixtures:NOT_A_PLAN",
        allow_import=True,
    )
    out["no_match"] = _error(
        apply_tensor_parallel, _meta(), mesh, plan={"layers.*.mlp.up": "colwise"}
    )
    out["bad_style"] = _error(apply_tensor_parallel, _meta(), mesh, plan={"norm": 3})
    out["plan_type"] = _error(apply_tensor_parallel, _meta(), mesh, plan=["norm"])
    return out


def test_explicit_and_imported_plans(run_on_ranks):
    out = run_on_ranks(2, _explicit_plans)[0]
    assert out["dict"] == (
        "explicit",
        [f"layers.{i}.feed_forward.w{j}" for i in (0, 1) for j in (1, 2, 3)],
    )
    assert out["import_fn"] == "explicit (imported)" and out["import_dict"] == 6
    assert "importing 'tp_plan_fixtures' runs its code" in out["not_allowed"]
    assert "imports are off by default" in out["other_prefix"]
    assert "importing 'tp_plan_nope' failed: ModuleNotFoundError" in out["missing"]
    assert "must look like 'package.module:NAME'" in out["bad_path"]
    assert "is a list; a plan is a dict of module pattern -> style" in out["wrong_type"]
    assert "plan pattern 'layers.*.mlp.up' matches no module of Transformer" in out["no_match"]
    assert "a style must be a ParallelStyle, a style string or None" in out["bad_style"]
    assert "plan must be a dict or an import path string, got list" in out["plan_type"]


class _TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _TwoLayerChild(_TwoLayer):
    pass


def _registered_plan() -> tuple[str, bool, str]:
    register_tp_plan(_TwoLayer, lambda model, ctx: {"up": "colwise", "down": "rowwise"})
    mesh = build_device_mesh({"tp": 2, "data": "none"}, "cpu")
    torch.manual_seed(0)
    ref, model = _TwoLayerChild(), _TwoLayerChild()
    model.load_state_dict(ref.state_dict())
    apply_tensor_parallel(model, mesh)
    x = torch.randn(3, 8)
    same = torch.allclose(model(x), ref(x), atol=1e-6)
    no_plan = _error(apply_tensor_parallel, nn.Sequential(nn.Linear(4, 4)), mesh)
    return applied_tp_plan(model).source, same, no_plan


def test_registered_plans_apply_to_subclasses_and_no_plan_is_an_error(run_on_ranks):
    source, same, no_plan = run_on_ranks(2, _registered_plan)[0]
    assert source == "registered" and same
    assert "no tensor-parallel plan for Sequential" in no_plan
    assert "register_tp_plan" in no_plan and "_tp_col / _tp_row" in no_plan


def test_register_tp_plan_rejects_non_modules():
    with pytest.raises(ForgeConfigError, match="needs an nn.Module subclass"):
        register_tp_plan(int, lambda m, c: {})

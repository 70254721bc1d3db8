"""forge-tp-plans' tests composed with forge-fsdp-wrap: apply_tensor_parallel's refusals on CPU
ranks, among them TP refused after apply_fsdp2 (the order contract) (forge_tp_plans alone:
packages/forge-tp-plans/tests/test_plans.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
from forge_core import ModelConfig, Transformer
from forge_fsdp_wrap import apply_fsdp2, default_mp_policy
from forge_mesh import build_device_mesh
from forge_tp_plans import apply_tensor_parallel
from test_plans import _error, _meta


def _validation_in_ranks() -> dict[str, str]:
    mesh = build_device_mesh({"tp": 4, "data": "none"}, "cpu")
    mesh2 = build_device_mesh({"tp": 2}, "cpu")  # dp_shard 2 x tp 2: TP takes the tp sub-mesh
    out = {"kv": _error(apply_tensor_parallel, _meta(), mesh)}
    model = Transformer(ModelConfig.preset("debug"))
    model.init_weights(0)
    apply_tensor_parallel(model, mesh2)
    out["seq"] = _error(model, torch.zeros(1, 15, dtype=torch.long))
    fsdp_first = _meta()
    apply_fsdp2(fsdp_first, build_device_mesh({}, "cpu"), default_mp_policy(torch.float32))
    out["order"] = _error(apply_tensor_parallel, fsdp_first, mesh2)
    hf_like = nn.Sequential(nn.Linear(4, 4))
    hf_like._tp_plan = {"0": "colwise"}  # an instance plan, as Hugging Face models carry
    out["basic_sp"] = _error(apply_tensor_parallel, hf_like, mesh2, sequence_parallel=True)
    out["twice"] = _error(apply_tensor_parallel, model, mesh2)
    stage_module = _meta()
    stage_module.output = None  # the pipeline split leaves a stage without the head
    out["stage_sp"] = _error(apply_tensor_parallel, stage_module, mesh2, sequence_parallel=True)
    return out


def test_tp_errors_in_ranks(run_on_ranks):
    out = run_on_ranks(4, _validation_in_ranks)[0]
    assert "tp=4 does not divide n_kv_heads=2" in out["kv"]
    assert "sequence length 15 is not divisible by tp=2" in out["seq"]
    assert "cannot apply 'tp' after ['fsdp2']" in out["order"]
    assert "plan found (Hugging Face or opt-in) is basic TP" in out["basic_sp"]
    assert "stage 'tp' was already applied" in out["twice"]
    assert out["stage_sp"].startswith("tp.sequence_parallel=true on a pipeline stage"), out

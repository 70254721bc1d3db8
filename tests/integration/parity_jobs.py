"""Rank functions shared by several integration test modules that build through forge's
ParallelPlan (module-level so the rank pool can pickle them); the layers' shared helpers are in
tests/parity_jobs.py."""

from __future__ import annotations

import torch
from forge.build import ParallelPlan, build_parallel_model
from forge_core import ModelConfig, Transformer
from forge_core.testing import ParityResult, run_parity
from forge_mesh import build_device_mesh
from torch.distributed.device_mesh import DeviceMesh


def compiled_parity(layout: dict) -> ParityResult:
    """AC full + per-block torch.compile (aot_eager) + FSDP2 (x TP if the layout has tp) vs single device."""
    cfg = ModelConfig.preset("debug")
    mesh = build_device_mesh(layout, "cpu")
    with torch.device("meta"):
        model = Transformer(cfg)
    return compiled_plan_parity(model, cfg, mesh, ac_mode="full", batch_size=4)


def compiled_plan_parity(
    model: torch.nn.Module, cfg: ModelConfig, mesh: DeviceMesh, *, ac_mode: str, batch_size: int
) -> ParityResult:
    """``model`` (on meta) through ParallelPlan with ``ac_mode`` and per-block torch.compile
    (aot_eager), fp32, against ``cfg``'s single-device model: 4 steps of ``batch_size`` x 16."""
    plan = ParallelPlan(
        mesh,
        ac_mode=ac_mode,
        compile_model=True,
        compile_backend="aot_eager",
        param_dtype=torch.float32,
    )
    parallel = plan.parallelize(model, device="cpu", seed=0)
    reference = build_parallel_model(cfg, "cpu", None, param_dtype=torch.float32)
    return run_parity(reference, parallel, mesh=mesh, steps=4, batch_size=batch_size, seq_len=16)

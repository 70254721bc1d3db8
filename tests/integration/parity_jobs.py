"""Rank functions shared by several integration test modules that build through forge's
ParallelPlan (module-level so the rank pool can pickle them); the layers' shared helpers are in
tests/parity_jobs.py."""

from __future__ import annotations

import torch
from forge.build import ParallelPlan, build_parallel_model
from forge_core import ModelConfig, Transformer
from forge_core.testing import ParityResult, run_parity
from forge_mesh import build_device_mesh


def compiled_parity(layout: dict) -> ParityResult:
    """AC full + per-block torch.compile (aot_eager) + FSDP2 (x TP if the layout has tp) vs single device."""
    cfg = ModelConfig.preset("debug")
    mesh = build_device_mesh(layout, "cpu")
    with torch.device("meta"):
        model = Transformer(cfg)
    plan = ParallelPlan(
        mesh,
        ac_mode="full",
        compile_model=True,
        compile_backend="aot_eager",
        param_dtype=torch.float32,
    )
    parallel = plan.parallelize(model, device="cpu", seed=0)
    reference = build_parallel_model(cfg, "cpu", None, param_dtype=torch.float32)
    return run_parity(reference, parallel, mesh=mesh, steps=4, batch_size=4, seq_len=16)

"""Rank functions of the context-parallel tests (module level, so the rank pool can pickle them)."""

from __future__ import annotations

from typing import Any

import torch
from forge.build import ParallelPlan
from forge_core import ModelConfig, Transformer
from forge_core.testing import ParityResult, compare_runs, train_steps
from forge_core.training import synthetic_tokens
from forge_mesh import build_device_mesh
from forge_moe_ep import moe_transformer
from forge_moe_ep.config import MoEModelConfig


def _model(moe: bool, **model: Any) -> tuple[torch.nn.Module, ModelConfig]:
    if moe:
        cfg: ModelConfig = MoEModelConfig.preset("debug_moe", **model)
        with torch.device("meta"):
            return moe_transformer(cfg), cfg
    cfg = ModelConfig.preset("debug", **model)
    with torch.device("meta"):
        return Transformer(cfg), cfg


def cp_parity(
    layout: dict[str, Any],
    *,
    moe: bool = False,
    steps: int = 10,
    batch_size: int = 4,
    seq_len: int = 32,
    model: dict[str, Any] | None = None,
    **plan: Any,
) -> ParityResult:
    """A context-parallel model (``layout`` has cp) against the same model on one device, fp32."""
    parallel_model, cfg = _model(moe, **(model or {}))
    reference_model, _ = _model(moe, **(model or {}))
    experts = getattr(cfg, "num_experts", 0) if moe else 0
    mesh = build_device_mesh(layout, "cpu", num_experts=experts)
    parallel = ParallelPlan(mesh, param_dtype=torch.float32, **plan).parallelize(
        parallel_model, device="cpu", seed=0
    )
    reference = ParallelPlan(None, param_dtype=torch.float32).parallelize(
        reference_model, device="cpu", seed=0
    )
    tokens = synthetic_tokens(0, steps, batch_size, seq_len, cfg.vocab_size)
    return compare_runs(train_steps(reference, tokens), train_steps(parallel, tokens, mesh=mesh))

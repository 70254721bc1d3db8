"""Rank functions shared by several test modules (module-level so the rank pool can pickle them)."""

from __future__ import annotations

import torch
import torch.nn as nn
from forge.build import ParallelPlan, build_parallel_model
from forge_core import ModelConfig, Transformer
from forge_core.testing import ParityResult, run_parity
from forge_mesh import build_device_mesh

#: The sizes of a tiny Hugging Face decoder config (transformers' key names), shared by the
#: tests that build Hugging Face models from configs with random weights.
TINY_HF_DECODER = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


class HFLogits(nn.Module):
    """``tokens -> logits`` for the parity harness (Hugging Face models return an output object)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits


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

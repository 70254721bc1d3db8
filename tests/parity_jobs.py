"""Helpers shared by several test modules: a tiny Hugging Face decoder config and the logits
wrapper for the parity harness (rank functions that build through forge's ParallelPlan:
tests/integration/parity_jobs.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
from forge_core.testing.hf import TINY_HF_DECODER as TINY_HF_DECODER  # re-exported


class HFLogits(nn.Module):
    """``tokens -> logits`` for the parity harness (Hugging Face models return an output object)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits

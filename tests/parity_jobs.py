"""Helpers shared by several test modules: a tiny Hugging Face decoder config and the logits
wrapper for the parity harness (rank functions that build through forge's ParallelPlan:
tests/integration/parity_jobs.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

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

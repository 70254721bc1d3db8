"""Sizes of tiny Hugging Face models for tests that build them from configs with random weights
(no download, no transformers import here): every layer's Hugging Face tests use the same."""

from __future__ import annotations

__all__ = ["TINY_HF_DECODER"]

#: A tiny decoder config's sizes, in transformers' key names.
TINY_HF_DECODER: dict[str, int] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}

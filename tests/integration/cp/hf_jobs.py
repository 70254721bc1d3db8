"""Rank functions of the Hugging Face context-parallel tests (module level, so the rank pool can
pickle them): tiny Llama, Qwen3 and Gemma3 (sliding window) built from configs, random weights."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from forge.build import ParallelPlan
from forge_core.testing import ParityResult, compare_runs, train_steps
from forge_core.testing.hf import TINY_HF_DECODER
from forge_core.training import synthetic_tokens
from forge_mesh import build_device_mesh

from tests.integration.cp.jobs import packed_positions


def build_hf(name: str) -> nn.Module:
    """A tiny Hugging Face decoder of family ``name``, the same weights on every rank."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(TINY_HF_DECODER, head_dim=8)
    configs: dict[str, Any] = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common)),
        # local layers see 6 tokens, global ones every earlier token
        "gemma3_text": lambda: tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(**common, sliding_window=6, sliding_window_pattern=2)
        ),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)),
    }
    model = configs[name]().float()
    model.config.use_cache = False
    return model


def hf_cp_parity(
    name: str,
    layout: dict[str, Any],
    *,
    variant: str = "allgather",
    documents: bool = False,
    steps: int = 6,
) -> ParityResult:
    """A Hugging Face ``name`` model at ``layout`` (with cp) against itself on one device, fp32:
    loss and gradient norm over ``steps`` steps; with ``documents``, both on packed documents
    (transformers masks the single-device run from ``position_ids`` itself)."""
    from forge_cp import CPConfig

    reference = build_hf(name)
    mesh = build_device_mesh(layout, "cpu")
    plan = ParallelPlan(mesh, param_dtype=torch.float32, cp=CPConfig(variant=variant))
    parallel = plan.parallelize(copy.deepcopy(reference))
    tokens = synthetic_tokens(0, steps, 4, 32, TINY_HF_DECODER["vocab_size"])
    positions = packed_positions(steps, 4, 32) if documents else None
    return compare_runs(
        train_steps(reference, tokens, positions=positions),
        train_steps(parallel, tokens, mesh=mesh, positions=positions),
    )


def hf_cp_refusal(name: str) -> str:
    """What a cp=2 plan says of a Hugging Face family forge-cp does not run (2 ranks)."""
    from forge_core import ForgeConfigError

    mesh = build_device_mesh({"cp": 2}, "cpu")
    try:
        ParallelPlan(mesh, param_dtype=torch.float32).parallelize(build_hf(name))
    except ForgeConfigError as e:
        return str(e)
    return "built"

"""Rank functions of the Hugging Face pipeline tests (module level, so the rank pool can pickle
them): tiny Llama, Qwen3 and Qwen3-MoE decoders built from configs on the meta device, random
weights from forge's seeded init, fp32, no download."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from forge.build import ParallelPlan
from forge_core.testing import ParityResult, StepRecord, compare_runs, train_steps
from forge_core.testing.hf import TINY_HF_DECODER
from forge_core.training import synthetic_tokens
from forge_mesh import build_device_mesh
from forge_pp import PPConfig

#: 4 layers: two stages per rank at pp=2 (Interleaved1F1B) still get a layer each.
LAYERS = 4
#: Qwen3-MoE's experts (forge's MoE shards them over ep).
EXPERTS = 4
STEPS = 10


def hf_config(name: str, **extra: Any) -> Any:
    """The tiny config of family ``name`` (``llama``, ``qwen3``, ``qwen3_moe``, ``qwen2``)."""
    import transformers as tf

    common = dict(TINY_HF_DECODER, head_dim=8, num_hidden_layers=LAYERS, use_cache=False)
    common.update(extra)
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common, num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=16
        )
    configs = {"llama": tf.LlamaConfig, "qwen3": tf.Qwen3Config, "qwen2": tf.Qwen2Config}
    return configs[name](**common)


def meta_hf(name: str, **extra: Any) -> nn.Module:
    """A tiny Hugging Face decoder of family ``name`` on the meta device."""
    import transformers as tf

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(hf_config(name, **extra), dtype=torch.float32)
    return model


def _reference(name: str, tokens: torch.Tensor) -> list[StepRecord]:
    model = ParallelPlan(None, param_dtype=torch.float32).parallelize(
        meta_hf(name), device="cpu", seed=0
    )
    return train_steps(model, tokens)


def hf_pipeline_parities(
    cases: list[tuple[str, dict[str, Any], dict[str, Any]]], steps: int = STEPS
) -> dict[str, ParityResult]:
    """Each case ``(family, layout with pp, [pp] settings)`` against the same model on one
    device: loss and gradient norm, fp32. Rank 0 alone trains each family's reference, once,
    and returns the results (the parallel records are the same on every rank); the other
    ranks return ``{}``."""
    import torch.distributed as dist

    lead = dist.get_rank() == 0
    references: dict[str, list[StepRecord]] = {}
    results = {}
    for name, layout, pp in cases:
        tokens = synthetic_tokens(0, steps, 8, 16, TINY_HF_DECODER["vocab_size"])
        if lead and name not in references:
            references[name] = _reference(name, tokens)
        experts = EXPERTS if name == "qwen3_moe" else 0
        mesh = build_device_mesh(layout, "cpu", num_experts=experts)
        plan = ParallelPlan(mesh, param_dtype=torch.float32, pp=PPConfig(**pp))
        parallel = plan.parallelize(meta_hf(name), device="cpu", seed=0)
        records = train_steps(parallel, tokens, mesh=mesh)
        if lead:
            key = f"{name} {layout} {pp.get('schedule', '1F1B')}"
            results[key] = compare_runs(references[name], records)
    return results


def hf_rank_facts(name: str) -> dict[str, Any]:
    """What one rank of pp=2 (1F1B) holds of a Hugging Face model: parameter names, layers."""
    mesh = build_device_mesh({"pp": 2, "data": "none"}, "cpu")
    plan = ParallelPlan(mesh, param_dtype=torch.float32, pp=PPConfig(schedule="1F1B"))
    model: Any = plan.parallelize(meta_hf(name), device="cpu", seed=0)
    return {
        "names": sorted(model.state_dict()),
        "layers": sorted(model.model.layers.keys()),
        "class": type(model).__name__,
    }


def hf_pipeline_refusals() -> dict[str, str]:
    """What the split says of Hugging Face models it does not cut (2 ranks, pp=2)."""
    from forge_core import ForgeConfigError

    mesh = build_device_mesh({"pp": 2, "data": "none"}, "cpu")
    models = {
        "family": lambda: meta_hf("qwen2"),
        "tied": lambda: meta_hf("llama", tie_word_embeddings=True),
        "window": lambda: meta_hf(
            "qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=2
        ),
    }

    def base_model() -> nn.Module:  # LlamaModel: no lm_head, its layers at .layers
        import transformers as tf

        with torch.device("meta"):
            return tf.AutoModel.from_config(hf_config("llama"))

    def flex() -> nn.Module:
        model: Any = meta_hf("llama")
        model.set_attn_implementation("flex_attention")
        return model

    models |= {"structure": base_model, "attention": flex}
    said = {}
    for what, build in models.items():
        try:
            ParallelPlan(mesh, param_dtype=torch.float32, pp=PPConfig(schedule="1F1B")).parallelize(
                build(), device="cpu", seed=0
            )
            said[what] = "built"
        except ForgeConfigError as e:
            said[what] = str(e)
    return said


def save_hf_dir(root: Path, name: str = "llama", **extra: Any) -> str:
    """A tiny Hugging Face model directory (config.json only: trained from the seed)."""
    hf_config(name, **extra).save_pretrained(root)
    return str(root)

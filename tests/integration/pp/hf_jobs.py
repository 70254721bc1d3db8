"""Rank functions of the Hugging Face pipeline tests (module level, so the rank pool can pickle
them): tiny Llama, Qwen3 and Qwen3-MoE decoders built from configs on the meta device, random
weights from forge's seeded init or read from a directory that transformers' ``save_pretrained``
wrote (its own random init), fp32, no download."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
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
#: Two pipeline ranks, no data parallelism.
PP2 = {"pp": 2, "data": "none"}


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


def _from_pretrained(directory: str) -> nn.Module:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def _pretrained_reference(name: str, directory: str, tokens: torch.Tensor) -> list[StepRecord]:
    """``directory`` loaded on one device: by forge (``weights=``), or for Qwen3-MoE by
    transformers (its files hold the experts one by one, which forge reads into converted
    blocks only, at tp or ep > 1)."""
    plan = ParallelPlan(None, param_dtype=torch.float32)
    if name == "qwen3_moe":
        model = plan.parallelize(_from_pretrained(directory))
    else:
        model = plan.parallelize(meta_hf(name), device="cpu", seed=0, weights=directory)
    return train_steps(model, tokens)


def hf_first_loss(directory: str, tokens: torch.Tensor) -> float:
    """transformers' own model, ``from_pretrained(directory)``: the loss of the first batch."""
    model = _from_pretrained(directory)
    batch = tokens[0]
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def _tokens(steps: int) -> torch.Tensor:
    return synthetic_tokens(0, steps, 8, 16, TINY_HF_DECODER["vocab_size"])


def hf_pipeline_parities(
    cases: list[tuple[Any, ...]], steps: int = STEPS
) -> dict[str, ParityResult]:
    """Each case ``(family, layout with pp, [pp] settings[, weights directory])`` against the
    same model on one device: loss and gradient norm, fp32. Rank 0 alone trains each reference
    (family and weights; every rank for one forge loads from a directory), once, and returns the
    results (the parallel records are the same on
    every rank); the other ranks return ``{}``."""
    import torch.distributed as dist

    lead = dist.get_rank() == 0
    references: dict[tuple[str, str | None], list[StepRecord]] = {}
    results = {}
    for name, layout, pp, *weights in cases:
        directory = weights[0] if weights else None
        tokens = _tokens(steps)
        # NOTE: forge's one-device load is a collective over the default group (each rank
        # loads its own reference); transformers' (Qwen3-MoE's reference) is not
        collective = directory is not None and name != "qwen3_moe"
        if (lead or collective) and (name, directory) not in references:
            references[name, directory] = (
                _reference(name, tokens)
                if directory is None
                else _pretrained_reference(name, directory, tokens)
            )
        experts = EXPERTS if name == "qwen3_moe" else 0
        mesh = build_device_mesh(layout, "cpu", num_experts=experts)
        plan = ParallelPlan(mesh, param_dtype=torch.float32, pp=PPConfig(**pp))
        parallel = plan.parallelize(meta_hf(name), device="cpu", seed=0, weights=directory)
        records = train_steps(parallel, tokens, mesh=mesh)
        if lead:
            loaded = " pretrained" if directory else ""
            key = f"{name}{loaded} {layout} {pp.get('schedule', '1F1B')}"
            results[key] = compare_runs(references[name, directory], records)
    return results


def hf_pretrained_pipeline(directory: str, broken: dict[str, str]) -> dict[str, Any]:
    """Llama's weights ``directory`` read into pp=2 (1F1B) stages against one device (rank 0:
    ``parity``, and transformers' own first loss ``hf_loss``), then what each rank says of the
    ``broken`` directories (what -> directory) it is given instead."""
    import torch.distributed as dist
    from forge_core import ForgeConfigError

    out: dict[str, Any] = {}
    parity = hf_pipeline_parities([("llama", PP2, {"schedule": "1F1B"}, directory)])
    if dist.get_rank() == 0:
        (out["parity"],) = parity.values()
        out["hf_loss"] = hf_first_loss(directory, _tokens(1))
    mesh = build_device_mesh(PP2, "cpu")
    for what, bad in broken.items():
        plan = ParallelPlan(mesh, param_dtype=torch.float32, pp=PPConfig(schedule="1F1B"))
        try:
            plan.parallelize(meta_hf("llama"), device="cpu", seed=0, weights=bad)
            out[what] = "loaded"
        except ForgeConfigError as e:
            out[what] = str(e)
    return out


def train_runs(cfgs: list[dict[str, Any]]) -> list[dict[int, tuple[float, float]]]:
    """``forge train`` once per config, in turn on the same ranks: each run's steps (loss,
    gradient norm) by step, from every rank."""
    from forge.train import run_train

    runs = []
    for cfg in cfgs:
        summary = run_train(cfg, "cpu")
        runs.append({s.step: (s.loss, s.grad_norm) for s in summary.steps})
    return runs


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


def save_hf_weights(root: Path, name: str = "llama", seed: int = 7) -> str:
    """A tiny Hugging Face model directory with weights: transformers' own random init (seeded;
    not forge's seed-0 init, so a model left at forge's init cannot pass), fp32, written by
    ``save_pretrained``."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32)
    model.save_pretrained(root)
    return str(root)


def edited_hf_dir(source: str, root: Path, *, add: str = "", drop: str = "") -> str:
    """A copy of the Hugging Face directory ``source`` whose weights gain a tensor named ``add``
    (one no model of that config has) or lose the one named ``drop``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, root)
    tensors = load_file(str(root / "model.safetensors"))
    if add:
        tensors[add] = torch.zeros(2)
    tensors.pop(drop, None)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return str(root)

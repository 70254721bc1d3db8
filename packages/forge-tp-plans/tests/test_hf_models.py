"""Hugging Face models (tiny configs, random weights, nothing downloaded) under their own _tp_plan:
logits and every gradient match the unsharded model under TP=2 (under FSDP2 x TP, composed with
forge-fsdp-wrap: tests/integration/tp_plans/test_hf_models_with_fsdp2.py)."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from forge_core.testing.hf import TINY_HF_DECODER
from forge_mesh import build_device_mesh
from forge_tp_plans import applied_tp_plan, apply_tensor_parallel, tp_gradient_mismatches
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

#: What this module's rank functions import inside the function: the rank workers' forkserver
#: imports it once (forge_core.testing.pytest_ranks).
RANK_PRELOAD = [
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.gemma.modeling_gemma",
]

# NOTE: the Hugging Face lane (marker zoo, with tests/zoo), not the README suite (its time).
pytestmark = pytest.mark.zoo

COMMON = TINY_HF_DECODER


def _with_plan_entry(model: nn.Module, extra: dict[str, str]) -> nn.Module:
    model._tp_plan = {**(model._tp_plan or {}), **extra}  # the instance's plan, as HF reads it
    return model


def _build(name: str) -> nn.Module:
    import transformers as tf

    configs = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=None)),
        "gemma": lambda: tf.GemmaForCausalLM(
            tf.GemmaConfig(**COMMON, head_dim=8)
        ),  # ties embeddings
        # q_norm / k_norm: replicated_with_grad_allreduce
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=8)),
        "gemma3_text": lambda: tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=4)
        ),
        # no plan of their own: forge_tp_plans.hf_families
        "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(**COMMON)),
        # xIELU activation with learned scalars on the split MLP hidden layer
        "apertus": lambda: tf.ApertusForCausalLM(tf.ApertusConfig(**COMMON, head_dim=8)),
        "gptj": lambda: tf.GPTJForCausalLM(
            tf.GPTJConfig(
                vocab_size=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64
            )
        ),
        # a plan pattern that matches no module (MLA plans list q_proj and q_b_proj, a config
        # has one of them): skipped, as transformers does
        "llama_extra_pattern": lambda: _with_plan_entry(
            tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)),
            {"model.layers.*.self_attn.q_b_proj": "colwise"},
        ),
    }
    torch.manual_seed(0)
    return configs[name]().float()


def _hf_logits_and_grads(
    name: str, layout: dict, shard: Callable[[nn.Module, DeviceMesh], None] | None = None
) -> dict:
    """``shard``: a data-parallel wrap applied after TP (FSDP2 in
    tests/integration/tp_plans/test_hf_models_with_fsdp2.py)."""
    reference = _build(name)
    parallel = copy.deepcopy(reference)
    mesh = build_device_mesh(layout, "cpu")
    apply_tensor_parallel(parallel, mesh)
    if shard is not None:
        shard(parallel, mesh)
    tokens = torch.randint(
        0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1)
    )
    ref_out = reference(tokens, labels=tokens)
    par_out = parallel(tokens, labels=tokens)
    ref_out.loss.backward()
    par_out.loss.backward()
    par_grads = {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for n, p in parallel.named_parameters()
    }
    torch.testing.assert_close(par_out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
    for n, p in reference.named_parameters():
        torch.testing.assert_close(
            par_grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}"
        )
    # The modules transformers' own plan names (5.23 adds embed_tokens, 5.17 does not).
    hf_plan = [
        re.compile(p.replace(".", r"\.").replace("*", r"\d+") + "$") for p in reference._tp_plan
    ]
    own = sorted(n for n, _ in reference.named_modules() if any(p.match(n) for p in hf_plan))
    tied = reference.get_output_embeddings().weight is reference.get_input_embeddings().weight
    still_tied = parallel.get_output_embeddings().weight is parallel.get_input_embeddings().weight
    return {
        "source": applied_tp_plan(parallel).source,
        "tied": tied,
        "still_tied": still_tied,
        "sharded": sorted(
            n for n, s in applied_tp_plan(parallel).styles.items() if s != "replicated"
        )[:3],
        "hf_plan": own[:3],
        "skipped": list(applied_tp_plan(parallel).skipped),
    }


SKIPPED = {"llama_extra_pattern": ["model.layers.*.self_attn.q_b_proj"]}


@pytest.mark.parametrize(
    "name",
    ["llama", "qwen2", "mistral", "gemma", "qwen3", "gemma3_text", "llama_extra_pattern"],
)
def test_hf_model_tp2_logits_and_grads_match(run_on_ranks, name):
    out = run_on_ranks(2, _hf_logits_and_grads, name, {"tp": 2, "data": "none"})[0]
    assert out["source"] == "huggingface"
    assert out["skipped"] == SKIPPED.get(name, [])
    assert out["tied"] == out["still_tied"]
    assert out["sharded"] == out["hf_plan"] and out["sharded"][0] == "lm_head"


def _qwen3_gradient_mismatches(norm_style: str) -> list[str]:
    """The debug check after one backward of a TP=2 Qwen3 whose q/k norms get ``norm_style``."""
    model = _build("qwen3")
    inner = model.model
    norms = {f"layers.*.self_attn.{n}": norm_style for n in ("q_norm", "k_norm")}
    inner._tp_plan = {**(inner._tp_plan or {}), **norms}
    mesh = build_device_mesh({"tp": 2, "data": "none"}, "cpu")
    apply_tensor_parallel(model, mesh)
    tokens = torch.randint(
        0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1)
    )
    model(tokens, labels=tokens).loss.backward()
    return tp_gradient_mismatches(model, mesh)


def test_the_debug_check_finds_replicated_parameters_with_partial_gradients(run_on_ranks):
    # Qwen3's own plan sums the per-head norms' gradients over tp; a plan that only replicates
    # them (the apertus-style mistake) leaves each rank the gradient of its own heads.
    assert run_on_ranks(2, _qwen3_gradient_mismatches, "replicated_with_grad_allreduce") == [[], []]
    for found in run_on_ranks(2, _qwen3_gradient_mismatches, "replicate"):
        names = sorted(f.split(" ")[0] for f in found)
        assert names == [
            f"model.layers.{i}.self_attn.{n}.weight" for i in (0, 1) for n in ("k_norm", "q_norm")
        ], found


@pytest.mark.parametrize("name", ["stablelm", "gptj"])
def test_hf_families_without_a_plan_use_forges_and_match(run_on_ranks, name):
    out = run_on_ranks(2, _hf_logits_and_grads, name, {"tp": 2, "data": "none"})[0]
    assert out["source"] == "forge (Hugging Face family)"
    assert out["sharded"], out


def _apertus_mismatches(shipped: bool) -> tuple[list[str], str]:
    """The debug check after one backward of a TP=2 Apertus under transformers' plan as shipped
    (its act_fn scalars left replicated) or, ``shipped=False``, forge's choice (corrected)."""
    from forge_tp_plans.plans import _hf_plan

    model = _build("apertus")
    mesh = build_device_mesh({"tp": 2, "data": "none"}, "cpu")
    apply_tensor_parallel(model, mesh, plan=_hf_plan(model) if shipped else None)
    tokens = torch.randint(
        0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1)
    )
    model(tokens, labels=tokens).loss.backward()
    return tp_gradient_mismatches(model, mesh), applied_tp_plan(model).source


def test_the_debug_check_catches_transformers_apertus_plan_and_forge_corrects_it(run_on_ranks):
    for found, source in run_on_ranks(2, _apertus_mismatches, True):
        names = sorted({f.split(" ")[0].rsplit(".", 1)[-1] for f in found})
        assert (names, source) == (["alpha_n", "alpha_p"], "explicit"), found
    assert run_on_ranks(2, _apertus_mismatches, False) == [([], "huggingface")] * 2

"""The Hugging Face zoo: the families of the installed transformers that forge should
parallelize, each built tiny and checked against its unsharded copy, in three sections.

Run from the checkout: ``uv run python -m tests.zoo.hf_zoo`` (prints the rows and
writes ``benchmarks/hf_zoo.md``; ``--families llama,qwen3_moe`` runs a few, ``--no-write``
keeps the page). ``tests/zoo/test_hf_zoo.py`` runs the same checks in CI.

Which families (:func:`enumerate_families`):

- **dense** (:attr:`Enumeration.zoo`): every ``model_type`` of transformers'
  ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config class has a non-empty
  ``base_model_tp_plan``, or whose causal-LM class is a key of forge's
  ``forge_tp_plans.hf_families.FAMILY_PLANS``, and that is not MoE;
- **MoE** (:attr:`Enumeration.moe_zoo`, :func:`moe_reason`): every causal-LM family that is
  MoE, plan or not (expert parallelism needs none), and the MoE base models of the next rule
  (:attr:`Enumeration.base_moe`);
- **base** (:attr:`Enumeration.base`): every ``model_type`` of ``MODEL_MAPPING_NAMES`` with a
  plan and no causal-LM class (embedding models, encoders, the text decoders of VLMs) whose
  config has a ``vocab_size`` (takes tokens);

minus composite configs (``sub_configs``: a vision, audio or text sub-config, e.g. ``llama4``,
``phi4_multimodal``; their text decoder is enumerated under its own ``*_text`` model type where
transformers has one) and encoder-decoder configs (``is_encoder_decoder``). Left-out families
that have a plan are listed with the reason (:attr:`Enumeration.excluded`).

How each is checked, on 2 gloo ranks; the tiny config (:func:`tiny_config`: dropout 0, random
weights, seed 0, fp32, nothing downloaded) builds the model:

- dense (:func:`run_families`): a deep copy gets ``apply_tensor_parallel`` over a 1-D tp mesh
  of 2; both run forward and backward on the same fixed tokens (B=2, S=12, ``labels=tokens``,
  ``model.train()``). ``pass``: logits within rtol = atol = 1e-5, every parameter gradient,
  DTensor ones as ``full_tensor()``, within rtol 1e-4 / atol 1e-6;
- base (:func:`run_base_families`): the same on ``last_hidden_state``, the mean of its squares
  as the loss;
- MoE (:func:`run_moe_families`, :func:`check_moe_family`): shrunk further
  (:data:`MOE_TINY_SIZES`), the weights transformers initialises to zero made random, then
  ``forge.build.ParallelPlan(mesh, param_dtype=float32).parallelize`` on ``{dp_shard: 2, ep:
  2}`` (Hugging Face MoE blocks converted to forge's MoE, EP, FSDP2) against the unconverted
  model on one device fed the whole batch: each rank's logits, then ``run_parity`` (loss and
  global gradient norm of 2 AdamW steps). A base MoE model gets a fixed random head.

Outcomes: ``pass``, ``refused: <ForgeConfigError>``, ``crash: <phase>: <exception>`` or
``wrong: <worst errors>`` (numbers differ: never acceptable).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import functools
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
OUT_MD = ROOT / "benchmarks" / "hf_zoo.md"

#: The fixed batch every family runs: B sequences of S tokens, the labels are the tokens.
BATCH, SEQ = 2, 12
TP = 2
#: Logits: ``|par - ref| <= LOGITS_TOL * (1 + |ref|)``; gradients: ``<= GRAD_ATOL + GRAD_RTOL * |ref|``.
LOGITS_TOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6

#: The generic shrinker: each attribute a config has gets this value (aliases of one size are
#: listed together: transformers' ``attribute_map`` maps e.g. ``n_embd`` to ``hidden_size``).
TINY_SIZES: dict[str, int] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "n_embd": 32,
    "d_model": 32,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "n_inner": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "n_positions": 64,
    # multi-head latent attention (MLA: DeepSeek, MiniCPM3, Youtu)
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    # partial rotary embeddings given as a width (GPT-J, CodeGen), not a fraction
    "rotary_dim": 4,
    # linear-attention layers of hybrid models (gated delta net: Qwen3.5, OLMo hybrid)
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}
#: A sliding window shorter than the sequence, so that the sliding-window mask is exercised.
TINY_SLIDING_WINDOW = 8


def _mrope(theta: float, sections: list[int], **extra: Any) -> dict[str, Any]:
    """Default RoPE parameters with multimodal sections (``mrope_section``)."""
    return {"rope_type": "default", "rope_theta": theta, "mrope_section": sections, **extra}


#: Per-family settings where the generic rule is not enough; each says why.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # Gemma3n: its per-layer-input embeddings, AltUp and LAuReL have sizes of their own, and
    # its last num_kv_shared_layers layers reuse earlier layers' KV (15 of 35 by default: more
    # layers than the tiny model has).
    "gemma3n_text": {
        "vocab_size_per_layer_input": 64,
        "hidden_size_per_layer_input": 8,
        "laurel_rank": 8,
        "num_kv_shared_layers": 0,
    },
    # Gemma4: per-layer-input embeddings like Gemma3n.
    "gemma4_text": {"vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 8},
    # Cohere Compass: RoPE is per layer type (a type left out is NoPE), and the default config
    # gives none, which its rotary embedding cannot build (KeyError 'full_attention').
    # Its text RoPE splits the frequencies into multimodal sections ([22, 22, 20] in 5.17,
    # made for head_dim 128): they must add up to head_dim / 2.
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
            }
        }
    },
    # HRM: the layers are stacks of num_layers_per_stack, run H_cycles x L_cycles times.
    "hrm_text": {"num_layers_per_stack": 1, "H_cycles": 1, "L_cycles": 2, "L_bp_cycles": [1]},
    # ---- MoE families (tiny_config(moe=True)) and base models
    # Dots1 leaves its expert counts to the checkpoint (None): one shared expert.
    "dots1": {"n_shared_experts": 1},
    # Dots3: MLA whose sliding-window layers' head_dim must be qk_nope + qk_rope head dims, and
    # per-layer attention sizes (twice the width on most sliding layers): uniform layers here.
    "dots3_note_text": {"head_dim": 8, "per_layer_config": {}},
    # GLM-5-next: MLA without RoPE on its sparse (DSA) attention layers.
    "glm5_next_text": {"qk_rope_head_dim": 0, "head_dim": 0, "qk_nope_head_dim": 8},
    # Flint: mlp_only_layers=[0, 1] would make both tiny layers dense.
    "flint": {"mlp_only_layers": [0]},
    # Nemotron-H: Mamba2 layers of 128 heads x 64 and state 128 by default (the reference
    # scan of transformers 5.17 took 137 s on 2 CPU ranks): a tiny Mamba2.
    "nemotron_h": {
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "ssm_state_size": 16,
        "n_groups": 1,
        "chunk_size": 16,
    },
    # GraniteMoE-hybrid: its Mamba2 layers' heads must divide mamba_expand x hidden_size.
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16},
    # LFM2-MoE: the default config leaves layer_types None, which its layers index: one short
    # convolution layer (dense, num_dense_layers=1), one attention layer (MoE).
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # LongCat-Flash: MLA with head_dim (the RoPE width) and qk_head_dim stored, a dense width
    # of its own, and "zero experts" (identity experts) beside the routed ones.
    "longcat_flash": {"head_dim": 4, "qk_head_dim": 8, "ffn_hidden_size": 64, "zero_expert_num": 2},
    # MuseSpark: its experts run at a width of their own (pre/post expert projections).
    "muse_spark_text": {"moe_hidden_size": 32},
    # Qwen4-exp: its indexed-attention layers' indexer has no default sizes; hyper-connections
    # have a low rank of their own.
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 8,
        "indexer_budget": 4,
        "indexer_compress_ratio": 2,
        "hc_lowrank": 8,
    },
    # ZAYA: top-1 routing only (the config refuses num_experts_per_tok > 1).
    "zaya": {"num_experts_per_tok": 1},
    # Multimodal RoPE (text decoders of VLMs): the sections must add up to half the rotated
    # head width (8 here; GLM-4V-MoE rotates half of it).
    "cosmos3_edge_text": {"rope_parameters": _mrope(1e8, [2, 1, 1])},
    "glm4v_text": {"rope_parameters": _mrope(1e4, [2, 1, 1])},
    "glm4v_moe_text": {"rope_parameters": _mrope(1e4, [1, 1, 0], partial_rotary_factor=0.5)},
    "glm_image_text": {"rope_parameters": _mrope(1e4, [2, 1, 1])},
    "glm_ocr_text": {"rope_parameters": _mrope(1e4, [2, 1, 1])},
    "qwen2_5_vl_text": {"rope_parameters": _mrope(1e6, [2, 1, 1])},
    "qwen2_vl_text": {"rope_parameters": _mrope(1e6, [2, 1, 1])},
    # ESM-C: no grouped-query attention.
    "esmc": {"num_key_value_heads": 4},
    # NeoMME: its full-attention layers' M-RoPE rotates a multiple of 4 dims of head_dim (a
    # quarter of 8 is 2): half.
    "neomme": {
        "rope_parameters": {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 1e6,
                "partial_rotary_factor": 0.5,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    },
}

#: The MoE shrinker (MoE families only, on top of :data:`TINY_SIZES`): 8 routed experts, top-2,
#: expert (and shared-expert) hidden width 16.
MOE_TINY_SIZES: dict[str, int] = {
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_k": 2,
    "moe_topk": 2,
    "moe_intermediate_size": 16,
    "expert_ffn_hidden_size": 16,
    "shared_expert_intermediate_size": 16,
    "shared_experts_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "shared_intermediate_size": 16,
}
#: MoE config counts capped (MoE families only): one leading dense layer at most (so that the
#: tiny model's other layer is sparse), one shared expert.
MOE_AT_MOST: dict[str, int] = {
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
}

#: Config fields that count routed experts (an MoE family has one > 0, or left None for a
#: checkpoint to fill in).
MOE_COUNT_FIELDS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
)
#: Boolean switches some configs have for their MoE blocks (off: the family is dense).
MOE_SWITCHES = ("is_moe", "enable_moe_block")


# ----------------------------------------------------------------------------- enumeration


def moe_reason(config: Any) -> str | None:
    """Why ``config`` describes a mixture-of-experts model (None: dense).

    A switch (``is_moe``, ``enable_moe_block``) decides when the config has one (Doge and
    Gemma4 carry expert counts but are dense unless switched on); otherwise any expert count
    field (``num_experts``, ``num_local_experts``, ``n_routed_experts``, ``moe_num_experts``)
    that is > 0 or None (Dots1 leaves ``n_routed_experts`` to the checkpoint) makes it MoE.
    """
    values = config.to_dict()
    for switch in MOE_SWITCHES:
        if switch in values:
            return f"{switch}={values[switch]}" if values[switch] else None
    for name in MOE_COUNT_FIELDS:
        if name in values:
            value = values[name]
            if value is None or (isinstance(value, int) and value > 0):
                return f"{name}={value}"
    return None


@dataclasses.dataclass(frozen=True)
class Enumeration:
    """What :func:`enumerate_families` found: the three sections of the zoo, and what it left
    out and why.

    ``zoo``: the dense causal LMs with a tp plan, ``(model_type, causal-LM class)``. ``moe``:
    the MoE causal LMs (with a tp plan or not: expert parallelism needs none), ``model_type ->
    the config field that made it MoE``, and ``moe_zoo`` the same as ``(model_type, class)``.
    ``base``: the families with a tp plan and no causal-LM class, dense ones as ``(model_type,
    base-model class)`` (checked on ``last_hidden_state``), MoE ones in ``base_moe`` (checked
    like ``moe_zoo``, through a fixed head). ``excluded``: families with a plan left out, why.
    """

    zoo: list[tuple[str, str]]
    moe: dict[str, str]
    excluded: dict[str, str]
    moe_zoo: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    base: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    base_moe: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def _classify(model_type: str, planned: bool, excluded: dict[str, str]) -> tuple[Any, str | None]:
    """``(default config, MoE reason)`` of a family, or ``(None, None)`` when it is left out:
    recorded in ``excluded`` if it has a plan (composite, default config fails, seq2seq)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config_class = CONFIG_MAPPING[model_type]
    except Exception as e:  # noqa: BLE001 - a config transformers cannot import here
        if planned:
            excluded[model_type] = f"config not importable: {type(e).__name__}"
        return None, None
    if getattr(config_class, "sub_configs", None):
        if planned:
            excluded[model_type] = (
                f"composite config (sub-configs {sorted(config_class.sub_configs)}): not a text "
                "decoder"
            )
        return None, None
    try:
        config = config_class()
    except Exception as e:  # noqa: BLE001
        if planned:
            excluded[model_type] = f"default config fails: {type(e).__name__}: {_first_line(e)}"
        return None, None
    if getattr(config, "is_encoder_decoder", False):
        if planned:
            excluded[model_type] = "encoder-decoder (seq2seq)"
        return None, None
    return config, moe_reason(config)


@functools.cache
def enumerate_families() -> Enumeration:
    """Walk transformers' causal-LM mapping, then its base-model mapping for the families with a
    plan and no causal LM; see the module docstring for the rules. (Cached: importing every
    family's config takes seconds.)"""
    from forge_tp_plans.hf_families import FAMILY_PLANS
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    def planned(model_type: str, class_name: str) -> bool:
        try:
            config_class = CONFIG_MAPPING[model_type]  # NOTE: the lazy mapping has no .get
        except Exception:  # noqa: BLE001 - a config transformers cannot import here
            config_class = None
        return bool(getattr(config_class, "base_model_tp_plan", None)) or (
            class_name in FAMILY_PLANS
        )

    zoo: list[tuple[str, str]] = []
    moe: dict[str, str] = {}
    moe_zoo: list[tuple[str, str]] = []
    excluded: dict[str, str] = {}
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if not isinstance(class_name, str):  # a tuple of classes: none in 5.x decoders
            excluded[model_type] = f"several causal-LM classes {class_name}"
            continue
        has_plan = planned(model_type, class_name)
        config, reason = _classify(model_type, has_plan, excluded)
        if config is None:
            continue
        if reason is not None:  # MoE: checked under EP x FSDP2, which needs no tp plan
            moe[model_type] = reason
            moe_zoo.append((model_type, class_name))
        elif has_plan:
            zoo.append((model_type, class_name))
        # else no plan: nothing for TP to check (encoders, seq2seq, most others)
    base: list[tuple[str, str]] = []
    base_moe: list[tuple[str, str]] = []
    for model_type, class_name in MODEL_MAPPING_NAMES.items():
        if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or not isinstance(class_name, str):
            continue
        if not planned(model_type, class_name):
            continue
        config, reason = _classify(model_type, True, excluded)
        if config is None:
            continue
        if getattr(config, "vocab_size", None) is None:
            excluded[model_type] = f"{class_name} takes no tokens (no vocab_size): not a text model"
        elif reason is not None:
            moe[model_type] = reason
            base_moe.append((model_type, class_name))
        else:
            base.append((model_type, class_name))
    return Enumeration(zoo, moe, excluded, moe_zoo, base, base_moe)


def zoo_families() -> list[tuple[str, str]]:
    """``[(model_type, causal-LM class name)]``: the dense text decoders with a tp plan (their
    own or forge's) in the installed transformers, in the mapping's order."""
    return enumerate_families().zoo


# ----------------------------------------------------------------------------- tiny configs


def _layer_indices(type_lists: Sequence[Sequence[str] | None], n_layers: int) -> list[int]:
    """Which of the default model's layers the tiny one keeps: the first layer of each distinct
    type of each per-layer list (``layer_types``: sliding / full / linear attention ...;
    ``mlp_layer_types``: dense / sparse), then the next ones, ``n_layers`` or more in all."""
    lists = [list(t) for t in type_lists if t]
    if not lists:
        return list(range(n_layers))
    chosen: set[int] = set()
    for kinds in lists:
        first: dict[str, int] = {}
        for i, kind in enumerate(kinds):
            first.setdefault(str(kind), i)
        chosen |= set(first.values())
    rest = [i for i in range(len(lists[0])) if i not in chosen]
    return sorted([*chosen, *rest[: max(0, n_layers - len(chosen))]])


def tiny_config(model_type: str, *, moe: bool = False) -> Any:
    """A tiny config of ``model_type``: transformers' default config with every common size
    attribute it has shrunk (:data:`TINY_SIZES`), dropout 0, no KV cache, token ids inside the
    vocabulary, layer-indexed lists cut to the kept layers (one of each layer type), and
    :data:`FAMILY_OVERRIDES` on top. ``moe``: an MoE family, also shrunk by
    :data:`MOE_TINY_SIZES` (8 experts, top-2, expert width 16), keeping one layer of each MLP
    type (``mlp_layer_types``: dense / sparse) and at most one leading dense layer, no router
    aux loss or jitter."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    values = default.to_dict()
    kwargs: dict[str, Any] = {}

    def has(name: str) -> bool:
        # NOTE: stored fields and their aliases only: a derived property (Falcon's head_dim)
        # cannot be given
        return name in values or name in getattr(default, "attribute_map", {})

    type_lists = [values.get("layer_types")]
    if moe:
        type_lists.append(values.get("mlp_layer_types"))
    keep = _layer_indices(type_lists, TINY_SIZES["num_hidden_layers"])
    if moe:
        kwargs.update(_moe_sizes(values, has))
    for name, size in TINY_SIZES.items():
        if has(name):
            # NOTE: read from to_dict(): Gemma4's config refuses reads of per-layer attributes.
            # Per-layer sizes (Gemma3n's intermediate_size) become per-layer tiny sizes.
            kwargs[name] = [size] * len(keep) if isinstance(values.get(name), list) else size
    if moe and "kv_lora_rank" in values and has("num_key_value_heads"):
        # MLA: one k/v head per query head (the sparse-attention variants need it)
        kwargs["num_key_value_heads"] = TINY_SIZES["num_attention_heads"]
    for layers_key in ("num_hidden_layers", "n_layer", "num_layers"):
        if layers_key in kwargs:
            kwargs[layers_key] = len(keep)
    _cut_per_layer(values, keep, kwargs)
    if "qk_rope_head_dim" in values:
        # MLA: head_dim (the RoPE width) and qk_head_dim are derived from the MLA dims
        kwargs.pop("head_dim", None)
    _quiet(values, has, kwargs)
    kwargs.update(FAMILY_OVERRIDES.get(model_type, {}))
    return AutoConfig.for_model(model_type, **kwargs)


def _cut_per_layer(values: dict[str, Any], keep: list[int], kwargs: dict[str, Any]) -> None:
    """The config's other per-layer entries cut to the ``keep`` layers (into ``kwargs``)."""
    n_default = values.get("num_hidden_layers")
    if isinstance(n_default, int):
        for name, value in values.items():  # the other lists with one entry per layer
            if isinstance(value, list) and len(value) == n_default and name not in kwargs:
                kwargs[name] = [value[i] for i in keep]
    per_layer = values.get("per_layer_config")
    if isinstance(per_layer, dict) and isinstance(values.get("head_dim"), int):
        # Gemma4: some layers' attributes differ (its full-attention layers have 2x wider
        # heads): keep the kept layers' entries, renumbered, sizes scaled like head_dim
        scale = TINY_SIZES["head_dim"] / values["head_dim"]
        kwargs["per_layer_config"] = {
            str(new): {
                k: int(v * scale) if k == "head_dim" else v for k, v in per_layer[key].items()
            }
            for new, old in enumerate(keep)
            for key in per_layer
            if int(key) == old
        }


def _quiet(values: dict[str, Any], has: Callable[[str], bool], kwargs: dict[str, Any]) -> None:
    """Deterministic and small (into ``kwargs``): a tiny sliding window, dropout 0, no KV
    cache, special token ids inside the tiny vocabulary."""
    if values.get("sliding_window") is not None:
        kwargs["sliding_window"] = TINY_SLIDING_WINDOW
    for name, value in values.items():
        if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop")):
            kwargs[name] = 0.0
    if has("use_cache"):
        kwargs["use_cache"] = False
    for name, token in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if values.get(name) is not None:
            kwargs[name] = token


def _moe_sizes(values: dict[str, Any], has: Callable[[str], bool]) -> dict[str, Any]:
    """The MoE part of :func:`tiny_config`'s keyword arguments (see there)."""
    kwargs: dict[str, Any] = {}
    for name, size in MOE_TINY_SIZES.items():
        value = values.get(name)
        # NOTE: a zero width means "no such expert" (GraniteMoE-SWA's shared_intermediate_size)
        if has(name) and not (isinstance(value, int) and value == 0):
            kwargs[name] = size
    for name, most in MOE_AT_MOST.items():
        value = values.get(name)
        if isinstance(value, int) and value > most:
            kwargs[name] = most
    for groups in ("n_group", "num_expert_group"):
        value = values.get(groups)
        if isinstance(value, int) and value > 1:
            # grouped routing: 4 groups of 2 experts, the best 2 groups
            kwargs[groups], kwargs["topk_group"] = 4, 2
    for name in ("router_jitter_noise", "input_jitter_noise"):
        if values.get(name):
            kwargs[name] = 0.0
    if values.get("output_router_logits"):
        kwargs["output_router_logits"] = False
    return kwargs


# ----------------------------------------------------------------------------- one family


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _crash(phase: str, e: BaseException) -> str:
    return f"crash: {phase}: {type(e).__name__}: {_first_line(e)}"


def _model_class(config: Any, class_name: str) -> Any:
    """transformers' class ``class_name``; one its package defines but does not export (5.23's
    ``VoxtralRealtimeTextModel``, which AutoModel cannot find) from the family's modeling module."""
    import importlib

    import transformers

    try:
        return getattr(transformers, class_name)
    except AttributeError:
        module = type(config).__module__.replace(".configuration_", ".modeling_")
        return getattr(importlib.import_module(module), class_name)


def _build(model_type: str, class_name: str, *, moe: bool = False) -> Any:
    """The tiny fp32 model of ``class_name`` (a causal LM or a base model), in train mode."""
    import torch

    config = tiny_config(model_type, moe=moe)
    torch.manual_seed(0)
    model = _model_class(config, class_name)(config).float()
    model.train()
    return model


def _tokens(vocab_size: int) -> Any:
    import torch

    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class Row(NamedTuple):
    """One family's result."""

    family: str  # the model_type
    class_name: str
    outcome: str  # pass / refused: ... / crash: ... / wrong: ...
    seconds: float  # build, both forwards and backwards, the comparison (rank 0)
    plan: str  # what the applied plan did ("" when none was applied)
    split: int  # modules the applied plan split / MoE blocks converted (0: nothing checked)
    blocks: str = ""  # MoE families: the Hugging Face MoE block class(es)


def _plan_summary(model: Any) -> tuple[str, int]:
    """``("<source>: <n> split, <m> grad-allreduce[, skipped ...]", n)`` from the recorded
    applied plan, so that a pass that split nothing is visible."""
    from forge_tp_plans import applied_tp_plan

    applied = applied_tp_plan(model)
    if applied is None:
        return "", 0
    styles = list(applied.styles.values())
    allreduce = sum(s == "ReplicatedWithGradAllReduce" for s in styles)
    split = sum(s not in ("replicated", "ReplicatedWithGradAllReduce") for s in styles)
    text = f"{applied.source}: {split} split, {allreduce} grad-allreduce"
    return text + (f", skipped {', '.join(applied.skipped)}" if applied.skipped else ""), split


def _extra_inputs(model: Any) -> dict[str, Any]:
    """Forward inputs a base model needs besides the tokens, which its outer model would give."""
    import torch

    if type(model).__name__ == "VoxtralRealtimeTextModel":
        # the time conditioning of Voxtral realtime's decoder layers (their ada_rms_norm)
        g = torch.Generator().manual_seed(4)
        return {"t_cond": torch.randn(1, model.config.hidden_size, generator=g)}
    return {}


def _output(model: Any, tokens: Any, base: bool) -> tuple[Any, Any]:
    """``(output, loss)``: a causal LM's logits and its loss on ``labels=tokens``; a base
    model's ``last_hidden_state`` and the mean of its squares."""
    if base:
        out = model(tokens, **_extra_inputs(model))
        # NOTE: a base class that is a whole model (Higgs audio's) answers logits
        hidden = getattr(out, "last_hidden_state", None)
        hidden = out.logits if hidden is None else hidden
        # NOTE: the mean, not the sum, of the squares: gradients of the size a causal LM's
        # mean token loss gives, which the absolute gradient tolerance is made for
        return hidden, (hidden.float() ** 2).mean()
    out = model(tokens, labels=tokens)
    return out.logits, out.loss


def check_family(
    model_type: str, class_name: str, mesh: Any, base: bool = False
) -> tuple[str, str, int]:
    """``(outcome, plan summary, modules split)`` of one family on this rank, over the 1-D tp
    ``mesh`` (every rank of it calls this together, for the same families in the same order).
    ``base``: a base model (no LM head), compared on ``last_hidden_state``."""
    from forge_core.errors import ForgeConfigError
    from forge_tp_plans import apply_tensor_parallel

    phase, plan, split = "build", "", 0
    try:
        reference = _build(model_type, class_name)
        parallel = copy.deepcopy(reference)
        tokens = _tokens(reference.config.vocab_size)
        phase = "reference forward/backward"
        ref_out, ref_loss = _output(reference, tokens, base)
        ref_loss.backward()
        phase = "apply_tensor_parallel"
        try:
            apply_tensor_parallel(parallel, mesh)
        except ForgeConfigError as e:
            return f"refused: {_first_line(e)}", plan, split
        plan, split = _plan_summary(parallel)
        phase = "tp forward"
        par_out, par_loss = _output(parallel, tokens, base)
        phase = "tp backward"
        par_loss.backward()
        phase = "compare"
        outcome = _compare(reference, parallel, ref_out, _full(par_out))
        return outcome, plan, split
    except Exception as e:  # noqa: BLE001 - one family's failure must not stop the others
        return _crash(phase, e), plan, split


def _compare(reference: Any, parallel: Any, ref_logits: Any, par_logits: Any) -> str:
    """``pass``, or ``wrong: ...`` with the output's error and the worst gradient."""
    import torch

    problems: list[str] = []
    if par_logits.shape != ref_logits.shape:
        return f"wrong: output shape {tuple(par_logits.shape)} != {tuple(ref_logits.shape)}"
    logits_err = (par_logits - ref_logits).abs().max().item()
    if not torch.allclose(par_logits, ref_logits, rtol=LOGITS_TOL, atol=LOGITS_TOL):
        problems.append(f"output max err {logits_err:.1e}")
    par_params = dict(parallel.named_parameters())
    worst: tuple[float, str, float] = (0.0, "", 0.0)  # (excess ratio, name, max abs err)
    for name, ref_param in reference.named_parameters():
        # NOTE: every rank walks the same names in the same order: full_tensor() is a collective
        par_grad = par_params[name].grad if name in par_params else None
        par_grad = _full(par_grad) if par_grad is not None else None
        ref_grad = ref_param.grad
        if (ref_grad is None) != (par_grad is None):
            problems.append(f"{name}: gradient {'missing' if par_grad is None else 'extra'}")
            continue
        if ref_grad is None:
            continue
        err = (par_grad - ref_grad).abs()
        ratio = (err / (GRAD_ATOL + GRAD_RTOL * ref_grad.abs())).max().item()
        if ratio > worst[0]:
            worst = (ratio, name, err.max().item())
    if worst[0] > 1.0:
        problems.append(f"worst grad {worst[1]} max err {worst[2]:.1e} ({worst[0]:.0f}x the bound)")
    return "wrong: " + "; ".join(problems) if problems else "pass"


#: Which outcome a family gets when its ranks' outcomes are of different kinds: the worst.
_SEVERITY = ("wrong", "crash", "refused", "pass")


def _agree(outcomes: Sequence[str]) -> str:
    """One outcome from every rank's: rank 0's where all are of the same kind (``wrong`` ones
    differ in their numbers: each rank sees its own partial gradients), else the worst kind
    with every rank's."""
    kinds = {outcome_kind(o) for o in outcomes}
    if len(kinds) == 1:
        return outcomes[0]
    worst = min(kinds, key=lambda k: _SEVERITY.index(k) if k in _SEVERITY else 0)
    listed = "; ".join(f"rank {r}: {o}" for r, o in enumerate(outcomes))
    return f"{worst}: ranks differ: {listed}"


def _quiet_rows(
    families: Sequence[tuple[str, str]],
    check: Callable[[str, str], tuple[str, str, int, str]],
) -> list[Row]:
    """``check(model_type, class_name) -> (outcome, plan, split, blocks)`` for each family in
    turn on every rank (one failure never stops the others), transformers' warnings silenced;
    the same rows on each rank, outcomes agreed over the ranks."""
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # tiny configs make transformers warn (token ids, rope)
    rows = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for model_type, class_name in families:
                start = time.perf_counter()
                outcome, plan, split, blocks = check(model_type, class_name)
                seconds = time.perf_counter() - start
                every: list[Any] = [None] * dist.get_world_size()
                # NOTE: also lines the ranks up before the next family
                dist.all_gather_object(every, outcome)
                rows.append(
                    Row(model_type, class_name, _agree(every), seconds, plan, split, blocks)
                )
    finally:
        hf_logging.set_verbosity(verbosity)
    return rows


def run_families(families: Sequence[tuple[str, str]], base: bool = False) -> list[Row]:
    """On every rank of a 2-rank group: TP=2 parity of each family (``base``: base models,
    compared on ``last_hidden_state``)."""
    from forge_mesh import build_device_mesh

    mesh = build_device_mesh({"tp": TP, "data": "none"}, "cpu")
    return _quiet_rows(families, lambda m, c: (*check_family(m, c, mesh, base), ""))


def run_base_families(families: Sequence[tuple[str, str]]) -> list[Row]:
    """:func:`run_families` for base models (no causal-LM class)."""
    return run_families(families, base=True)


# ----------------------------------------------------------------------------- MoE families

#: MoE families run on ``dp_shard=2 x ep=2`` (2 ranks): the global batch is MOE_BATCH sequences
#: of MOE_SEQ tokens, each rank's data-parallel half of it, MOE_STEPS AdamW steps.
MOE_BATCH, MOE_SEQ, MOE_STEPS = 4, 12, 2
MOE_LAYOUT: dict[str, Any] = {"dp_shard": 2, "ep": 2}


def _randomize_zeros(model: Any) -> None:
    """Random values (N(0, 0.1^2), fixed seed) for every floating parameter or buffer that
    transformers initialises to zero (routers, biases, correction biases) or that is a bias, so
    that routing and biases matter (as ``packages/forge-moe-ep/tests/test_hf_moe.py`` does);
    a hash-routed layer's token -> experts table (DeepSeek-V4's ``tid2eid``, zeros: every token
    to expert 0) gets distinct random experts per token."""
    import torch

    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and ("bias" in name or not t.abs().sum()):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
            elif name.endswith("tid2eid"):  # hash routing: distinct random experts per token
                experts = model.config.get_text_config().num_local_experts
                order = torch.rand(t.shape[0], experts, generator=g).argsort(-1)
                t.copy_(order[:, : t.shape[1]])


def moe_block_classes(model: Any) -> list[str]:
    """The class names of ``model``'s MoE blocks: modules with an ``experts`` submodule or a
    class name ending in ``MoE`` / ``Moe`` (for a converted ``HFMoE``, the class it replaced),
    in first-seen order."""
    import torch.nn as nn
    from forge_moe_ep.hf import HFMoE

    found: dict[str, None] = {}
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, HFMoE):
            found[module.hf_class.__name__] = None
        elif isinstance(getattr(module, "experts", None), nn.Module) or name.endswith(
            ("MoE", "Moe")
        ):
            found[name] = None
    return list(found)


def _logits_module(model: Any, base: bool) -> Any:
    """``tokens -> logits`` around a Hugging Face model for the parity harness (which trains
    ``module(tokens)``): a causal LM's ``logits`` (as ``tests.parity_jobs.HFLogits``), or for a
    base model (no LM head) ``last_hidden_state`` through a fixed random ``[hidden, vocab]``
    head (a buffer, the same on both sides), so that the next-token loss applies."""
    import torch
    import torch.nn as nn

    class Logits(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.model = inner
            if base:
                hidden, vocab = inner.config.hidden_size, inner.config.vocab_size
                g = torch.Generator().manual_seed(3)
                head = torch.randn(hidden, vocab, generator=g) / hidden**0.5
                self.register_buffer("head", head)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            if base:
                return self.model(tokens).last_hidden_state @ self.head
            return self.model(tokens).logits

    return Logits(model)


def check_moe_family(
    model_type: str, class_name: str, mesh: Any, base: bool = False
) -> tuple[str, str, int, str]:
    """``(outcome, summary, blocks converted, MoE block classes)`` of one MoE family on this
    rank of the ``dp_shard x ep`` ``mesh``: ``ParallelPlan(mesh).parallelize`` (conversion to
    forge's MoE, EP, FSDP2) against the unconverted model on one device fed the whole batch:
    logits of this rank's half of the batch, then ``run_parity`` (each step's loss and global
    gradient norm). ``base``: a base model, through a fixed head (:func:`_logits_module`)."""
    import torch
    import torch.distributed as dist
    from forge.build import ParallelPlan
    from forge_core.errors import ForgeConfigError
    from forge_core.testing import run_parity
    from forge_core.training import local_batch, synthetic_tokens
    from forge_moe_ep.hf import HFMoE

    phase, summary, converted, blocks = "build", "", 0, ""
    try:
        reference = _build(model_type, class_name, moe=True)
        _randomize_zeros(reference)
        blocks = ", ".join(moe_block_classes(reference))
        parallel = copy.deepcopy(reference)
        phase = "parallelize"
        try:
            ParallelPlan(mesh, param_dtype=torch.float32).parallelize(parallel)
        except ForgeConfigError as e:
            return f"refused: {_first_line(e)}", summary, converted, blocks
        converted = sum(isinstance(m, HFMoE) for m in parallel.modules())
        summary = f"{converted} MoE blocks converted, experts split over ep"
        ref_model, par_model = _logits_module(reference, base), _logits_module(parallel, base)
        vocab = reference.config.vocab_size
        phase = "forward"
        tokens = synthetic_tokens(0, 1, MOE_BATCH, MOE_SEQ, vocab)[0][:, :-1]
        with torch.no_grad():
            ref_logits = local_batch(ref_model(tokens), mesh)
            par_logits = _full(par_model(local_batch(tokens, mesh)))
        # (the no-grad forward leaves forge's last FSDP2 unit gathered; run_parity reshards it)
        # NOTE: the ranks decide together (max over ranks): one going on alone to the
        # training steps would wait in their collectives
        diff = (par_logits - ref_logits).abs()
        # [max error, max excess over allclose's bound |d| <= tol + tol * |ref|]
        worst = torch.stack([diff.max(), (diff - LOGITS_TOL * (1 + ref_logits.abs())).max()])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if worst[1].item() > 0:
            return f"wrong: logits max err {worst[0].item():.1e}", summary, converted, blocks
        phase = "training steps"
        result = run_parity(
            ref_model,
            par_model,
            mesh=mesh,
            steps=MOE_STEPS,
            batch_size=MOE_BATCH,
            seq_len=MOE_SEQ,
            vocab_size=vocab,
        )
        if not result.passed:
            loss, gnorm = max(result.loss_errors), max(result.grad_norm_errors)
            return (
                f"wrong: loss rel err {loss:.1e}, grad norm rel err {gnorm:.1e}",
                summary,
                converted,
                blocks,
            )
        return "pass", summary, converted, blocks
    except Exception as e:  # noqa: BLE001 - one family's failure must not stop the others
        return _crash(phase, e), summary, converted, blocks


def run_moe_families(families: Sequence[tuple[str, str]], base: bool = False) -> list[Row]:
    """On every rank of a 2-rank group: EP=2 x FSDP2 parity of each MoE family
    (:func:`check_moe_family`; ``base``: base models through a fixed head)."""
    from forge_mesh import build_device_mesh

    mesh = build_device_mesh(MOE_LAYOUT, "cpu", num_experts=MOE_TINY_SIZES["num_experts"])
    return _quiet_rows(families, lambda m, c: check_moe_family(m, c, mesh, base))


def run_base_moe_families(families: Sequence[tuple[str, str]]) -> list[Row]:
    """:func:`run_moe_families` for base MoE models (no causal-LM class)."""
    return run_moe_families(families, base=True)


_DSV3 = "DeepseekV3MoE's entry"
_GLM4 = "Glm4MoeMoE's entry"

#: What reading transformers 5.23's modeling code says of each MoE block class forge does not
#: convert (not in ``forge_moe_ep.hf.HF_MOE_BLOCKS``), for whoever adds them: "same code as X"
#: (block, router and experts equal X's up to names) or how it differs. "checked": the zoo's
#: EP x FSDP2 check passes with the entry named (tried by adding it to HF_MOE_BLOCKS in-process).
MOE_LAYOUT_NOTES: dict[str, str] = {
    "BailingHybridMoE": f"same code as DeepSeek-V3: {_DSV3} (checked)",
    "Dots1MoE": f"same code as DeepSeek-V3: {_DSV3} (checked)",
    "KimiLinearMoE": f"same code as DeepSeek-V3: {_DSV3} (checked)",
    "ExaoneMoeSparseMoEBlock": f"same code as DeepSeek-V3 (other config names): {_DSV3} (checked)",
    "MiMoV2FlashMoE": f"DeepSeek-V3 without shared experts: {_DSV3} with shared=None (checked)",
    "DeepseekV32MoE": f"same code as GLM4-MoE: {_GLM4} (checked)",
    "Glm4MoeLiteMoE": f"same code as GLM4-MoE: {_GLM4} (checked)",
    "GlmMoeDsaMoE": f"same code as GLM4-MoE: {_GLM4} (checked)",
    "SolarOpenMoE": f"same code as GLM4-MoE: {_GLM4} (checked)",
    "Glm4vMoeTextMoE": f"same code as GLM4-MoE: {_GLM4} (checked)",
    "Dots3NoteTextMoE": (
        f"GLM4-MoE's code (shared experts' width from another config field): {_GLM4} (checked)"
    ),
    "FlexOlmoSparseMoeBlock": "same code as OLMoE: OlmoeSparseMoeBlock's entry (checked)",
    "MiniMaxSparseMoeBlock": "same code as Mixtral: MixtralSparseMoeBlock's entry (checked)",
    "MellumSparseMoeBlock": "same code as Qwen3-MoE: Qwen3MoeSparseMoeBlock's entry (checked)",
    "Qwen3NextSparseMoeBlock": "same code as Qwen2-MoE: Qwen2MoeSparseMoeBlock's entry (checked)",
    "Qwen4ExpTextSparseMoeBlock": (
        "same code as Qwen2-MoE: Qwen2MoeSparseMoeBlock's entry (checked)"
    ),
    "Qwen3_5MoeSparseMoeBlock": (
        "Qwen2-MoE, but the router always renormalises (it has no norm_topk_prob): "
        "Qwen2MoeSparseMoeBlock's entry with renormalize=True (checked)"
    ),
    "Qwen3VLMoeTextSparseMoeBlock": (
        "Qwen3-MoE, but the router always renormalises (it has no norm_topk_prob): "
        "Qwen3MoeSparseMoeBlock's entry with renormalize=True (checked)"
    ),
    **dict.fromkeys(
        ("GraniteMoeMoE", "GraniteMoeSWAMoE", "GraniteMoeHybridMoE", "GraniteMoeSharedMoE"),
        "Mixtral's routing (softmax of the top-k logits) and experts, router at .router: "
        "_Family('router', 'out_in', 'softmax', renormalize=True) (checked)",
    ),
    "JambaSparseMoeBlock": (
        "Mixtral's experts, router at .router, softmax top-k not renormalised: "
        "_Family('router', 'out_in', 'softmax', renormalize=False) (checked)"
    ),
    "FlintSparseMoeBlock": (
        "sigmoid top-k with no groups, bias or scale, renormalised as norm_topk_prob says, an "
        "ungated shared expert: _Family('gate', 'out_in', 'sigmoid', shared='shared_expert') "
        "(checked)"
    ),
    "Mistral4MoE": (
        "DeepSeek-V3's block and experts with softmax scores (groups scored by their top-2 sum, "
        f"no correction bias): {_DSV3} with score='softmax' (checked, grouped and not)"
    ),
    "MistralLarge4TextMoE": (
        "Mistral-4's, always renormalised: DeepseekV3MoE's entry with score='softmax', "
        "renormalize=True (checked, grouped and not)"
    ),
    "InklingMoE": (
        "shared experts take part in the routing normalisation (log-sigmoid over routed + "
        "shared, a learned global_scale): not forge's router"
    ),
    **dict.fromkeys(
        ("JetMoeAttention", "JetMoeMoE"),
        "a mixture of attention heads (MoA) and an MLP MoE of ParallelExperts (input_linear / "
        "output_linear): another structure",
    ),
    "LongcatFlashMoE": (
        "zero-computation (identity) experts beside the routed ones: not supported"
    ),
    "PhimoeSparseMoeBlock": (
        "SparseMixer routing, which samples its experts at random in training: no "
        "converted layer can take transformers' training steps"
    ),
    "ZayaSparseMoeBlock": (
        "an MLP router carrying state across layers and a skip class: not forge's router"
    ),
}

#: The refusal of a model whose MoE blocks forge does not convert (the beginning of it).
UNCONVERTED = (
    "refused: expert parallelism (parallelism.ep=2) on a model with no forge_moe_ep.MoE layer"
)


# ----------------------------------------------------------------------------- the whole zoo

#: ``run(fn, *args, timeout=...)`` runs ``fn`` on every rank of a 2-rank pool and returns the
#: per-rank results (``RankPool(2).run``, or the tests' ``run_on_ranks`` with 2 bound).
Runner = Callable[..., list[Any]]


def run_zoo(
    run: Runner,
    families: Sequence[tuple[str, str]],
    *,
    chunk: int = 8,
    timeout: float = 120.0,
    rank_fn: Callable[[Sequence[tuple[str, str]]], list[Row]] = run_families,
) -> list[Row]:
    """Check ``families`` with ``rank_fn`` (:func:`run_families` by default;
    :func:`run_base_families`, :func:`run_moe_families`, :func:`run_base_moe_families`),
    ``chunk`` of them per call of ``run`` (one call per family would pay a round trip each; one
    call for all would lose them all to one hang). A call that fails as a whole (a rank died or
    hung: the pool restarts) is retried family by family, so that the bad family is reported as
    ``crash: ranks failed: ...`` and the others still run."""
    from forge_core.testing import RankError

    rows: list[Row] = []
    for i in range(0, len(families), chunk):
        part = list(families[i : i + chunk])
        try:
            rows += run(rank_fn, part, timeout=timeout)[0]
            continue
        except RankError as e:
            if len(part) == 1:
                rows.append(
                    Row(*part[0], f"crash: ranks failed: {_rank_error_line(e)}", 0.0, "", 0)
                )
                continue
        for family in part:
            try:
                rows += run(rank_fn, [family], timeout=timeout)[0]
            except RankError as e:
                rows.append(Row(*family, f"crash: ranks failed: {_rank_error_line(e)}", 0.0, "", 0))
    return rows


def _rank_error_line(e: BaseException) -> str:
    """The first failing rank's exception line and the pool's reason (a RankError's message:
    a header line, then each failing rank's traceback, then the reason if a rank hung)."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    own = [ln for ln in lines[1:] if not ln.startswith((" ", "---", "Traceback"))]
    if not own:
        return lines[0] if lines else type(e).__name__
    return own[0] if len(own) == 1 else f"{own[0]} ({own[-1]})"


def outcome_kind(outcome: str) -> str:
    """``pass`` / ``refused`` / ``crash`` / ``wrong``."""
    return outcome.split(":", 1)[0]


def counts(rows: Sequence[Row]) -> dict[str, int]:
    """How many rows of each outcome kind (all four always present)."""
    out = dict.fromkeys(("pass", "refused", "crash", "wrong"), 0)
    for row in rows:
        out[outcome_kind(row.outcome)] = out.get(outcome_kind(row.outcome), 0) + 1
    return out


#: The zoo's sections, in order: dense causal LMs at TP=2, MoE models (causal LMs, then base
#: models through a fixed head) under EP=2 x FSDP2, dense base models at TP=2.
SECTIONS = ("dense", "moe", "base")


def section_jobs(
    enumeration: Enumeration,
) -> dict[str, list[tuple[list[tuple[str, str]], Callable[..., list[Row]]]]]:
    """``{section: [(families, rank function)]}`` for :func:`run_sections`."""
    return {
        "dense": [(enumeration.zoo, run_families)],
        "moe": [
            (enumeration.moe_zoo, run_moe_families),
            (enumeration.base_moe, run_base_moe_families),
        ],
        "base": [(enumeration.base, run_base_families)],
    }


def run_sections(
    run: Runner,
    enumeration: Enumeration,
    *,
    wanted: set[str] | None = None,
    chunk: int = 8,
    timeout: float = 120.0,
) -> dict[str, list[Row]]:
    """Every section's rows (:data:`SECTIONS`; ``wanted``: only these model types), each
    family checked by its section's rank function through :func:`run_zoo`."""
    out: dict[str, list[Row]] = {}
    for section, jobs in section_jobs(enumeration).items():
        rows: list[Row] = []
        for families, rank_fn in jobs:
            part = [f for f in families if wanted is None or f[0] in wanted]
            rows += run_zoo(run, part, chunk=chunk, timeout=timeout, rank_fn=rank_fn)
        out[section] = rows
    return out


def converts(row: Row) -> bool:
    """Whether forge converts every MoE block class of an MoE family's row (its
    ``forge_moe_ep.hf.HF_MOE_BLOCKS`` has them all)."""
    from forge_moe_ep.hf import HF_MOE_BLOCKS

    blocks = [b for b in row.blocks.split(", ") if b]
    return bool(blocks) and all(b in HF_MOE_BLOCKS for b in blocks)


# ----------------------------------------------------------------------------- report


def _cells(*cells: str) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _table(rows: Sequence[Row]) -> list[str]:
    lines = ["| family | class | outcome | plan applied | s |", "|---|---|---|---|---:|"]
    for row in rows:
        lines.append(
            _cells(row.family, row.class_name, row.outcome, row.plan or "-", f"{row.seconds:.1f}")
        )
    return lines


def _short(outcome: str) -> str:
    """The MoE table's outcome: the common refusal of unconverted blocks cut to its gist."""
    return (
        "refused: no forge MoE layer (block not converted)"
        if outcome.startswith(UNCONVERTED)
        else outcome
    )


def _moe_tables(rows: Sequence[Row]) -> list[str]:
    """The MoE section's table, then the unconverted block classes with their families and
    :data:`MOE_LAYOUT_NOTES`."""
    lines = ["| family | class | MoE block | outcome | s |", "|---|---|---|---|---:|"]
    for row in rows:
        lines.append(
            _cells(
                row.family,
                row.class_name,
                row.blocks or "-",
                _short(row.outcome),
                f"{row.seconds:.1f}",
            )
        )
    unconverted: dict[str, list[str]] = {}
    for row in rows:
        if not converts(row):
            for block in row.blocks.split(", "):
                unconverted.setdefault(block or "(none found)", []).append(row.family)
    lines += [
        "",
        f"### MoE block classes forge does not convert ({len(unconverted)})",
        "",
        "From reading transformers' modeling code (`MOE_LAYOUT_NOTES` in `tests/zoo/hf_zoo.py`): "
        "*same code as X* means block, router and experts equal X's up to names, so X's "
        "`HF_MOE_BLOCKS` entry converts it; *checked* means this page's check passes with the "
        "entry named (added in-process, not in forge).",
        "",
        "| block class | families | layout |",
        "|---|---|---|",
    ]
    for block, families in sorted(unconverted.items()):
        lines.append(_cells(block, ", ".join(families), MOE_LAYOUT_NOTES.get(block, "-")))
    return lines


def write_markdown(
    sections: dict[str, list[Row]],
    enumeration: Enumeration,
    wall_s: float,
    load_start: tuple[float, ...],
    load_end: tuple[float, ...],
    path: Path = OUT_MD,
) -> None:
    """``benchmarks/hf_zoo.md``: machine, versions, counts, each section's table, what was
    left out."""
    import torch
    import transformers

    uname = subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip()
    load = ["/".join(f"{x:.1f}" for x in avg) for avg in (load_start, load_end)]
    total = sum(len(rows) for rows in sections.values())
    count_rows = [
        _cells(name, str(len(rows)), *(str(v) for v in counts(rows).values()))
        for name, rows in sections.items()
    ]
    lines = [
        "# The Hugging Face zoo: dense decoders and base models at TP=2, MoE models under "
        "EP=2 x FSDP2",
        "",
        "Written by `uv run python -m tests.zoo.hf_zoo`; rerun it to refresh this page. "
        "CI runs the same checks as `tests/zoo` (marker `zoo`).",
        "",
        "## Machine",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: `{uname}`",
        f"- cpu cores (nproc): {os.cpu_count()}",
        f"- python: {platform.python_version()}",
        f"- torch: {torch.__version__}",
        f"- transformers: {transformers.__version__}",
        f"- load average at start / end (1/5/15 min): {load[0]} / {load[1]}",
        f"- wall time: {wall_s:.1f} s for {total} families on 2 gloo CPU ranks, one thread "
        "each (enumeration, pool start and imports included)",
        "",
        "## Question",
        "",
        "Does forge parallelize each Hugging Face family of the installed transformers that it "
        "should, with the same numbers as the unsharded model? Every family is built tiny from "
        "its config (`tiny_config`: random weights, fp32, dropout 0, nothing downloaded).",
        "",
        "- **dense**: decoder families with a tensor-parallel plan (their `base_model_tp_plan`, "
        "or forge's `FAMILY_PLANS`), through `forge_tp_plans.apply_tensor_parallel` at TP=2: "
        f"forward and backward on B={BATCH}, S={SEQ} fixed tokens with `labels=tokens`; `pass` "
        f"= logits within {LOGITS_TOL:g} and every parameter gradient within rtol {GRAD_RTOL:g} "
        f"/ atol {GRAD_ATOL:g}.",
        "- **MoE**: every mixture-of-experts causal LM (plan or not: expert parallelism needs "
        "none), and the MoE base models with a plan and no causal-LM class (through a fixed "
        "random head), shrunk further (`MOE_TINY_SIZES`: 8 experts, top-2, expert width 16; "
        "weights transformers initialises to zero, such as routers and correction biases, made "
        "random so that routing matters), through `forge.build.ParallelPlan(mesh, "
        "param_dtype=float32).parallelize` on the mesh `{dp_shard: 2, ep: 2}` (Hugging Face MoE "
        "blocks converted to forge's MoE, experts split over ep, FSDP2) against the "
        "unconverted model on one device fed the whole batch: logits of each rank's half of "
        f"B={MOE_BATCH}, S={MOE_SEQ} tokens within {LOGITS_TOL:g}, then {MOE_STEPS} AdamW steps "
        "(`forge_core.testing.run_parity`: each step's loss and global gradient norm within "
        "1e-5 / 1e-4). A family whose blocks forge does not convert is refused (the mesh has an "
        "ep axis and the model no forge MoE layer).",
        "- **base**: families with a plan and no causal-LM class (embedding models, encoders, "
        "VLM text decoders), their base model at TP=2 as for dense, compared on "
        "`last_hidden_state` with the mean of its squares as the loss.",
        "",
        "`refused` = forge raised ForgeConfigError; `crash` = an exception (the phase is "
        "named); `wrong` = the numbers differ. *plan applied*: modules split (column/row), "
        "modules whose replicated parameters get their gradient summed over tp, plan patterns "
        "skipped (matching no module). Why each family that does not pass fails, and the "
        "plan fix each needs: `EXPECTED_REFUSED` in `tests/zoo/test_hf_zoo.py`; for MoE blocks "
        "forge does not convert, the table after the MoE results.",
        "",
        "## Counts",
        "",
        "| section | families | pass | refused | crash | wrong |",
        "|---|---:|---:|---:|---:|---:|",
        *count_rows,
        "",
        "## Dense decoders at TP=2",
        "",
        *_table(sections.get("dense", [])),
        "",
        "## MoE models under EP=2 x FSDP2",
        "",
        *_moe_tables(sections.get("moe", [])),
        "",
        "## Base models at TP=2",
        "",
        *_table(sections.get("base", [])),
        "",
        "## Left out",
        "",
        "Families with a plan that are not text models: "
        + ", ".join(f"{k} ({v})" for k, v in sorted(enumeration.excluded.items()))
        + ".",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> None:
    """Run the zoo on a 2-rank pool, print the rows, write ``benchmarks/hf_zoo.md``."""
    parser = argparse.ArgumentParser(description="The Hugging Face zoo.")
    parser.add_argument("--families", help="comma-separated model types (default: all)")
    parser.add_argument("--chunk", type=int, default=8, help="families per pool call")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    from forge_core.testing import RankPool

    load_start = os.getloadavg()
    start = time.perf_counter()
    enumeration = enumerate_families()
    wanted = set(args.families.split(",")) if args.families else None
    if wanted:
        known = {f for jobs in section_jobs(enumeration).values() for fs, _ in jobs for f, _ in fs}
        if wanted - known:
            print(f"not in the zoo: {sorted(wanted - known)}", file=sys.stderr)
    with RankPool(TP) as pool:
        sections = run_sections(pool.run, enumeration, wanted=wanted, chunk=args.chunk)
    wall = time.perf_counter() - start
    rows = [row for section in sections.values() for row in section]
    width = max((len(r.family) for r in rows), default=6)
    cwidth = max((len(r.class_name) for r in rows), default=5)
    for name, section in sections.items():
        print(f"== {name}: {counts(section)}")
        for row in section:
            head = f"{row.family:<{width}}  {row.class_name:<{cwidth}}  {row.seconds:5.1f}s"
            print(f"{head}  {_short(row.outcome)}")
            detail = row.plan or row.blocks
            if detail:
                print(f"{'':<{len(head)}}  {detail}")
    print(f"{len(rows)} families in {wall:.1f} s")
    if not args.no_write and not args.families:
        write_markdown(sections, enumeration, wall, load_start, os.getloadavg())
        print(f"wrote {OUT_MD.relative_to(ROOT)}")


if __name__ == "__main__":
    # NOTE: run as a script this file is ``__main__``; the rank workers import the functions
    # they run by module name, so hand over to the importable ``tests.zoo.hf_zoo``.
    sys.path.insert(0, str(ROOT))
    from tests.zoo.hf_zoo import main as _main

    _main()

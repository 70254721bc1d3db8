"""A Hugging Face model directory as a forge config's model: ``[model] hf = "DIR"``.

``[model] hf`` names a local directory as ``save_pretrained`` writes it (``config.json``, the
weights as ``model.safetensors`` or shards with ``model.safetensors.index.json``, the tokenizer
files); ``pretrained = false`` starts from random weights of that config instead of loading
them. :func:`hf_section` takes both keys out of ``[model]`` into :class:`HFModelConfig`, and
:func:`decoder_shape` reads ``config.json`` (JSON only: nothing in the directory runs) into the
reference decoder's :class:`~forge_core.ModelConfig`, the shape forge's sizes, costs and data
checks read.

Pure Python (no torch import): the launcher refuses a bad directory before any rank starts
(:func:`hf_dir_problems`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_core.errors import ForgeConfigError, check_field_types
from forge_core.model_config import ModelConfig
from forge_moe_ep.config import MoEConfig

__all__ = [
    "HF_KEYS",
    "HFModelConfig",
    "decoder_shape",
    "exact_heads",
    "hf_compile_problems",
    "has_tokenizer",
    "hf_dir_problems",
    "hf_section",
    "moe_shape",
    "read_hf_config",
]

#: The ``[model]`` keys of a Hugging Face model (every other ``[model]`` key is the reference
#: decoder's, and the directory's config.json decides those).
HF_KEYS = ("hf", "pretrained")

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class HFModelConfig:
    """``[model] hf`` and ``pretrained``: the directory, and whether its weights are loaded
    (False: random weights of its config, drawn from ``training.seed``)."""

    dir: str
    pretrained: bool = True

    def __post_init__(self) -> None:
        check_field_types(self, "model")
        if not self.dir:
            raise ForgeConfigError("model.hf='' must name a Hugging Face model directory")


def hf_section(model: Mapping[str, Any], hf: Mapping[str, Any] | None) -> HFModelConfig | None:
    """The Hugging Face model a config names: ``[model] hf`` (and ``pretrained``), or a dumped
    config's ``hf`` table (what ``asdict`` of a :class:`~forge.config.ForgeConfig` holds);
    None: forge's own model. ``pretrained`` without ``hf`` is refused."""
    if hf is not None:
        if any(k in model for k in HF_KEYS):
            raise ForgeConfigError("the model is named twice: [model] hf and an [hf] table")
        return HFModelConfig(**hf)
    if "hf" not in model:
        if "pretrained" in model:
            raise ForgeConfigError(
                "model.pretrained is set without model.hf: it says whether a Hugging Face "
                "model directory's weights are loaded; set model.hf = DIR or remove it"
            )
        return None
    others = sorted(k for k in model if k not in HF_KEYS)
    if others:
        raise ForgeConfigError(
            f"model.{others[0]} is set with model.hf: a Hugging Face model's shape comes from "
            f"its config.json; remove model.{others[0]} (or model.hf to use forge's model)"
        )
    return HFModelConfig(model["hf"], model.get("pretrained", True))


def read_hf_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of a Hugging Face model directory, as JSON (a ``ForgeConfigError`` line
    when it is missing or not a JSON object)."""
    path = Path(directory) / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ForgeConfigError(
            f"model.hf={str(directory)!r} has no config.json: point model.hf at a directory "
            "written by save_pretrained"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ForgeConfigError(f"model.hf: {path} cannot be read: {e}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ForgeConfigError(f"model.hf: {path} is not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(config, dict):
        raise ForgeConfigError(f"model.hf: {path} holds no JSON object")
    return config


def _rope_theta(config: Mapping[str, Any]) -> float:
    """The rotary base: ``rope_theta``, or ``rope_parameters.rope_theta`` (transformers 5)."""
    theta = config.get("rope_theta")
    rope = config.get("rope_parameters")
    if theta is None and isinstance(rope, Mapping):
        theta = rope.get("rope_theta")
        if theta is None:  # per layer type (Gemma3: full_attention, sliding_attention)
            nested = [v for v in rope.values() if isinstance(v, Mapping)]
            theta = nested[0].get("rope_theta") if nested else None
    return float(theta) if isinstance(theta, int | float) and theta > 1 else 10000.0


def decoder_shape(config: Mapping[str, Any], directory: str) -> ModelConfig:
    """The reference decoder's shape closest to a Hugging Face causal LM's ``config.json``:
    vocabulary, width, depth, heads, FFN width, context, norm eps, rotary base, tied head.

    It is what forge's sizes read (the data's vocabulary check, the throughput's FLOPs, the
    report); the model itself is transformers'. A shape the reference decoder cannot hold
    (a head width other than ``hidden_size / num_attention_heads``) keeps the heads' count and
    is still right for what these read. A config without a decoder's sizes is refused.
    """
    text = config.get("text_config")
    source = text if isinstance(text, Mapping) and "hidden_size" not in config else config
    needed = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in needed if not isinstance(source.get(k), int)]
    if missing:
        raise ForgeConfigError(
            f"model.hf={directory!r}: config.json has no {missing[0]} (model_type "
            f"{config.get('model_type')!r}); forge trains Hugging Face causal language models"
        )
    heads = source["num_attention_heads"]
    kv = source.get("num_key_value_heads") or heads
    dim = source["hidden_size"]
    if not exact_heads(source):
        heads = kv = 1  # NOTE: the sizes stay right; forge plan refuses (exact_heads)
    ffn = source.get("intermediate_size")
    return ModelConfig(
        vocab_size=source["vocab_size"],
        dim=dim,
        n_layers=source["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=ffn if isinstance(ffn, int) and ffn > 0 else None,
        max_seq_len=int(source.get("max_position_embeddings") or 2048),
        norm_eps=float(source.get("rms_norm_eps") or source.get("layer_norm_eps") or 1e-5),
        rope_theta=_rope_theta(source),
        tie_embeddings=bool(config.get("tie_word_embeddings", source.get("tie_word_embeddings"))),
    )


#: The config.json keys of the routed expert count, by family (Qwen, Mixtral and GPT-OSS,
#: DeepSeek).
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def moe_shape(config: Mapping[str, Any]) -> MoEConfig | None:
    """The MoE blocks of a Hugging Face config.json as ``[moe]`` would give them (None: a
    dense model): routed experts, top-k, expert width, shared experts. Like
    :func:`decoder_shape`, what forge's sizes read (expert parallelism's divisibility, the
    plan's costs, the FLOPs); the blocks themselves are transformers' (converted by
    ``forge_moe_ep.hf`` under tp or ep)."""
    text = config.get("text_config")
    source = text if isinstance(text, Mapping) and "hidden_size" not in config else config
    experts = next(
        (source[k] for k in _EXPERT_KEYS if isinstance(source.get(k), int) and source[k] > 0), 0
    )
    if not experts:
        return None
    top_k = source.get("num_experts_per_tok")
    width = source.get("moe_intermediate_size") or source.get("intermediate_size")
    shared = source.get("n_shared_experts")
    return MoEConfig(
        moe_every=1,
        num_experts=experts,
        top_k=top_k if isinstance(top_k, int) and 0 < top_k <= experts else min(2, experts),
        moe_ffn_dim=width if isinstance(width, int) and width > 0 else None,
        num_shared_experts=shared if isinstance(shared, int) and shared > 0 else 0,
    )


def exact_heads(config: Mapping[str, Any]) -> bool:
    """Whether the reference decoder's attention holds these heads exactly: head width
    ``hidden_size / num_attention_heads`` (even, for rotary), key-value heads dividing them."""
    text = config.get("text_config")
    source = text if isinstance(text, Mapping) and "hidden_size" not in config else config
    dim, heads = source.get("hidden_size"), source.get("num_attention_heads")
    kv = source.get("num_key_value_heads") or heads
    if not (isinstance(dim, int) and isinstance(heads, int) and isinstance(kv, int)):
        return False
    if min(dim, heads, kv) <= 0:
        return False
    head_dim = source.get("head_dim") or dim // heads
    return dim % heads == 0 and head_dim == dim // heads and head_dim % 2 == 0 and heads % kv == 0


def hf_dir_problems(hf: HFModelConfig) -> list[str]:
    """What is wrong with the directory before any rank starts: not a directory, no
    ``config.json``, no weights when ``pretrained``; each one line with the fix. The weights
    against the config (names, shapes) are checked on the meta model (forge.checks)."""
    where = Path(hf.dir)
    if not where.is_dir():
        what = "does not exist" if not where.exists() else "is not a directory"
        return [f"model.hf={hf.dir!r} {what}: name a directory written by save_pretrained"]
    try:
        read_hf_config(where)
    except ForgeConfigError as e:
        return [str(e)]
    if hf.pretrained and not any((where / name).is_file() for name in _WEIGHTS):
        return [
            f"model.hf={hf.dir!r} holds no safetensors weights ({' or '.join(_WEIGHTS)}); "
            "save them with save_pretrained(safe_serialization=True), or set "
            "model.pretrained = false to start from random weights"
        ]
    return []


def has_tokenizer(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a tokenizer's files."""
    return any((Path(directory) / name).is_file() for name in _TOKENIZER_FILES)


def hf_compile_problems(hf: bool, tp: int, compile_model: bool) -> list[str]:
    """torch.compile on a Hugging Face model split by TP is refused: measured with torch 2.15,
    per-block compile gives gradients 22 % off the single-device model at step 1 under FSDP2 x
    TP (silently) and fails in backward without FSDP2; whole-model compile fails to trace."""
    if not (hf and tp > 1 and compile_model):
        return []
    return [
        f"torch.compile on a Hugging Face model with tp={tp} gives wrong gradients (measured: "
        "grad norm 22% off one device at step 1) or fails in this torch; set "
        "training.compile=false (compile_model=False), or tp=1 (compile with FSDP2 alone is exact)"
    ]

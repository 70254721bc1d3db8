"""Export the reference Transformer to Hugging Face Llama, and safetensors files.

- :func:`to_hf_llama` / :func:`from_hf_llama` rename a full (unsharded) state dict between forge's
  module names and ``LlamaForCausalLM``'s. Both use rotate-half RoPE, so q/k need no permutation:
  tensors are passed through unchanged (not copied). A tied head maps to a head entry sharing the
  embedding's tensor, as ``state_dict()`` gives on both sides; an HF checkpoint may omit it.
- :func:`hf_llama_config` builds the matching ``transformers.LlamaConfig``; transformers is
  imported there only (it is optional).
- :func:`save_safetensors` / :func:`load_safetensors`: one consolidated file. Entries sharing a
  tensor are stored once; the other names are recorded in the ``forge.aliases`` metadata and
  restored on load as the same tensor (HF ignores it and re-ties its head itself).
- :func:`export_hf_llama`: ``model.safetensors`` + ``config.json`` for ``from_pretrained``.

MoE configs are refused: HF Llama has no MoE block.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from forge_core import ForgeConfigError, ModelConfig
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = [
    "export_hf_llama",
    "from_hf_llama",
    "hf_llama_config",
    "load_safetensors",
    "save_safetensors",
    "to_hf_llama",
]

_ALIASES_KEY = "forge.aliases"
_PACKED = torch.contiguous_format
_EMBED = ("tok_embeddings.weight", "model.embed_tokens.weight")
_HEAD = ("output.weight", "lm_head.weight")
_BLOCK = (  # forge suffix, HF suffix, within block i
    ("attention_norm.weight", "input_layernorm.weight"),
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
)


def _check_dense(config: ModelConfig) -> None:
    if config.custom_ffn_layers:
        raise ForgeConfigError(
            f"model config has MoE blocks {list(config.custom_ffn_layers)} "
            "but Hugging Face Llama has no MoE layer: export a dense model (moe_every=0)"
        )


def _name_table(config: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(forge name, HF name, shape)`` for every entry of a dense model's state dict."""
    # ModelConfig.__post_init__ fills the defaults of the optional sizes
    assert config.ffn_dim is not None and config.n_kv_heads is not None
    d, f, v, kv = config.dim, config.ffn_dim, config.vocab_size, config.n_kv_heads * config.head_dim
    shapes = [(d,), (d, d), (kv, d), (kv, d), (d, d), (d,), (f, d), (f, d), (d, f)]
    table: list[tuple[str, str, tuple[int, ...]]] = [(*_EMBED, (v, d))]
    for i in range(config.n_layers):
        for (ours, theirs), shape in zip(_BLOCK, shapes, strict=True):
            table.append((f"layers.{i}.{ours}", f"model.layers.{i}.{theirs}", shape))
    return [*table, ("norm.weight", "model.norm.weight", (d,)), (*_HEAD, (v, d))]


def _rename(sd: Mapping[str, Tensor], config: ModelConfig, src: int) -> dict[str, Tensor]:
    """Rename ``sd`` from side ``src`` (0 forge, 1 HF) to the other side, checking every key."""
    _check_dense(config)
    dst, side = 1 - src, ("forge", "Hugging Face Llama")[src]
    table = _name_table(config)
    expected = {row[src] for row in table}
    head, embed = _HEAD[src], _EMBED[src]
    # Old HF checkpoints carry the RoPE inverse frequencies; both sides recompute them.
    unexpected = sorted(
        k for k in sd if k not in expected and not k.endswith("rotary_emb.inv_freq")
    )
    missing = sorted(
        k for k in expected if k not in sd and not (k == head and config.tie_embeddings)
    )
    if missing or unexpected:
        raise ForgeConfigError(
            f"{side} state dict does not match the model config: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}; pass the full (unsharded) state dict of a "
            "dense model, built with the same ModelConfig (n_layers, tie_embeddings)"
        )
    out: dict[str, Tensor] = {}
    for *names, shape in table:
        name, new = names[src], names[dst]
        if name == head and config.tie_embeddings:
            a, b = sd.get(name), sd[embed]
            if a is not None and a.data_ptr() != b.data_ptr() and not torch.equal(a, b):
                raise ForgeConfigError(
                    f"config.tie_embeddings=True but {name} differs from {embed}: build the "
                    "config with tie_embeddings=False to keep a separate head"
                )
            out[new] = out[_EMBED[dst]]  # one tensor under both names
            continue
        if tuple(sd[name].shape) != shape:
            raise ForgeConfigError(
                f"{side} tensor {name} has shape {tuple(sd[name].shape)} but the model config "
                f"gives {shape}: export with the ModelConfig the weights were trained with"
            )
        out[new] = sd[name]
    return out


def to_hf_llama(state_dict: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Rename a forge ``Transformer`` state dict (full tensors) to ``LlamaForCausalLM`` names.

    Raises :class:`ForgeConfigError` for an MoE config and for missing, unexpected or
    wrongly-shaped entries. With ``tie_embeddings``, ``lm_head.weight`` shares the embedding.
    """
    return _rename(state_dict, config, src=0)


def from_hf_llama(state_dict: Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Rename a ``LlamaForCausalLM`` state dict to forge ``Transformer`` names (inverse of
    :func:`to_hf_llama`); a tied config accepts a checkpoint without ``lm_head.weight``."""
    return _rename(state_dict, config, src=1)


def hf_llama_config(config: ModelConfig) -> Any:
    """The ``transformers.LlamaConfig`` of the same shape (needs ``transformers``)."""
    _check_dense(config)
    assert config.ffn_dim is not None  # ModelConfig.__post_init__ fills it
    try:
        from transformers import LlamaConfig
    except ImportError as e:
        raise ForgeConfigError(
            "Hugging Face export needs transformers: pip install 'transformers>=4.51'"
        ) from e
    # transformers 5 folds rope_theta into rope_parameters: its typed __init__ lacks the keyword
    # but still accepts it (as transformers 4 does), so it goes in untyped.
    rope: dict[str, Any] = {"rope_theta": config.rope_theta}
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        **rope,
    )


def save_safetensors(
    state_dict: Mapping[str, Tensor],
    path: str | os.PathLike[str],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``state_dict`` to one ``.safetensors`` file (tensors moved to CPU, contiguous).

    Entries that are the same tensor (same storage, offset, shape, stride, dtype) are written
    once and recorded as aliases; other views into shared storage are copied.
    """
    from safetensors.torch import save_file

    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    storages: set[tuple[str, int]] = set()
    for name, t in state_dict.items():
        if not isinstance(t, Tensor) or isinstance(t, DTensor) or t.is_meta:
            raise ForgeConfigError(
                f"{name} is a {type(t).__name__} on {getattr(t, 'device', None)}, not a plain "
                "tensor with data: save a full state dict, e.g. from get_model_state_dict(model, "
                "options=StateDictOptions(full_state_dict=True, cpu_offload=True))"
            )
        t = t.detach()
        ptr = (str(t.device), t.untyped_storage().data_ptr())
        ident = (*ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if ident in seen:
            aliases[name] = seen[ident]
            continue
        seen[ident] = name
        # A contiguous tensor owning its whole storage is written as is; anything else is packed.
        whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        t = t.cpu()
        tensors[name] = t if whole and ptr not in storages else t.clone(memory_format=_PACKED)
        storages.add(ptr)
    meta = {**(metadata or {}), "format": "pt"}
    if aliases:
        meta[_ALIASES_KEY] = json.dumps(aliases)
    save_file(tensors, os.fspath(path), metadata=meta)


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Read a ``.safetensors`` file (on CPU), restoring the aliases :func:`save_safetensors` kept."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        meta = f.metadata() or {}
        out = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    for name, target in json.loads(meta.get(_ALIASES_KEY, "{}")).items():
        out[name] = out[target]
    return out


def export_hf_llama(
    state_dict: Mapping[str, Tensor], config: ModelConfig, out_dir: str | os.PathLike[str]
) -> Path:
    """Write ``out_dir/model.safetensors`` (HF names) and ``out_dir/config.json``, loadable with
    ``transformers.LlamaForCausalLM.from_pretrained(out_dir)``; returns ``out_dir``."""
    hf_state = to_hf_llama(state_dict, config)
    hf_config = hf_llama_config(config)
    # Record the weights' dtype so from_pretrained's default dtype="auto" keeps it (the field is
    # ``dtype`` in transformers 5, ``torch_dtype`` before).
    dtype_field = "dtype" if "dtype" in hf_config.to_dict() else "torch_dtype"
    setattr(hf_config, dtype_field, hf_state[_EMBED[1]].dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(hf_state, out / "model.safetensors")
    hf_config.save_pretrained(out)
    return out

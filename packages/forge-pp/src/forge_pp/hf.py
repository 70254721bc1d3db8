"""Hugging Face causal language models cut into pipeline stages (no transformers import).

A transformers decoder (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``)
holds ``model.embed_tokens``, ``model.layers`` (an ``nn.ModuleList``), ``model.norm``,
``model.rotary_emb`` and ``lm_head``, and its own forward runs them all. :func:`pipeline_hf_model`
makes such a model cuttable the way forge's Transformer is, in place and on the meta device:

- ``model.layers`` becomes an ``nn.ModuleDict`` keyed ``"0" .. "n-1"``: the parameter and
  state-dict names stay exactly the Hugging Face ones (``model.layers.3.self_attn.q_proj.weight``),
  so checkpoints move between pipeline layouts and export to Hugging Face unchanged;
- the object's class becomes a subclass of its own (still an instance of ``LlamaForCausalLM``,
  and of transformers' ``PreTrainedModel``: its ``_tp_plan`` and init rules apply) that declares
  ``forge_pipeline_parts`` (embedding first; final norm and head last) and whose forward is a
  stage's: token ids or hidden states in, hidden states or logits out. Every stage recomputes
  the rotary embedding of its positions (``0 .. S-1``: pipelines carry no packed documents) and
  the causal mask its attention needs: None under SDPA and flash attention (causal by
  themselves), an explicit additive mask under eager attention.

Families whose forward does more than that (embedding scales, soft-capped logits, sliding-window
layers, per-layer rotary tables) are refused by name (:func:`forge_pp.checks.hf_pp_problems`),
as are tied embeddings (the embedding lives on the first stage, the head on the last) and a
structure other than the one above.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from forge_core.errors import refuse

from .checks import hf_pp_problems

__all__ = ["HF_PIPELINE_PARTS", "is_hf_causal_lm", "pipeline_hf_model"]

#: The parts of a Hugging Face decoder as ``forge_pipeline_parts`` names them.
HF_PIPELINE_PARTS: dict[str, Any] = {
    "first": ("model.embed_tokens",),
    "blocks": "model.layers",
    "last": ("model.norm", "lm_head"),
}

#: Attention implementations whose mask forge-pp builds on every stage: None means causal for
#: SDPA and flash attention; eager attention gets an explicit additive mask.
_MASK_FREE = ("sdpa", "flash_attention_2", "flash_attention_3")
_ATTENTION = (*_MASK_FREE, "eager")

#: The pipeline classes made so far, by the Hugging Face class they extend.
_CLASSES: dict[type, type] = {}


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model (its config names a ``model_type``)."""
    return isinstance(getattr(getattr(model, "config", None), "model_type", None), str)


def _config_dict(model: nn.Module) -> dict[str, Any]:
    config: Any = getattr(model, "config", None)
    return dict(config.to_dict())


def _structure_problems(model: nn.Module) -> list[str]:
    """What keeps ``model`` from being cut as a Hugging Face decoder (one line, or none)."""
    name = type(model).__name__
    inner = getattr(model, "model", None)
    missing = [
        path
        for path in ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb")
        if not isinstance(getattr(inner, path.split(".")[1], None), nn.Module)
    ]
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        missing.append("lm_head")
    if missing:
        return [
            f"{name} cannot be cut into pipeline stages: forge-pp cuts a Hugging Face decoder "
            f"made of model.embed_tokens, model.layers, model.norm, model.rotary_emb and lm_head, "
            f"and this one has no {', '.join(missing)}; set parallelism.pp=1"
        ]
    attention = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if attention not in _ATTENTION:
        return [
            f"{name} attends with attn_implementation={attention!r}, whose mask forge-pp does "
            f"not build on a pipeline stage; use one of {list(_ATTENTION)} or set "
            "parallelism.pp=1"
        ]
    return []


def pipeline_hf_model(model: nn.Module, pp: int) -> dict[str, Any]:
    """Make the Hugging Face decoder ``model`` (on meta, unsplit) cuttable into ``pp``-rank
    pipeline stages, in place; returns its ``forge_pipeline_parts``.

    Refused in one line (:class:`ForgeConfigError`), before anything changes: a family forge-pp
    has not checked, tied embeddings, sliding windows, router logits, another structure or
    attention implementation. Calling it again on a converted model changes nothing.
    """
    if isinstance(model, _HFStage):
        return HF_PIPELINE_PARTS
    refuse(hf_pp_problems(_config_dict(model), pp, model=type(model).__name__))
    refuse(_structure_problems(model))
    inner: Any = model.model
    if isinstance(inner.layers, nn.ModuleList):
        inner.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(inner.layers)})
    base = type(model)
    cls = _CLASSES.get(base)
    if cls is None:
        # NOTE: the same name, so that messages and reports name the model's own class (FSDP2
        # swaps classes the same way, prefixing "FSDP").
        cls = type(base.__name__, (_HFStage, base), {"__module__": base.__module__})
        _CLASSES[base] = cls
    model.__class__ = cls
    return HF_PIPELINE_PARTS


def _causal_mask(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """The mask a stage's attention layers take: None (causal by themselves) for SDPA and flash
    attention; an additive ``[1, 1, S, S]`` causal mask for eager attention."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    if attention in _MASK_FREE:
        return None
    seq = hidden.shape[1]
    blocked = torch.ones(seq, seq, dtype=torch.bool, device=hidden.device).triu(1)
    mask = torch.zeros(seq, seq, dtype=hidden.dtype, device=hidden.device)
    return mask.masked_fill(blocked, torch.finfo(hidden.dtype).min)[None, None]


class _HFStage(nn.Module):
    """The forward of a Hugging Face decoder as one pipeline stage (mixed in before the model's
    own class by :func:`pipeline_hf_model`)."""

    forge_pipeline_parts = HF_PIPELINE_PARTS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, S]`` on the first stage, hidden states ``[B, S, D]`` on the others ->
        hidden states, or logits ``[B, S, V]`` on the last stage."""
        inner: Any = self.model
        head: Any = self.lm_head
        hidden = x if inner.embed_tokens is None else inner.embed_tokens(x)
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        rotary = inner.rotary_emb(hidden, positions)
        mask = _causal_mask(self, hidden)
        for layer in inner.layers.values():
            out = layer(
                hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary
            )
            hidden = out[0] if isinstance(out, tuple) else out  # transformers 4.x: a tuple
        if inner.norm is not None:
            hidden = inner.norm(hidden)
        return hidden if head is None else head(hidden)

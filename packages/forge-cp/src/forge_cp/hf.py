"""Hugging Face models at ``cp > 1``, through transformers' public attention interface.

transformers lets a model attend through a function registered by name
(``transformers.AttentionInterface.register`` and ``model.set_attn_implementation``). forge-cp
registers one, ``"forge_cp"``, that hands each attention layer's ``q, k, v`` (after the
model's own projections, norms and rotary embedding) to the context-parallel kernel installed
on that layer (all-gather or heads): exact attention across the sequence shards, with the
layer's softmax scale and sliding window (Gemma3's local layers) and, for packed documents, the
whole row's :class:`forge_core.documents.Documents` (passed as a keyword argument of the
model's forward, which transformers hands down to the attention function).

transformers builds no mask for a name it has no mask function for, so each rank's model never
builds a causal mask over its local tokens (which would be wrong: they are not contiguous);
the kernels mask by the tokens' global places instead. RoPE takes the global positions from
``position_ids``, which forge's training step passes.

Only families whose attention forge checked against one device run this way
(:data:`HF_CP_FAMILIES`); others are refused by name, before launch
(:func:`hf_cp_problems`) and here. transformers is imported only when a function is called.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from forge_core.documents import Documents
from forge_core.errors import ForgeConfigError

from .checks import HF_CP_FAMILIES, hf_cp_problems

__all__ = ["ATTENTION_NAME", "HF_CP_FAMILIES", "hf_attention_modules", "hf_cp_problems"]

#: The name forge-cp registers in transformers' ``AttentionInterface``.
ATTENTION_NAME = "forge_cp"
_KERNEL_ATTR = "_forge_cp_kernel"


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model (its config has a ``model_type``)."""
    return isinstance(getattr(getattr(model, "config", None), "model_type", None), str)


def hf_config_dict(model: nn.Module) -> dict[str, Any]:
    """A transformers model's config as the dict its ``config.json`` holds."""
    config: Any = getattr(model, "config", None)
    return dict(config.to_dict())


def hf_attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of a transformers decoder (classes named ``*Attention`` with
    a ``q_proj``)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention")
        and isinstance(getattr(m, "q_proj", None), nn.Module)
    ]


def install_hf_kernel(model: nn.Module, kernel: Any, cp: int) -> list[nn.Module]:
    """Make ``model`` (a transformers decoder of :data:`HF_CP_FAMILIES`) attend through
    ``kernel`` at every attention layer; returns those layers. Refused in one line: another
    family, dropout or soft-capping in the attention (:func:`hf_cp_problems`)."""
    import transformers

    problems = hf_cp_problems(hf_config_dict(model), cp)
    if problems:
        raise ForgeConfigError(problems[0])
    transformers.AttentionInterface.register(ATTENTION_NAME, _attend)
    model.set_attn_implementation(ATTENTION_NAME)  # type: ignore[operator]
    layers = hf_attention_modules(model)
    for module in layers:
        module.__dict__[_KERNEL_ATTR] = kernel
    return layers


def _attend(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    documents: Documents | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function ``"forge_cp"``: ``query [B, H, s, D]``, ``key, value
    [B, Hkv, s, D]`` of this rank's tokens -> ``([B, s, H, D], None)``. ``attention_mask`` is
    None (no mask function is registered under this name)."""
    kernel = module.__dict__.get(_KERNEL_ATTR)
    if kernel is None:
        raise ForgeConfigError(
            f"{type(module).__name__} uses attn_implementation={ATTENTION_NAME!r} but has no "
            "context-parallel kernel: only forge_cp.apply_context_parallel sets that name"
        )
    if dropout or softcap is not None:
        raise ForgeConfigError(
            "attention dropout and logit soft-capping are not run across cp shards: set "
            "attention_dropout to 0 (or parallelism.cp=1)"
        )
    out = kernel(
        query,
        key,
        value,
        enable_gqa=query.shape[1] != key.shape[1],
        documents=documents,
        window=sliding_window,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None

"""The forge MoE config a Hugging Face MoE block converts to: :func:`moe_config` reads the block,
its router, experts and model config by the block's :data:`~forge_moe_ep.hf_families.HF_MOE_BLOCKS`
entry, and refuses, in one line, what forge's MoE cannot express (:func:`refuse_unsupported`).
Duck-typed: no transformers import.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from forge_core.errors import ForgeConfigError

from .config import MOE_ROUTERS, MoEModelConfig
from .hf_families import _Family, at_path, router_weights

__all__ = ["expert_shape", "experts_of", "moe_config", "refuse_unsupported", "text_config"]

#: Hugging Face ``hidden_act`` names -> ``MoEModelConfig.expert_act``.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu2": "relu2",
}


def text_config(model: nn.Module) -> Any:
    """The model's (text) config: a multimodal model's ``get_text_config()``."""
    config = getattr(model, "config", None)
    if config is None:
        raise ForgeConfigError(f"{type(model).__name__} has no Hugging Face config")
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def refuse_unsupported(config: Any) -> None:
    """Refuse a model config the converted blocks cannot honour (router logits, jitter)."""
    if getattr(config, "output_router_logits", False):
        raise ForgeConfigError(
            "config.output_router_logits=True: transformers would add its router aux loss from "
            "router logits the converted MoE blocks do not produce; set it to False (forge's "
            "balancing: moe_bias_update_rate / moe_aux_loss_coef)"
        )
    jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
    if jitter > 0:
        raise ForgeConfigError(
            f"config.router_jitter_noise={jitter}: forge's router has no jitter; set it to 0"
        )


def experts_of(block: nn.Module, family: _Family) -> Any:  # NOTE: Any: duck-typed module
    """The block's experts module, checked to hold the fused weights its family names."""
    experts = getattr(block, "experts", None)
    first = "gate_up_proj" if family.gated else "up_proj"
    if not isinstance(experts, nn.Module) or not hasattr(experts, first):
        raise ForgeConfigError(
            f"{type(block).__name__}.experts has no fused {first}: this transformers "
            "version lays the experts out differently from the one forge knows (5.x)"
        )
    return experts


def _top_k(block: nn.Module, router: Any) -> int:
    """Experts per token: the router's ``top_k`` (transformers 5.23) or the block's (5.17's
    Jamba routes in the block with a plain Linear router)."""
    for holder in (router, block):
        top_k = getattr(holder, "top_k", None)
        if isinstance(top_k, int):
            return top_k
    raise ForgeConfigError(
        f"{type(block).__name__}: no top_k on its router or on the block; this transformers "
        "version routes differently from the ones forge knows"
    )


def _score(router: Any, family: _Family, config: Any) -> tuple[str, bool]:
    """``(score, renormalise)`` of the block's router: the family's, or the one its config
    names (``score_from``), or, for a family whose router says it (``selection``), the
    router's: a softmax over the top-k logits is a renormalised softmax; a sigmoid of the top-k
    logits chooses as the sigmoid scores do (monotone), renormalised when ``norm_topk_prob``."""
    score = family.score
    if family.score_from:
        score = getattr(config, family.score_from, score)
    if family.selection:
        score = getattr(router, family.selection)
    if score not in MOE_ROUTERS:
        raise ForgeConfigError(
            f"router score {score!r}: forge's router scores are {list(MOE_ROUTERS)}"
        )
    if family.selection and score == "softmax":
        return score, True
    norm = family.renormalize
    return score, bool(router.norm_topk_prob) if norm is None else norm


def _refuse_block(block: nn.Module, family: _Family, router: Any) -> None:
    """What the block asks for that forge's MoE does not do: one line each."""
    combine = getattr(block, "shared_expert_combination_strategy", "sum")
    if combine != "sum" and getattr(block, family.shared or "", None) is not None:
        raise ForgeConfigError(
            f"{type(block).__name__}: shared_expert_combination_strategy={combine!r}: forge adds "
            "the shared expert to the routed output; set it to 'sum' to convert"
        )
    softcap = getattr(router, "router_logit_softcapping", None) or 0.0
    if softcap > 0:
        raise ForgeConfigError(
            f"{type(block).__name__}: router logit soft-capping ({softcap}) is not in forge's "
            "router; set it to 0 in config.json (moe_router_logit_softcapping) to convert"
        )


def _activation(family: _Family, config: Any) -> str:
    """The experts' activation: the family's, else from the config's ``hidden_act`` (or the
    one the family names, e.g. Nemotron-H's ``mlp_hidden_act``)."""
    act = family.act or ("clamped_swiglu" if family.layout == "interleaved" else None)
    if act is not None:
        return act
    name = getattr(config, family.act_from, "silu")
    act = _ACTIVATIONS.get(name)
    if act is None:
        raise ForgeConfigError(
            f"{family.act_from}={name!r}: forge's experts support {sorted(_ACTIVATIONS)}"
        )
    return act


def expert_shape(block: nn.Module, family: _Family) -> tuple[int, int]:
    """``(width the experts work at, their hidden size)`` from the stored down projection."""
    down = experts_of(block, family).down_proj
    if family.layout == "out_in":
        return down.shape[1], down.shape[-1]
    return down.shape[-1], down.shape[1]


def _limits(experts: Any, family: _Family) -> tuple[float, float | None]:
    """A clamped or soft-capped activation's limit, and the up half's own cap (None: none)."""
    limit = at_path(experts, family.limit)
    up = at_path(experts, family.up_limit) if family.up_limit else None
    return float(7.0 if limit is None else limit), None if up is None else float(up)


def moe_config(block: nn.Module, family: _Family, config: Any, layer_id: int) -> MoEModelConfig:
    """The :class:`MoEModelConfig` of the forge MoE that answers as ``block`` does."""
    router: Any = getattr(block, family.router)
    score, renormalize = _score(router, family, config)
    _refuse_block(block, family, router)
    experts = experts_of(block, family)
    num_experts, dim = router_weights(block, family).weight.shape
    hidden = expert_shape(block, family)[1]
    limit, up_limit = _limits(experts, family)
    # Group-limited routing: DeepSeek-V3 / GLM4-MoE always (n_group may be 1), V2 unless its
    # topk_method is "greedy".
    grouped = getattr(router, "topk_method", "group_limited_greedy") != "greedy"
    groups = int(getattr(router, "num_group", 1) or 1) if grouped else 1
    on_input = (
        family.layout == "in_out" if family.weights_on_input is None else family.weights_on_input
    )
    norm_min = at_path(block, family.renormalize_min) if family.renormalize_min else None
    logit_scale = at_path(block, family.logit_scale) if family.logit_scale else None
    return MoEModelConfig(
        dim=dim,  # NOTE: the router's; experts at another (latent) width: hf._convert
        n_layers=int(getattr(config, "num_hidden_layers", layer_id + 1)),
        n_heads=1,
        vocab_size=1,
        ffn_dim=hidden,
        moe_every=1,
        num_experts=num_experts,
        top_k=_top_k(block, router),
        router=score,
        router_renormalize=renormalize,
        router_scale=float(at_path(block, family.scale_path) or 1.0),
        router_groups=groups,
        router_topk_groups=int(getattr(router, "topk_group", 1) or 1) if groups > 1 else 1,
        router_group_top=family.group_top,
        router_bias=getattr(router_weights(block, family), "bias", None) is not None,
        router_weights_on_input=on_input,
        router_choice=family.choice,
        router_group_mask=family.group_mask,
        router_renormalize_min=float(norm_min or 0.0),
        router_logit_scale=float(1.0 if logit_scale is None else logit_scale),
        expert_act=_activation(family, config),
        expert_act_alpha=float(getattr(experts, family.alpha, 1.702)),
        expert_act_limit=limit,
        expert_act_up_limit=up_limit,
        expert_gated=family.gated,
        expert_linear_bias=family.layout == "interleaved",
        shared_expert_gate=family.shared_gate is not None,
        num_shared_experts=0,  # the block's own shared expert is moved in as it is
        moe_bias_update_rate=0.0,
        moe_aux_loss_coef=0.0,
    )

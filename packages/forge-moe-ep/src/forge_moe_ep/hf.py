"""Hugging Face MoE blocks as forge's :class:`MoE`, and back (for export).

:func:`convert_hf_moe` replaces every Hugging Face MoE block of a known family in a model with
an :class:`HFMoE` (a :class:`MoE` that answers the way the block did), its weights copied and
re-laid out; :func:`restore_hf_moe` rebuilds the Hugging Face blocks from them, so
``save_pretrained`` writes an ordinary checkpoint. Then expert parallelism, FSDP2 and the
Triton grouped GEMMs apply to Hugging Face MoE models exactly as to forge's own.

Families are recognised by the block's class name (no transformers import): Qwen3-MoE,
Qwen2-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3, GPT-OSS, OLMoE, GLM4-MoE and Llama 4 (text), and
the blocks transformers builds the same way in other families (Qwen3-Next, Qwen3.5-MoE,
Qwen3-VL-MoE, Granite-MoE, Jamba, Kimi-Linear, Dots1, GLM-4.5V, DeepSeek-V3.2, MiniMax,
Mistral 4, ...: see ``HF_MOE_BLOCKS``; the zoo checks each). Their routers map
onto :class:`Router`'s variants:

==============  =========================================================================
Qwen3, OLMoE    softmax, top-k, renormalised when ``norm_topk_prob``
Qwen2-MoE       the same, plus a shared expert scaled by ``sigmoid(x g)``
Mixtral         softmax, top-k, always renormalised
DeepSeek-V2     softmax, choice within the best ``topk_group`` groups by their best score
                (``group_limited_greedy``), times ``routed_scaling_factor``; shared experts
DeepSeek-V3,    sigmoid, choice within the best ``topk_group`` of ``n_group`` groups with the
GLM4-MoE        correction bias (``e_score_correction_bias`` -> ``router.expert_bias``),
                renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``;
                shared experts
GPT-OSS         a router bias, softmax over the top-k logits (= renormalised softmax),
                experts with biases and the clamped SwiGLU
Llama 4         sigmoid of the top-k logits applied to the experts' INPUT; shared expert
Lfm2-MoE,       sigmoid, the choice's correction bias kept on the block (``expert_bias`` /
MiniMax-M2      ``e_score_correction_bias``), renormalised; no shared expert
AFMoE           the same with the router's Linear one module deeper (``router.gate``) and
                its scale as ``route_scale``; shared experts
HY-V3           the same with the scale as ``router_scaling_factor``; shared experts
HunYuan-MoE     Mixtral's routing, the router's Linear at ``gate.wg`` (float32), an always-on
                shared MLP (``shared_mlp``)
Beam, Laguna    DeepSeek-V3's sigmoid router, the routed output scaled by the block;
                Laguna: no groups, always renormalised, shared experts
HY-V4,          GLM4-MoE's block and router; the experts' SwiGLU clamped at
GLM-5-next      ``swiglu_limit`` (``clamped_silu``)
Cohere2-MoE     softmax or sigmoid of the top-k logits (``expert_selection_fn``); shared
                experts added ("average" refused)
MiniMax-M3-VL   sigmoid + correction bias, the block's scale, a dense shared MLP; GPT-OSS's
                clamped SwiGLU on (gate | up) halves (``swiglu_alpha``, ``swiglu_limit``)
==============  =========================================================================

Each family is one :data:`HF_MOE_BLOCKS` entry (``_Family``): where the router, its weight,
its correction bias and its scale live, the experts' layout, the score, the shared expert and
its gate, whether the top-k weights are renormalised. A new family built from these parts is
an entry and a zoo row.

The shared expert stays the Hugging Face module it was (same names inside). The choices that
keep parity with the Hugging Face model's own training: no aux-loss-free bias updates
(``moe_bias_update_rate = 0``, as transformers never updates the correction bias) and no
auxiliary loss inside the layer. A model whose config asks transformers for its router aux loss
(``output_router_logits = True``) or for router jitter is refused: the converted block does not
produce router logits for transformers to collect, and forge's router has no jitter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from forge_core.errors import ForgeConfigError
from torch.distributed.tensor import DTensor

from .config import MoEModelConfig
from .hf_families import HF_MOE_BLOCKS, _Family, at_path, correction_bias, router_weights
from .moe import MoE

__all__ = [
    "HF_MOE_BLOCKS",
    "HFMoE",
    "convert_hf_moe",
    "hf_block_values",
    "hf_moe_blocks",
    "restore_hf_moe",
]

#: Hugging Face ``hidden_act`` names -> ``MoEModelConfig.expert_act``.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


class HFMoE(MoE):
    """A forge :class:`MoE` standing in for a Hugging Face MoE block (:func:`convert_hf_moe`).

    Takes ``[B, S, dim]`` or ``[T, dim]`` and answers as the block did (a tuple whose second
    item is None for the families whose decoder layer unpacks one). Remembers the block's class
    and config so :func:`restore_hf_moe` can rebuild it.
    """

    def __init__(
        self,
        config: MoEModelConfig,
        layer_id: int,
        family: _Family,
        hf_class: type[nn.Module],
        hf_config: Any,
    ) -> None:
        super().__init__(config, layer_id)
        self.family, self.hf_class, self.hf_config = family, hf_class, hf_config

    def forward(self, x: torch.Tensor) -> Any:
        # NOTE: a copy, not a view of the combine's output: the decoder layer may add into it
        # in place, which on a view would drop the pre-backward hook FSDP2 puts on the output
        # of a unit (this layer is one under expert parallelism).
        out = super().forward(x.unsqueeze(0) if x.dim() == 2 else x).reshape(x.shape).clone()
        return (out, None) if self.family.returns_tuple else out


def hf_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of every Hugging Face MoE block of a known family in ``model``."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in HF_MOE_BLOCKS]


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise ForgeConfigError(f"{type(model).__name__} has no Hugging Face config")
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _refuse_unsupported(config: Any) -> None:
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


def _experts_of(block: nn.Module) -> Any:  # NOTE: Any: a transformers module, duck-typed
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module) or not hasattr(experts, "gate_up_proj"):
        raise ForgeConfigError(
            f"{type(block).__name__}.experts has no fused gate_up_proj: this transformers "
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


def _score(router: Any, family: _Family) -> tuple[str, bool]:
    """``(score, renormalise)`` of the block's router: the family's, or, for a family whose
    router says it (``selection``), the router's: a softmax over the top-k logits is a
    renormalised softmax; a sigmoid of the top-k logits chooses as the sigmoid scores do
    (monotone), renormalised when ``norm_topk_prob``."""
    score = getattr(router, family.selection) if family.selection else family.score
    if score not in ("softmax", "sigmoid"):
        raise ForgeConfigError(f"router score {score!r}: forge's router is softmax or sigmoid")
    if family.selection and score == "softmax":
        return score, True
    norm = family.renormalize
    return score, bool(router.norm_topk_prob) if norm is None else norm


def _moe_config(block: nn.Module, family: _Family, config: Any, layer_id: int) -> MoEModelConfig:
    router: Any = getattr(block, family.router)
    score, renormalize = _score(router, family)
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
    experts = _experts_of(block)
    num_experts, dim = router_weights(block, family).weight.shape
    down = experts.down_proj
    hidden = down.shape[-1] if family.layout == "out_in" else down.shape[1]
    act = family.act or ("clamped_swiglu" if family.layout == "interleaved" else None)
    if act is None:
        name = getattr(config, "hidden_act", "silu")
        act = _ACTIVATIONS.get(name)
        if act is None:
            raise ForgeConfigError(
                f"hidden_act={name!r}: forge's experts support {sorted(_ACTIVATIONS)}"
            )
    # Group-limited routing: DeepSeek-V3 / GLM4-MoE always (n_group may be 1), V2 unless its
    # topk_method is "greedy".
    grouped = getattr(router, "topk_method", "group_limited_greedy") != "greedy"
    groups = int(getattr(router, "num_group", 1) or 1) if grouped else 1
    return MoEModelConfig(
        dim=dim,
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
        router_weights_on_input=family.layout == "in_out",
        expert_act=act,
        expert_act_alpha=float(getattr(experts, family.alpha, 1.702)),
        expert_act_limit=float(getattr(experts, family.limit, 7.0)),
        expert_linear_bias=family.layout == "interleaved",
        shared_expert_gate=family.shared_gate is not None,
        num_shared_experts=0,  # the block's own shared expert is moved in as it is
        moe_bias_update_rate=0.0,
        moe_aux_loss_coef=0.0,
    )


def _to_forge(hf: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """The experts' ``gate_up_proj`` as forge's ``w1`` (gate) and ``w3`` (up), ``[E, dim, I]``."""
    if layout == "out_in":
        gate, up = hf.chunk(2, dim=1)
        return {"w1": gate.transpose(1, 2), "w3": up.transpose(1, 2)}
    if layout == "in_out":
        gate, up = hf.chunk(2, dim=2)
        return {"w1": gate, "w3": up}
    return {"w1": hf[..., 0::2], "w3": hf[..., 1::2]}


def _from_forge(w1: torch.Tensor, w3: torch.Tensor, layout: str) -> torch.Tensor:
    """:func:`_to_forge`'s inverse: ``gate_up_proj`` in the family's layout."""
    if layout == "out_in":
        return torch.cat([w1.transpose(1, 2), w3.transpose(1, 2)], dim=1)
    if layout == "in_out":
        return torch.cat([w1, w3], dim=2)
    return torch.stack([w1, w3], dim=-1).flatten(-2)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if isinstance(dst, DTensor) or isinstance(src, DTensor):
        raise ForgeConfigError(
            "convert_hf_moe / restore_hf_moe work on unsharded modules: convert before "
            "parallelizing, restore after gathering a full model"
        )
    with torch.no_grad():
        dst.copy_(src)


def _convert(block: nn.Module, family: _Family, config: Any, layer_id: int) -> HFMoE:
    router = router_weights(block, family)
    experts = _experts_of(block)
    # NOTE: the experts' dtype, not the router's: some families keep a float32 router in a
    # low-precision model (HunYuan-MoE's gate.wg)
    param = experts.gate_up_proj
    with torch.device(param.device):
        moe = HFMoE(
            _moe_config(block, family, config, layer_id), layer_id, family, type(block), config
        )
    moe.to(param.dtype)
    _copy(moe.router.gate.weight, router.weight)
    if moe.router.gate.bias is not None:
        _copy(moe.router.gate.bias, router.bias)
    correction = correction_bias(block, family)
    if correction is not None:
        _copy(moe.router.expert_bias, correction)
    fused = _to_forge(experts.gate_up_proj, family.layout)
    down = experts.down_proj
    fused["w2"] = down.transpose(1, 2) if family.layout == "out_in" else down
    if family.layout == "interleaved":
        fused["b1"] = experts.gate_up_proj_bias[..., 0::2]
        fused["b3"] = experts.gate_up_proj_bias[..., 1::2]
        fused["b2"] = experts.down_proj_bias
    for name, value in fused.items():
        _copy(getattr(moe.experts, name), value)
    shared = getattr(block, family.shared, None) if family.shared is not None else None
    if shared is not None:  # NOTE: a config may have none (Cohere2-MoE's num_shared_experts=0)
        moe.shared_expert = shared
    if family.shared_gate is not None:
        assert moe.shared_expert_gate is not None  # config.shared_expert_gate
        _copy(moe.shared_expert_gate.weight, getattr(block, family.shared_gate).weight)
    moe.train(block.training)
    return moe


def convert_hf_moe(model: nn.Module) -> list[str]:
    """Replace each Hugging Face MoE block of a known family (:data:`HF_MOE_BLOCKS`) in
    ``model`` with an equivalent :class:`HFMoE`; returns the converted blocks' names.

    The model must be unsharded (convert before any ``apply_*``); its weights are copied (the
    block's own tensors are dropped with it). Raises ForgeConfigError for a config the converted
    blocks cannot honour (see the module docstring). A model with no such block is unchanged.
    """
    blocks = hf_moe_blocks(model)
    if not blocks:
        return []
    config = _text_config(model)
    _refuse_unsupported(config)
    for index, (name, block) in enumerate(blocks):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = next((int(p) for p in reversed(name.split(".")) if p.isdigit()), index)
        setattr(parent, attr, _convert(block, HF_MOE_BLOCKS[type(block).__name__], config, layer))
    return [name for name, _ in blocks]


def _restore(moe: HFMoE) -> nn.Module:
    family, experts = moe.family, moe.experts
    param = experts.w1
    with torch.device(param.device):
        block = moe.hf_class(moe.hf_config)
    block.to(param.dtype)
    router = router_weights(block, family)
    hf_experts = _experts_of(block)
    _copy(router.weight, moe.router.gate.weight)
    if moe.router.gate.bias is not None:
        _copy(router.bias, moe.router.gate.bias)
    correction = correction_bias(block, family)
    if correction is not None:
        _copy(correction, moe.router.expert_bias)
    _copy(hf_experts.gate_up_proj, _from_forge(experts.w1, experts.w3, family.layout))
    w2 = experts.w2
    _copy(hf_experts.down_proj, w2.transpose(1, 2) if family.layout == "out_in" else w2)
    if family.layout == "interleaved":
        assert experts.b1 is not None and experts.b3 is not None and experts.b2 is not None
        _copy(hf_experts.gate_up_proj_bias, _from_forge(experts.b1, experts.b3, "interleaved"))
        _copy(hf_experts.down_proj_bias, experts.b2)
    if family.shared is not None and moe.shared_expert is not None:
        setattr(block, family.shared, moe.shared_expert)
    if family.shared_gate is not None:
        assert moe.shared_expert_gate is not None
        _copy(getattr(block, family.shared_gate).weight, moe.shared_expert_gate.weight)
    block.train(moe.training)
    return block


def restore_hf_moe(model: nn.Module) -> list[str]:
    """Put Hugging Face blocks back in place of every :class:`HFMoE` in ``model`` (unsharded),
    weights copied back; returns their names. ``model.save_pretrained`` then writes a
    checkpoint transformers loads as usual."""
    names = [n for n, m in model.named_modules() if isinstance(m, HFMoE)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, _restore(getattr(parent, attr)))
    return names


def hf_block_values(moe: HFMoE, init: Callable[[nn.Module], None]) -> dict[str, torch.Tensor]:
    """The values ``moe`` takes for the Hugging Face block ``init`` fills: a new block of the
    class and config ``moe`` replaced, built on the CPU, filled by ``init(block)``, converted as
    :func:`convert_hf_moe` converts it; its state dict (names as in ``moe``, buffers included).

    For initializing a converted model from a seed exactly as the unconverted one would be (the
    block's own init rules, the same random draws), however ``moe`` is sharded afterwards.
    """
    dtype = next(moe.parameters()).dtype
    with torch.device("cpu"):
        block = moe.hf_class(moe.hf_config)
    block.to(dtype)
    init(block)
    converted = _convert(block, moe.family, moe.hf_config, moe.layer_id)
    return converted.state_dict()

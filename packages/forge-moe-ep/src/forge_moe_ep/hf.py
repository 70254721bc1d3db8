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
A.X-K2, A.X-K1  DeepSeek-V3's; K2's groups leave experts out at 0.0; K1 norms its output
Kolibri         the choice on the raw logits + correction bias, sigmoid weights
ERNIE 4.5       softmax, a [1, E] correction bias in the choice, the sum clamped below
Aria            Mixtral's routing, Llama 4's in_out experts weighted on their output
Inkling 2       the config's score + correction bias; a soft-capped SwiGLU
Nemotron-H      DeepSeek-V3's router; relu2 experts, not gated, between latent projections
DeepSeek-V4     sqrtsoftplus + correction bias, or a token id -> experts table (hash);
                the experts' SwiGLU clamped at ``swiglu_limit``
MuseSpark       sigmoid of scaled logits + correction bias; experts at their own width
                between projections, each expert's output row normed before weighting
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

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from forge_core.errors import ForgeConfigError
from torch.distributed.tensor import DTensor

from .config import MoEModelConfig
from .experts import GroupedExperts
from .hf_config import expert_shape, experts_of, moe_config, refuse_unsupported, text_config
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


class HFMoE(MoE):
    """A forge :class:`MoE` standing in for a Hugging Face MoE block (:func:`convert_hf_moe`).

    Takes ``[B, S, dim]`` or ``[T, dim]`` (and the tokens' ``input_ids`` for a hash-routed
    block) and answers as the block did (a tuple whose second item is None for the families
    whose decoder layer unpacks one). Remembers the block's class and config so
    :func:`restore_hf_moe` can rebuild it. Beside :class:`MoE`'s parts it may hold the block's
    norm of its output (``post_norm``) and a hash table of experts per token id
    (``expert_table``, ``[vocab, K]``: the router then only weights the experts it names).
    """

    expert_table: torch.Tensor | None

    def __init__(
        self,
        config: MoEModelConfig,
        layer_id: int,
        family: _Family,
        hf_class: type[nn.Module],
        hf_config: Any,
        width: int | None = None,
    ) -> None:
        super().__init__(config, layer_id, experts_dim=width)
        self.family, self.hf_class, self.hf_config = family, hf_class, hf_config
        self.post_norm: nn.Module | None = None
        self.register_buffer("expert_table", None)

    def new_block(self) -> nn.Module:
        """A new Hugging Face block of the class and config this layer replaced (on the current
        default device; some classes take their layer's index: DeepSeek-V4's)."""
        takes_layer = "layer_idx" in inspect.signature(self.hf_class.__init__).parameters
        if takes_layer:
            return self.hf_class(self.hf_config, layer_idx=self.layer_id)
        return self.hf_class(self.hf_config)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> Any:
        ids = None
        if self.expert_table is not None:
            if input_ids is None:
                raise ValueError(
                    f"{self.hf_class.__name__} (layer {self.layer_id}) routes by token id: its "
                    "decoder layer must pass input_ids (a model fed inputs_embeds cannot)"
                )
            ids = self.expert_table[input_ids.reshape(-1)].long()
        out = super().forward(x.unsqueeze(0) if x.dim() == 2 else x, ids)
        if self.post_norm is not None:
            out = self.post_norm(out)
        # NOTE: a copy, not a view of the combine's output: the decoder layer may add into it
        # in place, which on a view would drop the pre-backward hook FSDP2 puts on the output
        # of a unit (this layer is one under expert parallelism).
        out = out.reshape(x.shape).clone()
        return (out, None) if self.family.returns_tuple else out


def hf_moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of every Hugging Face MoE block of a known family in ``model``."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in HF_MOE_BLOCKS]


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


def _out_in(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A stored ``[E, out, in]`` projection as forge's ``[E, in, out]`` (and back)."""
    return t.transpose(1, 2) if layout == "out_in" else t


def _expert_weights(experts: Any, family: _Family) -> dict[str, torch.Tensor]:
    """The block's experts' tensors under forge's names (``w1``, ``w3``, ``w2``, biases)."""
    layout = family.layout
    if family.gated:
        weights = _to_forge(experts.gate_up_proj, layout)
    else:
        weights = {"w1": _out_in(experts.up_proj, layout)}
    weights["w2"] = _out_in(experts.down_proj, layout)
    if layout == "interleaved":
        weights["b1"] = experts.gate_up_proj_bias[..., 0::2]
        weights["b3"] = experts.gate_up_proj_bias[..., 1::2]
        weights["b2"] = experts.down_proj_bias
    return weights


def kept_paths(family: _Family) -> dict[str, str]:
    """The layer's module paths that hold block modules kept as they are -> their paths in the
    block: shared expert, output norm, experts' row norm, latent projections (several in or
    out: an ``nn.Sequential``, ``expert_in.0``, ``expert_in.1``, ...)."""
    paths = {
        "shared_expert": family.shared,
        "post_norm": family.post_norm,
        "expert_norm": family.expert_norm,
    }
    for attr, group in (("expert_in", family.latent_in), ("expert_out", family.latent_out)):
        if len(group) == 1:
            paths[attr] = group[0]
        else:
            paths.update({f"{attr}.{i}": path for i, path in enumerate(group)})
    return {attr: path for attr, path in paths.items() if path}


def kept_module(moe: nn.Module, attr: str) -> nn.Module | None:
    """The module at the layer's path ``attr`` (:func:`kept_paths`), None when it has none."""
    try:
        module = moe.get_submodule(attr)
    except AttributeError:
        return None
    return module if isinstance(module, nn.Module) else None


def _keep(moe: HFMoE, block: nn.Module, family: _Family) -> None:
    """Move the block's kept modules into the layer; an absent or ``nn.Identity`` one (Nemotron-H
    without a latent size) is left out."""
    for attr, path in kept_paths(family).items():
        module = at_path(block, path)
        if not isinstance(module, nn.Module) or isinstance(module, nn.Identity):
            continue
        parent, _, leaf = attr.rpartition(".")
        if parent and getattr(moe, parent) is None:
            setattr(moe, parent, nn.Sequential())
        setattr(moe.get_submodule(parent) if parent else moe, leaf, module)


def _convert(block: nn.Module, family: _Family, config: Any, layer_id: int) -> HFMoE:
    router = router_weights(block, family)
    experts = experts_of(block, family)
    # NOTE: the experts' dtype, not the router's: some families keep a float32 router in a
    # low-precision model (HunYuan-MoE's gate.wg)
    param = experts.down_proj
    cfg = moe_config(block, family, config, layer_id)
    with torch.device(param.device):
        width = expert_shape(block, family)[0]
        moe = HFMoE(cfg, layer_id, family, type(block), config, width)
    moe.to(param.dtype)
    _copy(moe.router.gate.weight, router.weight)
    if moe.router.gate.bias is not None:
        _copy(moe.router.gate.bias, router.bias)
    correction = correction_bias(block, family)
    if correction is not None:
        # NOTE: in the block's own shape (ERNIE 4.5 keeps [1, E]): it broadcasts over tokens
        # the same, and checkpoints keep their shape
        moe.router.register_buffer("expert_bias", torch.zeros_like(correction, dtype=torch.float32))
        _copy(moe.router.expert_bias, correction)
    for name, value in _expert_weights(experts, family).items():
        _copy(getattr(moe.experts, name), value)
    _keep(moe, block, family)
    if family.shared_gate is not None:
        assert moe.shared_expert_gate is not None  # config.shared_expert_gate
        _copy(moe.shared_expert_gate.weight, getattr(block, family.shared_gate).weight)
    table = at_path(block, family.hash_table) if family.hash_table else None
    if isinstance(table, torch.Tensor):
        moe.expert_table = table.detach().clone()
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
    config = text_config(model)
    refuse_unsupported(config)
    for index, (name, block) in enumerate(blocks):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        layer = next((int(p) for p in reversed(name.split(".")) if p.isdigit()), index)
        setattr(parent, attr, _convert(block, HF_MOE_BLOCKS[type(block).__name__], config, layer))
    return [name for name, _ in blocks]


def _restore_experts(hf_experts: Any, experts: GroupedExperts, family: _Family) -> None:
    """:func:`_expert_weights`' inverse: forge's expert tensors into the block's experts."""
    layout = family.layout
    if family.gated:
        assert experts.w3 is not None
        _copy(hf_experts.gate_up_proj, _from_forge(experts.w1, experts.w3, layout))
    else:
        _copy(hf_experts.up_proj, _out_in(experts.w1, layout))
    _copy(hf_experts.down_proj, _out_in(experts.w2, layout))
    if layout == "interleaved":
        assert experts.b1 is not None and experts.b3 is not None and experts.b2 is not None
        _copy(hf_experts.gate_up_proj_bias, _from_forge(experts.b1, experts.b3, "interleaved"))
        _copy(hf_experts.down_proj_bias, experts.b2)


def _restore(moe: HFMoE) -> nn.Module:
    family = moe.family
    param = moe.experts.w2
    with torch.device(param.device):
        block = moe.new_block()
    block.to(param.dtype)
    router = router_weights(block, family)
    _copy(router.weight, moe.router.gate.weight)
    if moe.router.gate.bias is not None:
        _copy(router.bias, moe.router.gate.bias)
    correction = correction_bias(block, family)
    if correction is not None:
        _copy(correction, moe.router.expert_bias)
    assert isinstance(moe.experts, GroupedExperts)
    _restore_experts(experts_of(block, family), moe.experts, family)
    for attr, path in kept_paths(family).items():
        kept = kept_module(moe, attr)
        if kept is not None:
            parent, _, leaf = path.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, leaf, kept)
    if family.shared_gate is not None:
        assert moe.shared_expert_gate is not None
        _copy(getattr(block, family.shared_gate).weight, moe.shared_expert_gate.weight)
    table = at_path(block, family.hash_table) if family.hash_table else None
    if isinstance(table, torch.Tensor) and moe.expert_table is not None:
        _copy(table, moe.expert_table)
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
        block = moe.new_block()
    block.to(dtype)
    init(block)
    converted = _convert(block, moe.family, moe.hf_config, moe.layer_id)
    return converted.state_dict()

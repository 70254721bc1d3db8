"""The Hugging Face MoE blocks forge converts, as data: one :class:`_Family` entry per block
class (by name, no transformers import) saying where its router, the router's weight, its
correction bias and its scale live, how its experts are laid out, its score and shared expert.
:mod:`forge_moe_ep.hf` converts and restores by these entries, :mod:`forge_moe_ep.hf_sources`
reads checkpoints by them; a new family built from these parts is one entry and a zoo row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
from forge_core.errors import ForgeConfigError

__all__ = ["HF_MOE_BLOCKS", "at_path", "correction_bias", "router_weights"]


@dataclass(frozen=True)
class _Family:
    """How one family's MoE block is laid out.

    ``router``: the block's attribute holding the router (its ``weight`` is ``[E, dim]``).
    ``layout``: the experts' fused weights. ``"out_in"``: ``gate_up_proj [E, 2I, dim]`` (gate
    rows then up rows) and ``down_proj [E, dim, I]``; ``"in_out"``: ``gate_up_proj [E, dim, 2I]``
    (gate columns then up columns) and ``down_proj [E, I, dim]``; ``"interleaved"``: like
    ``in_out`` but gate and up columns alternate, with biases. ``score``: the router's score.
    ``shared`` / ``shared_gate``: attributes of the shared expert and its gate (None: none).
    ``returns_tuple``: the block returns ``(hidden, router output)``; the decoder layer drops
    the second. ``renormalize``: whether the top-k weights are renormalised (None: as the
    router's ``norm_topk_prob`` says). ``group_top``: how many of a group's best scores make
    its score, for a router with ``num_group`` groups (DeepSeek-V3: 2, V2: 1). ``correction``:
    where the choice's correction bias lives, a dotted path from the block (None: the router's
    ``e_score_correction_bias``, where DeepSeek-V3 keeps it); absent on a block: none (zero).
    ``weight``: the module holding the router's ``weight`` (and ``bias``), a dotted path from
    the block (None: the router itself). ``scale``: the factor the routed output is multiplied
    by, a dotted path from the block (None: the router's ``routed_scaling_factor``); absent: 1.
    Scaling the routed experts' output or their top-k weights is the same (the output is
    linear in the weights), so a block that scales its output maps onto forge's router scale.
    ``act``: the experts' activation (``MoEModelConfig.expert_act``; None: from the layout and
    the config's ``hidden_act``); ``limit`` / ``alpha``: the experts' attributes holding a
    clamped activation's limit and GPT-OSS's ``alpha`` (``limit`` and ``up_limit``, the up
    half's own cap, are dotted paths from the experts). ``selection``: the router's attribute
    naming its score per config (``"softmax"`` or ``"sigmoid"`` of the top-k logits), which then
    overrides ``score``; ``score_from``: the model config's attribute naming the score itself;
    ``act_from``: the config attribute naming the experts' activation.

    ``gated``: False for experts with ``up_proj`` and ``down_proj`` only (``act(x up) down``).
    ``weights_on_input``: the routing weights scale the experts' input (None: as the layout
    says: ``in_out`` does). ``choice`` / ``group_mask``: ``MoEConfig.router_choice`` /
    ``router_group_mask``. ``renormalize_min``: the block's path to the clamp of the
    renormalising sum; ``logit_scale``: the path to a factor on the router's logits.
    ``post_norm``: the block's norm of its output; ``latent_in`` / ``latent_out``: the block's
    modules into and out of the experts' width, in order; ``expert_norm``: its row-wise norm
    of each expert's output (a path from the block); ``hash_table``: the path to a hash-routed
    block's ``[vocab, K]`` experts per token id (absent on a block: routed by scores).
    """

    router: str
    layout: str
    score: str
    shared: str | None = None
    shared_gate: str | None = None
    returns_tuple: bool = False
    renormalize: bool | None = None
    group_top: int = 2
    correction: str | None = None
    weight: str | None = None
    scale: str | None = None
    act: str | None = None
    limit: str = "limit"
    alpha: str = "alpha"
    selection: str | None = None
    score_from: str | None = None
    act_from: str = "hidden_act"
    up_limit: str | None = None
    gated: bool = True
    weights_on_input: bool | None = None
    choice: str = "scores"
    group_mask: str = "exclude"
    renormalize_min: str | None = None
    logit_scale: str | None = None
    post_norm: str | None = None
    latent_in: tuple[str, ...] = ()
    latent_out: tuple[str, ...] = ()
    expert_norm: str | None = None
    hash_table: str | None = None

    @property
    def scale_path(self) -> str:
        """The dotted path from the block to the routed output's scale."""
        return self.scale or f"{self.router}.routed_scaling_factor"

    @property
    def weight_path(self) -> str:
        """The dotted path from the block to the module holding the router's weight."""
        return self.weight or self.router

    @property
    def correction_path(self) -> str:
        """The correction bias's dotted path from the block."""
        return self.correction or f"{self.router}.e_score_correction_bias"


def at_path(block: nn.Module, path: str) -> Any:
    """The attribute at dotted ``path`` from ``block`` (None where the path ends early)."""
    value: Any = block
    for name in path.split("."):
        value = getattr(value, name, None)
        if value is None:
            return None
    return value


def correction_bias(block: nn.Module, family: _Family) -> torch.Tensor | None:
    """The block's choice correction bias (``family.correction_path``), None when it has none."""
    value = at_path(block, family.correction_path)
    return value if isinstance(value, torch.Tensor) else None


def router_weights(block: nn.Module, family: _Family) -> Any:
    """The module holding the block's router ``weight`` (and ``bias``): ``family.weight_path``."""
    holder = at_path(block, family.weight_path)
    if not isinstance(getattr(holder, "weight", None), torch.Tensor):
        raise ForgeConfigError(
            f"{type(block).__name__}.{family.weight_path} holds no router weight: this "
            "transformers version lays the block out differently from the one forge knows"
        )
    return holder


#: The Hugging Face MoE block classes :func:`convert_hf_moe` converts, by class name.
HF_MOE_BLOCKS: dict[str, _Family] = {
    "Qwen3MoeSparseMoeBlock": _Family("gate", "out_in", "softmax"),
    "OlmoeSparseMoeBlock": _Family("gate", "out_in", "softmax"),
    "Qwen2MoeSparseMoeBlock": _Family(
        "gate", "out_in", "softmax", shared="shared_expert", shared_gate="shared_expert_gate"
    ),
    "MixtralSparseMoeBlock": _Family("gate", "out_in", "softmax", renormalize=True),
    "DeepseekV2Moe": _Family(
        "gate", "out_in", "softmax", shared="shared_experts", renormalize=False, group_top=1
    ),
    "DeepseekV3MoE": _Family("gate", "out_in", "sigmoid", shared="shared_experts"),
    "Glm4MoeMoE": _Family("gate", "out_in", "sigmoid", shared="shared_experts"),
    "GptOssMLP": _Family("router", "interleaved", "softmax", returns_tuple=True, renormalize=True),
    "Llama4TextMoe": _Family(
        "router", "in_out", "sigmoid", shared="shared_expert", returns_tuple=True, renormalize=False
    ),
}

# Blocks built like one of the above (transformers copies them between families); each entry is
# checked by the zoo (tests/zoo/hf_zoo.py: EP=2 x FSDP2 against the unconverted model).
_SAME_AS = {
    "DeepseekV3MoE": (
        "BailingHybridMoE",
        "Dots1MoE",
        "KimiLinearMoE",
        "ExaoneMoeSparseMoEBlock",
    ),
    "Glm4MoeMoE": (
        "DeepseekV32MoE",
        "Glm4MoeLiteMoE",
        "GlmMoeDsaMoE",
        "SolarOpenMoE",
        "Glm4vMoeTextMoE",
        "Dots3NoteTextMoE",
    ),
    "OlmoeSparseMoeBlock": ("FlexOlmoSparseMoeBlock",),
    "MixtralSparseMoeBlock": ("MiniMaxSparseMoeBlock",),
    "Qwen3MoeSparseMoeBlock": ("MellumSparseMoeBlock",),
    "Qwen2MoeSparseMoeBlock": ("Qwen3NextSparseMoeBlock", "Qwen4ExpTextSparseMoeBlock"),
}
HF_MOE_BLOCKS.update(
    {alias: HF_MOE_BLOCKS[base] for base, names in _SAME_AS.items() for alias in names}
)
#: sigmoid with the router's correction bias, renormalised, the routed output scaled by the
#: block, shared experts (Laguna)
_SCALED_BY_BLOCK = _Family(
    "gate",
    "out_in",
    "sigmoid",
    shared="shared_experts",
    renormalize=True,
    scale="routed_scaling_factor",
)
HF_MOE_BLOCKS.update(
    {
        # the same layouts, with a fixed choice where the router has no norm_topk_prob, or
        # another router attribute / score
        "MiMoV2FlashMoE": _Family("gate", "out_in", "sigmoid"),
        "Mistral4MoE": _Family("gate", "out_in", "softmax", shared="shared_experts"),
        "MistralLarge4TextMoE": _Family(
            "gate", "out_in", "softmax", shared="shared_experts", renormalize=True
        ),
        "Qwen3_5MoeSparseMoeBlock": _Family(
            "gate",
            "out_in",
            "softmax",
            shared="shared_expert",
            shared_gate="shared_expert_gate",
            renormalize=True,
        ),
        "Qwen3VLMoeTextSparseMoeBlock": _Family("gate", "out_in", "softmax", renormalize=True),
        "JambaSparseMoeBlock": _Family("router", "out_in", "softmax", renormalize=False),
        # sigmoid choice with the correction bias on the block, not on its router
        "Lfm2MoeSparseMoeBlock": _Family("gate", "out_in", "sigmoid", correction="expert_bias"),
        "MiniMaxM2SparseMoeBlock": _Family(
            "gate", "out_in", "sigmoid", renormalize=True, correction="e_score_correction_bias"
        ),
        "HYV3MoE": _Family(
            "gate",
            "out_in",
            "sigmoid",
            shared="shared_experts",
            renormalize=True,
            correction="e_score_correction_bias",
            scale="gate.router_scaling_factor",
        ),
        # Mixtral's routing with the router's Linear one module deeper, an always-on shared MLP
        "HunYuanMoEV1Moe": _Family(
            "gate", "out_in", "softmax", shared="shared_mlp", renormalize=True, weight="gate.wg"
        ),
        # the router's weight one module deeper (router.gate), its scale under its own name
        "AfmoeSparseMoeBlock": _Family(
            "router",
            "out_in",
            "sigmoid",
            shared="shared_experts",
            renormalize=True,
            correction="expert_bias",
            weight="router.gate",
            scale="router.route_scale",
        ),
        # the top-k logits' softmax or sigmoid, as the config's expert_selection_fn says;
        # shared experts only when num_shared_experts > 0, added ("sum"; "average" refused)
        "Cohere2MoeSparseMoeBlock": _Family(
            "gate", "out_in", "softmax", shared="shared_experts", selection="expert_selection_fn"
        ),
        # Laguna's routing (below); experts with GPT-OSS's clamped SwiGLU on (gate | up) halves
        "MiniMaxM3VLSparseMoeBlock": replace(
            _SCALED_BY_BLOCK, act="clamped_swiglu", limit="swiglu_limit", alpha="swiglu_alpha"
        ),
        # GLM4-MoE's block and router, the experts' SwiGLU clamped at swiglu_limit
        **{
            name: _Family(
                "gate",
                "out_in",
                "sigmoid",
                shared="shared_experts",
                act="clamped_silu",
                limit="swiglu_limit",
            )
            for name in ("HYV4MoE", "Glm5NextTextMoE")
        },
        # DeepSeek-V3's router without its scale: the block scales the routed output
        "BeamMoE": _Family("gate", "out_in", "sigmoid", scale="routed_scaling_factor"),
        # DeepSeek-V3's; groups (when n_group is set) leave experts out at 0.0, not -inf
        "AXK2MoE": replace(HF_MOE_BLOCKS["DeepseekV3MoE"], group_mask="zero"),
        # DeepSeek-V3's, then an RMSNorm of the routed + shared output
        "AXK1MoE": replace(HF_MOE_BLOCKS["DeepseekV3MoE"], post_norm="post_mlp_layernorm"),
        # choice on the raw logits + correction bias, weights the sigmoid of the chosen logits
        "Kolibri1SparseMoeBlock": _Family(
            "gate", "out_in", "sigmoid", shared="shared_experts", choice="logits"
        ),
        # softmax with the correction bias ([1, E], on gate.moe_statics) in the choice, the sum
        # clamped below at moe_norm_min; shared experts when moe_num_shared_experts > 0
        "Ernie4_5_MoeSparseMoeBlock": _Family(
            "gate",
            "out_in",
            "softmax",
            shared="shared_experts",
            renormalize=True,
            correction="gate.moe_statics.e_score_correction_bias",
            renormalize_min="gate.norm_min",
        ),
        # Mixtral's routing, Llama 4's in_out experts weighted on their output, shared experts
        "AriaTextMoELayer": _Family(
            "router",
            "in_out",
            "softmax",
            shared="shared_experts",
            renormalize=True,
            act="silu",
            weights_on_input=False,
        ),
        # the config's score + correction bias, renormalised, x routed_scaling_factor; a
        # SwiGLU whose gate factor and up are soft-capped
        "Inkling2SparseMoeBlock": _Family(
            "gate",
            "out_in",
            "sigmoid",
            renormalize=True,
            score_from="scoring_func",
            act="softcapped_swiglu",
            limit="act_fn.gate_softcap.softcap",
            up_limit="act_fn.up_softcap.softcap",
        ),
        # DeepSeek-V3's router; experts not gated (relu2) between optional latent projections
        "NemotronHMoE": replace(
            HF_MOE_BLOCKS["DeepseekV3MoE"],
            gated=False,
            act_from="mlp_hidden_act",
            latent_in=("fc1_latent_proj",),
            latent_out=("fc2_latent_proj",),
        ),
        # sigmoid of scaled logits + correction bias, renormalised, x routed_scaling_factor;
        # the experts at their own width between a projection and a centred RMSNorm and a
        # projection back, each expert's output normed before it is weighted; no shared expert
        "MuseSparkMoE": _Family(
            "gate",
            "out_in",
            "sigmoid",
            renormalize=True,
            logit_scale="gate.output_multiplier",
            latent_in=("pre_expert_proj", "pre_expert_norm"),
            latent_out=("post_expert_proj",),
            expert_norm="experts.post_expert_norm",
        ),
        # the config's score (sqrtsoftplus) + correction bias, renormalised; the first layers
        # route by a token id -> experts table; the experts' SwiGLU clamped at swiglu_limit
        "DeepseekV4SparseMoeBlock": _Family(
            "gate",
            "out_in",
            "sigmoid",
            shared="shared_experts",
            renormalize=True,
            score_from="scoring_func",
            act="clamped_silu",
            hash_table="gate.tid2eid",
        ),
        "LagunaSparseMoeBlock": _SCALED_BY_BLOCK,
        "FlintSparseMoeBlock": _Family("gate", "out_in", "sigmoid", shared="shared_expert"),
        **{
            name: _Family("router", "out_in", "softmax", renormalize=True)
            for name in (
                "GraniteMoeMoE",
                "GraniteMoeSWAMoE",
                "GraniteMoeHybridMoE",
                "GraniteMoeSharedMoE",
            )
        },
    }
)

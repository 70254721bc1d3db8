"""The MoE fields: the ``[moe]`` section (:class:`MoEConfig`) and the reference Transformer's
shape with MoE blocks (:class:`MoEModelConfig`). Pure Python, no torch import.

forge-moe-ep owns them: forge_core's ``ModelConfig`` describes the dense decoder (a forge
config's ``[model]``) and names no MoE field. A config file puts the MoE fields in ``[moe]``;
:meth:`MoEModelConfig.from_parts` joins the two into the one config the model is built from,
which tells the reference Transformer which blocks hold an MoE through
``ModelConfig.custom_ffn_layers``. Files written before ``[moe]`` existed kept these fields in
``[model]``: :func:`split_moe_fields` sorts such a table into its two sections.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from forge_core.errors import (
    ForgeConfigError,
    check_field_types,
    check_int,
    check_number,
    did_you_mean,
)
from forge_core.model_config import PRESETS, ModelConfig

__all__ = [
    "EXPERT_ACTIVATIONS",
    "MOE_DISPATCH_MODES",
    "MOE_FIELDS",
    "MOE_PRESETS",
    "MOE_ROUTERS",
    "ROUTER_CHOICES",
    "ROUTER_GROUP_MASKS",
    "MoEConfig",
    "MoEModelConfig",
    "split_moe_fields",
]

#: The router's score of the logits: ``softmax``, ``sigmoid`` or ``sqrtsoftplus``
#: (``sqrt(softplus(x))``: DeepSeek-V4).
MOE_ROUTERS = ("softmax", "sigmoid", "sqrtsoftplus")
#: What the router chooses by: ``scores`` (the scores plus the expert bias) or ``logits`` (the
#: raw logits plus the expert bias: Kolibri, whose weights are still the chosen scores).
ROUTER_CHOICES = ("scores", "logits")
#: How a group-limited choice leaves out the experts of the groups not chosen: ``exclude`` (never
#: chosen) or ``zero`` (their choice value becomes 0.0, so they still beat a kept expert whose
#: biased score is negative: A.X-K2's router).
ROUTER_GROUP_MASKS = ("exclude", "zero")
#: The experts' gated activation ``act(x w1) * (x w3)``: ``silu`` (SwiGLU), ``gelu``,
#: ``gelu_tanh`` (GeGLU, exact or tanh-approximated GELU), and ``clamped_swiglu`` (GPT-OSS:
#: gate clamped above at ``expert_act_limit``, up clamped to +-limit,
#: ``(up + 1) * gate * sigmoid(alpha * gate)`` with ``alpha = expert_act_alpha``), and
#: ``clamped_silu`` (a SwiGLU whose gate is clamped above at ``expert_act_limit`` and up to
#: +-limit: HY-V4, GLM-5-next), ``softcapped_swiglu`` (``c_g tanh(g / c_g) * sigmoid(g) *
#: c_u tanh(u / c_u)`` in float32, ``c_g = expert_act_limit``, ``c_u = expert_act_up_limit``:
#: Inkling 2) and ``relu2`` (``relu(x)^2``; with ``expert_gated = False``: Nemotron-H). Experts
#: that are not gated compute ``act(x w1) w2`` (no ``w3``): only the activations of one input.
EXPERT_ACTIVATIONS = (
    "silu",
    "gelu",
    "gelu_tanh",
    "clamped_swiglu",
    "clamped_silu",
    "softcapped_swiglu",
    "relu2",
)
#: The activations that read the up projection too: only for gated experts.
GATED_ONLY_ACTIVATIONS = ("clamped_swiglu", "clamped_silu", "softcapped_swiglu")
#: ``dropless``: exact, every routed token is computed (EP exchanges split sizes: one host wait
#: per MoE layer per forward). ``capacity``: each sequence sends at most a fixed number of tokens
#: to each expert (``capacity_factor``), the rest are dropped and counted; no host sync at all.
MOE_DISPATCH_MODES = ("dropless", "capacity")


@dataclass(frozen=True)
class MoEConfig:
    """The ``[moe]`` section: mixture-of-experts blocks in the reference Transformer.

    ``moe_every``: block ``i`` is an MoE block when ``(i + 1) % moe_every == 0`` (1: every
    block; 0: none, a dense model; left out: 1 when ``num_experts > 0``, else 0). Each has
    ``num_experts``
    SwiGLU experts of hidden size ``moe_ffn_dim`` (default ``[model] ffn_dim``), a
    top-``top_k`` token-choice ``router`` (``softmax`` or ``sigmoid`` scores, computed in
    float32), ``num_shared_experts`` always-on experts (one SwiGLU of hidden
    ``num_shared_experts * moe_ffn_dim``), and ``moe_dispatch`` (see ``MOE_DISPATCH_MODES``)
    with ``capacity_factor`` for the capacity mode. Load balancing: ``moe_bias_update_rate``
    (aux-loss-free expert bias, 0 disables it) and ``moe_aux_loss_coef`` (auxiliary
    load-balancing loss, 0 disables it).

    Router and expert variants (the defaults are forge's own MoE; the other values express the
    Hugging Face families ``forge_moe_ep.hf`` converts):

    - ``router_renormalize``: divide the top-k weights by their sum (None: only for ``sigmoid``
      with ``top_k > 1``); ``router_scale``: multiply them by this factor afterwards.
    - ``router_groups`` / ``router_topk_groups``: group-limited choice (DeepSeek-V2/V3): experts
      form ``router_groups`` equal groups, a group scores the sum of its ``router_group_top``
      best (biased) scores (V3: 2, V2: 1, its maximum), and each token chooses only within its
      ``router_topk_groups`` best groups.
    - ``router_bias``: the router's linear layer has a bias (GPT-OSS).
    - ``router_choice`` (see ``ROUTER_CHOICES``), ``router_group_mask`` (see
      ``ROUTER_GROUP_MASKS``); ``router_renormalize_min``: the renormalising sum is clamped
      below at this value (ERNIE 4.5: 1e-12; 0: plain division); ``router_logit_scale``: the
      logits are multiplied by this before scoring (MuseSpark's ``output_multiplier``).
    - ``router_weights_on_input``: scale each expert's INPUT rows by the routing weight instead
      of its output (Llama 4); the outputs are then summed unweighted.
    - ``expert_act`` (see ``EXPERT_ACTIVATIONS``), ``expert_act_alpha``, ``expert_act_limit``,
      ``expert_linear_bias`` (biases on the experts' three projections: GPT-OSS),
      ``expert_act_up_limit`` (the up half's cap of ``softcapped_swiglu``; None: the limit),
      ``expert_gated`` (False: ``act(x w1) w2``, no ``w3``: Nemotron-H).
    - ``shared_expert_gate``: the shared expert's output is scaled by ``sigmoid(x g)``, with a
      learned ``g [dim, 1]`` (Qwen2-MoE).
    """

    moe_every: int | None = None
    num_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int | None = None
    num_shared_experts: int = 0
    router: str = "softmax"
    moe_dispatch: str = "dropless"
    capacity_factor: float = 1.25
    moe_bias_update_rate: float = 1e-3
    moe_aux_loss_coef: float = 0.0
    router_renormalize: bool | None = None
    router_scale: float = 1.0
    router_groups: int = 1
    router_topk_groups: int = 1
    router_group_top: int = 2
    router_bias: bool = False
    router_weights_on_input: bool = False
    expert_act: str = "silu"
    expert_act_alpha: float = 1.702
    expert_act_limit: float = 7.0
    expert_linear_bias: bool = False
    shared_expert_gate: bool = False
    router_choice: str = "scores"
    router_group_mask: str = "exclude"
    router_renormalize_min: float = 0.0
    router_logit_scale: float = 1.0
    expert_act_up_limit: float | None = None
    expert_gated: bool = True

    def __post_init__(self) -> None:
        check_field_types(self, "moe")
        if self.moe_every is None:  # NOTE: filled like ModelConfig's n_kv_heads and ffn_dim
            object.__setattr__(self, "moe_every", 1 if self.num_experts else 0)
        self._check_moe()

    def _check_moe(self) -> None:
        """Each MoE field alone, then the numbers and the blocks' shape (the one place these
        rules live: :class:`MoEModelConfig` runs them too)."""
        for name in ("moe_every", "num_experts", "num_shared_experts", "top_k"):
            check_int(f"moe.{name}", getattr(self, name), 0)
        for name in ("router_groups", "router_topk_groups", "router_group_top"):
            check_int(f"moe.{name}", getattr(self, name), 1)
        if self.moe_ffn_dim is not None:
            check_int("moe.moe_ffn_dim", self.moe_ffn_dim)
        for name, allowed in (
            ("router", MOE_ROUTERS),
            ("moe_dispatch", MOE_DISPATCH_MODES),
            ("expert_act", EXPERT_ACTIVATIONS),
            ("router_choice", ROUTER_CHOICES),
            ("router_group_mask", ROUTER_GROUP_MASKS),
        ):
            v = getattr(self, name)
            if v not in allowed:
                raise ForgeConfigError(
                    f"moe.{name}={v!r} is invalid: choose one of {list(allowed)}"
                    + did_you_mean(str(v), allowed)
                )
        if not self.expert_gated and self.expert_act in GATED_ONLY_ACTIVATIONS:
            raise ForgeConfigError(
                f"moe.expert_act={self.expert_act!r} reads the experts' up projection, which "
                "experts with moe.expert_gated=false do not have; choose one of "
                f"{[a for a in EXPERT_ACTIVATIONS if a not in GATED_ONLY_ACTIVATIONS]}"
            )
        if self.moe_every:
            self._check_moe_shape()
        self._check_numbers()

    def _check_numbers(self) -> None:
        """The MoE numbers: finite, in the range where they mean something (on a dense config
        too: a wrong value is wrong before an MoE block uses it)."""
        rate_why = (
            "the expert bias moves by up to this much per step and is added to routing scores "
            "in [0, 1] (DeepSeek-V3: 1e-3; 0 turns the update off)"
        )
        check_number("moe.moe_bias_update_rate", self.moe_bias_update_rate, 0, 1, why=rate_why)
        check_number(
            "moe.moe_aux_loss_coef",
            self.moe_aux_loss_coef,
            0,
            1,
            why="the balancing loss's weight next to the language-model loss (1e-3 to 1e-2 "
            "in practice; 0 turns it off)",
        )
        capacity = self.moe_every and self.moe_dispatch == "capacity"
        experts = max(self.num_experts, 1) if capacity else math.inf
        check_number(
            "moe.capacity_factor",
            self.capacity_factor,
            0,
            experts,
            lo_open=True,
            why="in the capacity mode 1.0 = each expert takes its even share of a sequence's "
            "tokens; at num_experts every expert has room for all of them, more only adds "
            "empty rows",
        )
        for name in ("router_scale", "router_logit_scale", "expert_act_alpha", "expert_act_limit"):
            check_number(f"moe.{name}", getattr(self, name), 0)
        check_number("moe.router_renormalize_min", self.router_renormalize_min, 0, 1)
        if self.expert_act_up_limit is not None:
            check_number("moe.expert_act_up_limit", self.expert_act_up_limit, 0, lo_open=True)

    def _check_moe_shape(self) -> None:
        """The MoE blocks' shape: experts, top-k and the router groups fit together."""
        if self.num_experts < 1:
            raise ForgeConfigError(
                f"moe.moe_every={self.moe_every} asks for MoE blocks but moe.num_experts="
                f"{self.num_experts}; set num_experts >= 1 (or moe_every=0 for a dense model)"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ForgeConfigError(
                f"moe.top_k={self.top_k} must be in [1, num_experts={self.num_experts}]"
            )
        groups, chosen = self.router_groups, self.router_topk_groups
        if self.num_experts % groups or chosen > groups:
            raise ForgeConfigError(
                f"moe.router_groups={groups} / router_topk_groups={chosen}: the groups must "
                f"divide num_experts={self.num_experts} and router_topk_groups <= router_groups"
            )
        if self.top_k > chosen * (self.num_experts // groups):
            raise ForgeConfigError(
                f"moe.top_k={self.top_k} is more than the {chosen} chosen groups of "
                f"{self.num_experts // groups} experts hold; raise router_topk_groups"
            )


@dataclass(frozen=True)
class MoEModelConfig(MoEConfig, ModelConfig):
    """The reference Transformer's shape (forge_core's ``ModelConfig``) with the MoE blocks of
    :class:`MoEConfig`: the one config :func:`~forge_moe_ep.moe_transformer` builds from.

    Its ``moe_every`` defaults to 0 (a dense model), and ``moe_ffn_dim`` to ``ffn_dim``. A forge
    config keeps the two parts apart (``[model]`` and ``[moe]``) and joins them with
    :meth:`from_parts`; :meth:`parts` splits them again.
    """

    moe_every: int = 0

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)

    def _check_fields(self) -> None:
        ModelConfig._check_fields(self)
        self._check_moe()
        if self.moe_ffn_dim is None:
            object.__setattr__(self, "moe_ffn_dim", self.ffn_dim)

    @classmethod
    def from_parts(cls, model: ModelConfig, moe: MoEConfig | None) -> MoEModelConfig:
        """The dense shape ``model`` with ``moe``'s MoE blocks (None: none, a dense model)."""
        blocks = {} if moe is None else {name: getattr(moe, name) for name in MOE_FIELDS}
        return cls.from_dense(model, **blocks)

    def parts(self) -> tuple[ModelConfig, MoEConfig | None]:
        """``(dense shape, MoE fields)``; the MoE part is None for a dense model
        (``moe_every = 0``)."""
        dense = ModelConfig(**{f.name: getattr(self, f.name) for f in fields(ModelConfig)})
        if not self.moe_every:
            return dense, None
        return dense, MoEConfig(**{name: getattr(self, name) for name in MOE_FIELDS})

    @property
    def size_fields(self) -> tuple[str, ...]:
        moe = ("num_experts", "moe_ffn_dim", "num_shared_experts") if self.moe_every else ()
        return (*super().size_fields, *moe)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` holds an MoE layer in its FFN slot."""
        return self.moe_every > 0 and (layer_id + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE blocks."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def custom_ffn_layers(self) -> tuple[int, ...]:
        return self.moe_layers

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        """forge_core's presets (dense: ``moe_every = 0``) and forge-moe-ep's ``MOE_PRESETS``."""
        return {**{name: cls.from_dense(c) for name, c in PRESETS.items()}, **MOE_PRESETS}

    @classmethod
    def from_dense(cls, config: ModelConfig, **moe: object) -> MoEModelConfig:
        """``config``'s shape with the MoE fields ``moe`` (none: still dense)."""
        dense: dict[str, Any] = {f.name: getattr(config, f.name) for f in fields(ModelConfig)}
        return cls(**dense, **moe)  # type: ignore[arg-type]  # NOTE: __post_init__ checks them

    def num_params(self) -> int:
        """Parameter count (tied weights counted once): the dense count with each MoE block's
        router, experts and shared expert in place of its dense FFN."""
        assert self.moe_ffn_dim
        d, h, e, n_moe = self.dim, self.moe_ffn_dim, self.num_experts, len(self.moe_layers)
        projections = 3 if self.expert_gated else 2
        moe_ffn = d * e + projections * d * h * e + 3 * d * h * self.num_shared_experts
        moe_ffn += e * self.router_bias + e * (projections - 1) * h * self.expert_linear_bias
        moe_ffn += e * d * self.expert_linear_bias
        moe_ffn += d * (self.shared_expert_gate and self.num_shared_experts > 0)
        return super().num_params() + n_moe * (moe_ffn - self.dense_ffn_params())


#: MoE presets (``model.preset``), next to forge_core's dense ones.
MOE_PRESETS: dict[str, ModelConfig] = {
    # debug with an MoE in every block: 8 experts, top-2, one shared expert.
    "debug_moe": replace(
        MoEModelConfig.from_dense(PRESETS["debug"]),
        moe_every=1,
        num_experts=8,
        top_k=2,
        moe_ffn_dim=64,
        num_shared_experts=1,
    ),
}


#: The names of the MoE fields (``[moe]``'s keys).
MOE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(MoEConfig))


def split_moe_fields(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``values`` (a ``[model]`` table) sorted into ``(dense fields and the rest, MoE fields)``:
    how a config or checkpoint written before ``[moe]`` existed is read."""
    dense = {k: v for k, v in values.items() if k not in MOE_FIELDS}
    return dense, {k: v for k, v in values.items() if k in MOE_FIELDS}

"""The shape of the reference Transformer: :class:`ModelConfig` and its named ``PRESETS``.

Pure Python (no torch import): the launcher loads and checks a config with it before any rank
starts, and a bad value is reported in well under a second instead of after torch's import.
:mod:`forge_core.model` builds the model from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import ForgeConfigError, check_field_types, did_you_mean

__all__ = ["MOE_DISPATCH_MODES", "MOE_ROUTERS", "PRESETS", "ModelConfig"]

MOE_ROUTERS = ("softmax", "sigmoid")
#: ``dropless``: exact, every routed token is computed (EP exchanges split sizes: one host wait
#: per MoE layer per forward). ``capacity``: each sequence sends at most a fixed number of tokens
#: to each expert (``capacity_factor``), the rest are dropped and counted; no host sync at all.
MOE_DISPATCH_MODES = ("dropless", "capacity")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference Transformer.

    ``n_kv_heads`` defaults to ``n_heads`` (plain multi-head attention); ``ffn_dim`` defaults to
    the Llama rule (8/3 x dim rounded up to a multiple of 64).

    Mixture of experts (``moe_every > 0``): block ``i`` is an MoE block when
    ``(i + 1) % moe_every == 0`` (1: every block). Each has ``num_experts`` SwiGLU experts of
    hidden size ``moe_ffn_dim`` (default ``ffn_dim``), a top-``top_k`` token-choice ``router``
    (``softmax`` or ``sigmoid`` scores, computed in float32), ``num_shared_experts`` always-on
    experts (one SwiGLU of hidden ``num_shared_experts * moe_ffn_dim``), and ``moe_dispatch``
    (see ``MOE_DISPATCH_MODES``) with ``capacity_factor`` for the capacity mode. Load balancing:
    ``moe_bias_update_rate`` (aux-loss-free expert bias, 0 disables it) and ``moe_aux_loss_coef``
    (auxiliary load-balancing loss, 0 disables it).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    moe_every: int = 0
    num_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int | None = None
    num_shared_experts: int = 0
    router: str = "softmax"
    moe_dispatch: str = "dropless"
    capacity_factor: float = 1.25
    moe_bias_update_rate: float = 1e-3
    moe_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        check_field_types(self, "model")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ForgeConfigError(f"model.{name}={v!r} must be a positive integer")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", 64 * math.ceil(8 * self.dim / 3 / 64))
        if self.dim % self.n_heads:
            raise ForgeConfigError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}"
            )
        if (
            not isinstance(self.n_kv_heads, int)
            or self.n_kv_heads < 1
            or self.n_heads % self.n_kv_heads
        ):
            raise ForgeConfigError(
                f"model.n_kv_heads={self.n_kv_heads!r} must be a positive divisor of "
                f"model.n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ForgeConfigError(
                f"head dim dim/n_heads={self.head_dim} must be even for rotary embeddings"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        def non_negative_int(name: str) -> int:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ForgeConfigError(f"model.{name}={v!r} must be a non-negative integer")
            return v

        for name in ("moe_every", "num_experts", "num_shared_experts", "top_k"):
            non_negative_int(name)
        if self.moe_ffn_dim is None:
            object.__setattr__(self, "moe_ffn_dim", self.ffn_dim)
        if not self.moe_every:
            return
        if self.num_experts < 1:
            raise ForgeConfigError(
                f"model.moe_every={self.moe_every} asks for MoE blocks but model.num_experts="
                f"{self.num_experts}; set num_experts >= 1 (or moe_every=0 for a dense model)"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ForgeConfigError(
                f"model.top_k={self.top_k} must be in [1, num_experts={self.num_experts}]"
            )
        if not isinstance(self.moe_ffn_dim, int) or self.moe_ffn_dim < 1:
            raise ForgeConfigError(f"model.moe_ffn_dim={self.moe_ffn_dim!r} must be >= 1")
        for name, allowed in (("router", MOE_ROUTERS), ("moe_dispatch", MOE_DISPATCH_MODES)):
            v = getattr(self, name)
            if v not in allowed:
                raise ForgeConfigError(
                    f"model.{name}={v!r} is invalid: choose one of {list(allowed)}"
                    + did_you_mean(str(v), allowed)
                )
        for name in ("capacity_factor", "moe_bias_update_rate", "moe_aux_loss_coef"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ForgeConfigError(f"model.{name}={v!r} must be a non-negative number")
        if self.capacity_factor <= 0:
            raise ForgeConfigError(
                f"model.capacity_factor={self.capacity_factor} must be > 0 (1.0 = each expert "
                "takes its even share of a sequence's tokens)"
            )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` holds an MoE layer in its FFN slot."""
        return self.moe_every > 0 and (layer_id + 1) % self.moe_every == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the MoE blocks."""
        return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset (see ``PRESETS``) with field overrides."""
        if not isinstance(name, str):
            raise ForgeConfigError(
                f"model.preset={name!r} must be a preset name (a string): one of {sorted(PRESETS)}"
            )
        if name not in PRESETS:
            raise ForgeConfigError(
                f"unknown model preset '{name}'{did_you_mean(name, PRESETS)}; presets: {sorted(PRESETS)}"
            )
        valid = {f.name for f in fields(cls)}
        for key in overrides:
            if key not in valid:
                raise ForgeConfigError(
                    f"unknown model field '{key}'{did_you_mean(key, valid)}; fields: {sorted(valid)}"
                )
        base = PRESETS[name]
        return replace(base, **overrides) if overrides else base

    def num_params(self) -> int:
        """Parameter count of the model this config builds (tied weights counted once)."""
        # NOTE: __post_init__ fills the defaults of the optional sizes
        assert self.ffn_dim and self.n_kv_heads and self.moe_ffn_dim
        d, f, kv = self.dim, self.ffn_dim, self.n_kv_heads * self.head_dim
        attention_and_norms = d * d * 2 + d * kv * 2 + 2 * d
        n_moe = len(self.moe_layers)
        moe_ffn = d * self.num_experts + 3 * d * self.moe_ffn_dim * (
            self.num_experts + self.num_shared_experts
        )
        blocks = self.n_layers * attention_and_norms + (self.n_layers - n_moe) * 3 * d * f
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + blocks + n_moe * moe_ffn + d + head


_DEBUG = ModelConfig(
    vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128
)

PRESETS: dict[str, ModelConfig] = {
    # Tiny and CPU-fast: every test and `forge build` use it.
    "debug": _DEBUG,
    "debug_tied": replace(_DEBUG, tie_embeddings=True),
    # debug with an MoE in every block: 8 experts, top-2, one shared expert.
    "debug_moe": replace(
        _DEBUG, moe_every=1, num_experts=8, top_k=2, moe_ffn_dim=64, num_shared_experts=1
    ),
    # The decoder of the debug vision-language model (forge_vlm.config.VLM_PRESETS has
    # its vision encoder and adapter).
    "debug_vlm": _DEBUG,
    # Not a token model: selects the [field] section's image-like model (forge_domain.config
    # FIELD_PRESETS, built by forge_domain.FieldNet); this decoder config is unused.
    "debug_field": _DEBUG,
    "small": ModelConfig(
        vocab_size=32000, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, max_seq_len=1024
    ),
    "llama3_8b": ModelConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}

"""The shape of the reference Transformer: :class:`ModelConfig` and its named ``PRESETS``.

Pure Python (no torch import): the launcher loads and checks a config with it before any rank
starts, and a bad value is reported in well under a second instead of after torch's import.
:mod:`forge_core.model` builds the model from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Self, cast

from .errors import (
    MAX_SIZE,
    ForgeConfigError,
    check_blocks,
    check_field_types,
    check_int,
    check_number,
    did_you_mean,
    params_problem,
)

__all__ = ["PRESETS", "ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference Transformer.

    ``n_kv_heads`` defaults to ``n_heads`` (plain multi-head attention); ``ffn_dim`` defaults to
    the Llama rule (8/3 x dim rounded up to a multiple of 64).

    Extension point: a config subclass may name blocks whose FFN slot holds its own module
    (:attr:`custom_ffn_layers`; forge-moe-ep's ``MoEModelConfig`` names its MoE blocks), built
    by the ``ffn_factory`` given to ``Transformer``. This class names none: a dense model.
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

    def __post_init__(self) -> None:
        self._check_fields()
        self._check_sizes()

    def _check_fields(self) -> None:
        """Each field alone and the dense shape's divisibility rules; a subclass extends it
        (calling this first) with its own fields, before :meth:`_check_sizes` runs."""
        check_field_types(self, "model")
        for name in ("vocab_size", "dim", "n_heads", "max_seq_len"):
            check_int(f"model.{name}", getattr(self, name))
        check_blocks("model.n_layers", self.n_layers)
        if self.ffn_dim is not None:
            check_int("model.ffn_dim", self.ffn_dim)
        check_number(
            "model.norm_eps",
            self.norm_eps,
            0,
            1,
            lo_open=True,
            hi_open=True,
            why="RMSNorm divides by sqrt(mean square + eps): 0 or less gives inf or NaN, 1 or "
            "more swamps the activations (1e-5 and 1e-6 are usual)",
        )
        check_number(
            "model.rope_theta",
            self.rope_theta,
            1,
            lo_open=True,
            why="the rotary frequencies theta**(-2i/head_dim) must fall with i; 0 or less gives "
            "inf or NaN (Llama 2: 10000, Llama 3: 500000)",
        )
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

    def _check_sizes(self) -> None:
        """What the sizes give together: the rotary tables every rank holds and the parameter
        count (:data:`~forge_core.errors.MAX_PARAMS`), both below what any machine can hold."""
        entries = self.max_seq_len * self.head_dim
        if entries > MAX_SIZE:
            raise ForgeConfigError(
                f"model.max_seq_len={self.max_seq_len} x head dim {self.head_dim} = {entries} "
                "rotary-table entries, more than 2**31 - 1 (every rank holds these tables in "
                "float32); lower model.max_seq_len"
            )
        sizes = ", ".join(f"{name}={getattr(self, name)}" for name in self.size_fields)
        too_many = params_problem("model", self.num_params(), sizes)
        if too_many:
            raise ForgeConfigError(too_many)

    @property
    def size_fields(self) -> tuple[str, ...]:
        """The size fields a too-large parameter count names (a subclass adds its own)."""
        return ("vocab_size", "dim", "n_layers", "ffn_dim")

    @property
    def custom_ffn_layers(self) -> tuple[int, ...]:
        """Blocks whose FFN slot a subclass fills with its own module (none: a dense model)."""
        return ()

    @classmethod
    def presets(cls) -> dict[str, ModelConfig]:
        """The named configs :meth:`preset` knows (a subclass adds its own)."""
        return PRESETS

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Self:
        """A named preset (see ``PRESETS``) with field overrides."""
        if not isinstance(name, str):
            raise ForgeConfigError(
                f"model.preset={name!r} must be a preset name (a string): one of "
                f"{sorted(cls.presets())}"
            )
        known = cls.presets()
        if name not in known:
            raise ForgeConfigError(
                f"unknown model preset '{name}'{did_you_mean(name, known)}; presets: {sorted(known)}"
            )
        valid = {f.name for f in fields(cls)}
        for key in overrides:
            if key not in valid:
                raise ForgeConfigError(
                    f"unknown model field '{key}'{did_you_mean(key, valid)}; fields: {sorted(valid)}"
                )
        base = cast(Self, known[name])  # NOTE: a class's presets are of that class
        return replace(base, **overrides) if overrides else base

    def num_params(self) -> int:
        """Parameter count of the dense model this config builds (tied weights counted once).

        A subclass with :attr:`custom_ffn_layers` adds its own modules' count and removes the
        dense FFNs they replace (:meth:`dense_ffn_params` each).
        """
        # NOTE: __post_init__ fills the defaults of the optional sizes
        assert self.n_kv_heads
        d, kv = self.dim, self.n_kv_heads * self.head_dim
        attention_and_norms = d * d * 2 + d * kv * 2 + 2 * d
        blocks = self.n_layers * (attention_and_norms + self.dense_ffn_params())
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + blocks + d + head

    def dense_ffn_params(self) -> int:
        """Parameters of one block's SwiGLU FFN."""
        assert self.ffn_dim
        return 3 * self.dim * self.ffn_dim


_DEBUG = ModelConfig(
    vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128
)

PRESETS: dict[str, ModelConfig] = {
    # Tiny and CPU-fast: every test and `forge build` use it.
    "debug": _DEBUG,
    "debug_tied": replace(_DEBUG, tie_embeddings=True),
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

"""The reference model: a Llama-style decoder that knows nothing about parallelism.

Module names are stable; TP plans, FSDP wrapping and AC refer to them:

=====================================  ==============================================
``tok_embeddings``                     token embedding ``[vocab_size, dim]``
``layers``                             ``nn.ModuleDict`` keyed ``"0" .. "n_layers-1"``
``layers.<i>.attention_norm``          RMSNorm before attention
``layers.<i>.attention.{wq,wk,wv,wo}`` grouped-query attention projections (no bias)
``layers.<i>.ffn_norm``                RMSNorm before the FFN slot
``layers.<i>.feed_forward``            the FFN slot: SwiGLU ``{w1, w2, w3}`` by default;
                                       any module mapping ``[B, S, dim] -> [B, S, dim]``
                                       (an MoE layer in the blocks ``is_moe_layer`` names)
``norm``                               final RMSNorm
``output``                             head ``[vocab_size, dim]`` (tied to the embedding
                                       when ``tie_embeddings``)
=====================================  ==============================================

MoE fields in :class:`ModelConfig` describe MoE blocks, but forge_core holds no MoE code (the
dependency rule): ``Transformer(config, ffn_factory=...)`` builds the FFN slot of those blocks
with a factory, e.g. ``forge_moe_ep.MoE.for_block``. A config with MoE blocks and no factory is
refused with that advice.

``layers`` is a ModuleDict (not a ModuleList) so that removing blocks (pipeline stages) keeps the
remaining names. Attention takes its local head count from the projection's output width, so a
column-sharded ``wq`` needs no change here. RoPE tables are non-persistent buffers recomputed by
:meth:`Transformer.init_weights`, which also fills every parameter deterministically (same values
sharded or not; see :mod:`forge_core.init`). Build it on the meta device, parallelize, then
``to_empty`` + ``init_weights``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import ForgeConfigError, check_field_types, did_you_mean
from .init import canonical_name, fill_param_
from .torch_compat import assert_on_device

__all__ = [
    "MOE_DISPATCH_MODES",
    "MOE_ROUTERS",
    "PRESETS",
    "Attention",
    "FeedForward",
    "FFNFactory",
    "ModelConfig",
    "Transformer",
    "TransformerBlock",
    "insert_embeddings",
]

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
    # The decoder of the debug vision-language model (forge_core.vlm_config.VLM_PRESETS has
    # its vision encoder and adapter).
    "debug_vlm": _DEBUG,
    # Not a token model: selects the [field] section's image-like model (forge_core.config
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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x [B, S, H, Dh]`` with tables ``[S, Dh]`` (rotate-half layout)."""
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        # NOTE: from the config, not from q/k shapes: under torch.compile with a dynamic batch
        # the inferred head counts are symbolic, and SDPA's enable_gqa needs a plain bool.
        self.gqa = config.n_kv_heads != config.n_heads
        kv_dim = config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        # Head counts come from the projection widths, so column-sharded weights just work.
        q = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        return self.wo(out.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


#: ``factory(config, layer_id) -> nn.Module``: builds the FFN slot of MoE block ``layer_id``.
FFNFactory = Callable[[ModelConfig, int], nn.Module]


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``h + ffn(norm(h))``.

    ``feed_forward`` may be any module (the MoE layer plugs in here).
    """

    def __init__(self, config: ModelConfig, feed_forward: nn.Module | None = None) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = (
            feed_forward if feed_forward is not None else FeedForward(config.dim, config.ffn_dim)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def insert_embeddings(
    h_BSD: torch.Tensor, embeds_BND: torch.Tensor, mask_BS: torch.Tensor
) -> torch.Tensor:
    """``h`` with its ``mask`` positions replaced, in order, by the rows of ``embeds``.

    Row ``i`` of sample ``b`` goes to the ``i``-th True position of ``mask[b]``. Every row of
    ``mask`` must hold exactly ``N`` True positions; that is checked on the device
    (``_assert_async``), so the check costs no host sync on a GPU. Gradients flow to both
    ``h`` (unmasked positions) and ``embeds``. Gather + where, no data-dependent shapes: works
    under torch.compile and leaves no host sync.
    """
    B, S, _ = h_BSD.shape
    N = embeds_BND.shape[1]
    if mask_BS.shape != (B, S) or embeds_BND.shape[0] != B:
        raise ForgeConfigError(
            f"insert_mask {tuple(mask_BS.shape)} must be [batch, seq] = {(B, S)} and "
            f"insert_embeds {tuple(embeds_BND.shape)} [batch, N, dim] with batch {B}"
        )
    if N > S:
        raise ForgeConfigError(f"{N} inserted embeddings per sample do not fit in {S} positions")
    counts = mask_BS.sum(dim=1)
    assert_on_device(
        (counts == N).all(),
        f"insert_mask must mark exactly {N} positions per sample (one per inserted embedding)",
    )
    slot_BS = (mask_BS.cumsum(dim=1) - 1).clamp(0, max(N - 1, 0))
    picked = torch.gather(embeds_BND, 1, slot_BS[..., None].expand(-1, -1, embeds_BND.shape[2]))
    return torch.where(mask_BS[..., None], picked.to(h_BSD.dtype), h_BSD)


class Transformer(nn.Module):
    """Llama-style decoder: ``forward(tokens [B, S]) -> logits [B, S, vocab_size]``."""

    def __init__(self, config: ModelConfig, ffn_factory: FFNFactory | None = None) -> None:
        super().__init__()
        if config.moe_layers and ffn_factory is None:
            raise ForgeConfigError(
                f"model config has MoE blocks {list(config.moe_layers)} (moe_every="
                f"{config.moe_every}) but no ffn_factory builds them: install forge-moe-ep and "
                "use forge_moe_ep.moe_transformer(config), or Transformer(config, "
                "ffn_factory=forge_moe_ep.MoE.for_block)"
            )
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerBlock(
                    config, ffn_factory(config, i) if config.is_moe_layer(i) else None
                )
                for i in range(config.n_layers)
            }
        )
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer(
            "rope_cos", torch.empty(config.max_seq_len, config.head_dim), persistent=False
        )
        self.register_buffer(
            "rope_sin", torch.empty(config.max_seq_len, config.head_dim), persistent=False
        )
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the head when ``tie_embeddings`` (``to_empty`` unties them)."""
        if self.config.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        insert_embeds: torch.Tensor | None = None,
        insert_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for ``tokens [B, S]``.

        ``insert_embeds [B, N, dim]`` with ``insert_mask [B, S]`` (N True positions per row):
        those positions take the given embeddings instead of their token's (see
        :func:`insert_embeddings`); a vision-language model puts projected image embeddings at
        its image placeholder tokens this way. Passed as forward arguments so that FSDP2's
        ``cast_forward_inputs`` casts them to the decoder's compute dtype.
        """
        S = tokens.shape[1]
        if self.config.max_seq_len < S:
            raise ForgeConfigError(
                f"sequence length {S} exceeds model.max_seq_len={self.config.max_seq_len}"
            )
        h = self.tok_embeddings(tokens)
        if (insert_embeds is None) != (insert_mask is None):
            raise ForgeConfigError("insert_embeds and insert_mask go together: pass both or none")
        if insert_embeds is not None:
            h = insert_embeddings(h, insert_embeds, insert_mask)
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        for block in self.layers.values():
            h = block(h, cos, sin)
        return self.output(self.norm(h))

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Recompute the rotary tables (float32) into the existing buffers."""
        c = self.config
        half = c.head_dim // 2
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))
        angles = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.rope_cos.copy_(angles.cos().float())
        self.rope_sin.copy_(angles.sin().float())

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Fill every parameter from ``seed``; identical values whether sharded or not.

        Embedding N(0, 0.02); input projections truncated N(0, 0.02); output projections
        (``wo``, ``w2``) scaled by ``1/sqrt(2 n_layers)``; head truncated N(0, dim^-0.5);
        norms one. A custom ``feed_forward`` module with its own ``init_weights(seed)`` is
        asked to initialize itself.
        """
        self.tie_weights()
        self.reset_rope()
        c = self.config
        depth_std = 0.02 / math.sqrt(2 * c.n_layers)
        # Modules whose class defines init_weights (e.g. an MoE in the FFN slot) own their init.
        custom = {
            n: m
            for n, m in self.named_modules()
            if m is not self and callable(getattr(type(m), "init_weights", None))
        }
        for fqn, param in self.named_parameters():
            if any(fqn.startswith(prefix + ".") for prefix in custom):
                continue
            name = canonical_name(fqn)
            leaf = name.rsplit(".", 2)
            if name.endswith("norm.weight"):
                fill_param_(param, name, seed, lambda t, g: t.fill_(1.0))
            elif name == "tok_embeddings.weight":
                fill_param_(param, name, seed, lambda t, g: t.normal_(0.0, 0.02, generator=g))
            elif name == "output.weight":
                std = c.dim**-0.5
                fill_param_(
                    param,
                    name,
                    seed,
                    lambda t, g, s=std: nn.init.trunc_normal_(
                        t, 0.0, s, -3 * s, 3 * s, generator=g
                    ),
                )
            elif leaf[-2] in ("wo", "w2"):
                fill_param_(
                    param,
                    name,
                    seed,
                    lambda t, g: nn.init.trunc_normal_(
                        t, 0.0, depth_std, -3 * depth_std, 3 * depth_std, generator=g
                    ),
                )
            else:
                fill_param_(
                    param,
                    name,
                    seed,
                    lambda t, g: nn.init.trunc_normal_(t, 0.0, 0.02, -0.06, 0.06, generator=g),
                )
        for m in custom.values():
            m.init_weights(seed)

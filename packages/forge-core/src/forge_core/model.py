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
                                       (in the blocks ``config.custom_ffn_layers`` names)
``norm``                               final RMSNorm
``output``                             head ``[vocab_size, dim]`` (tied to the embedding
                                       when ``tie_embeddings``)
=====================================  ==============================================

A config subclass may name blocks whose FFN slot holds another module
(``ModelConfig.custom_ffn_layers``; forge-moe-ep's ``MoEModelConfig`` names its MoE blocks):
``Transformer(config, ffn_factory=...)`` builds those slots with the factory (e.g.
``forge_moe_ep.MoE.for_block``); such a config without a factory is refused.

``layers`` is a ModuleDict (not a ModuleList) so that removing blocks (pipeline stages) keeps the
remaining names. A pipeline stage is a copy holding some blocks, with ``tok_embeddings`` (not the
first stage) or ``norm`` and ``output`` (not the last) set to None: it then takes hidden states
``[B, S, dim]`` instead of tokens, or returns them instead of logits (``forge_pipeline_parts``
names these parts for forge-pp). Attention takes its local head count from the projection's output width, so a
column-sharded ``wq`` needs no change here. RoPE tables are non-persistent buffers (never in a
checkpoint): computed at construction off the meta device, and again by
:meth:`Transformer.init_weights` and after every ``load_state_dict`` (so ``to_empty`` + a load,
or a model built on the CPU and loaded from safetensors, computes with them, never with
``torch.empty``'s leftovers). ``init_weights`` also fills every parameter deterministically (same
values sharded or not; see :mod:`forge_core.init`). Build it on the meta device, parallelize,
then ``to_empty`` + ``init_weights`` (or a load).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .contracts import causal_attention
from .documents import Documents
from .errors import ForgeConfigError
from .init import canonical_name, fill_param_
from .model_config import PRESETS, ModelConfig
from .torch_compat import assert_on_device

__all__ = [
    "PRESETS",
    "Attention",
    "FeedForward",
    "FFNFactory",
    "ModelConfig",
    "Transformer",
    "TransformerBlock",
    "check_sequence_length",
    "insert_embeddings",
]


def check_sequence_length(seq_len: int, max_seq_len: int) -> None:
    """Refuse sequences longer than the rotary tables (``model.max_seq_len``) with one line,
    instead of an IndexError deep in RoPE. The model's forward and a context-parallel rank's
    sequence shard (which alone sees the whole sequence's length) both ask here."""
    if seq_len > max_seq_len:
        raise ForgeConfigError(
            f"sequence length {seq_len} exceeds model.max_seq_len={max_seq_len} (the length of "
            f"the rotary tables); feed sequences of at most {max_seq_len} tokens "
            "(training.seq_len) or raise model.max_seq_len"
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x [B, S, H, Dh]`` with tables ``[S, Dh]``, or ``[B, S, Dh]`` when
    each row has positions of its own (packed documents); rotate-half layout."""
    cos = (cos[None] if cos.dim() == 2 else cos)[:, :, None, :].to(x.dtype)
    sin = (sin[None] if sin.dim() == 2 else sin)[:, :, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention through ``F.scaled_dot_product_attention``.

    ``forge_attention = "causal"``: the attention itself goes through
    :func:`forge_core.contracts.causal_attention`, so a layer may swap the kernel (context
    parallelism attends across sequence shards).
    """

    forge_attention = "causal"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        # NOTE: from the config, not from q/k shapes: under torch.compile with a dynamic batch
        # the inferred head counts are symbolic, and SDPA's enable_gqa needs a plain bool.
        self.gqa = config.n_kv_heads != config.n_heads
        assert config.n_kv_heads is not None  # NOTE: ModelConfig.__post_init__ fills it
        kv_dim = config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        # Head counts come from the projection widths, so column-sharded weights just work.
        q = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = causal_attention(self, q, k, v, enable_gqa=self.gqa, documents=documents)
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


#: ``factory(config, layer_id) -> nn.Module``: builds the FFN slot of block ``layer_id`` (one of
#: ``config.custom_ffn_layers``).
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
        if feed_forward is None:
            assert config.ffn_dim is not None  # NOTE: ModelConfig.__post_init__ fills it
            feed_forward = FeedForward(config.dim, config.ffn_dim)
        self.feed_forward = feed_forward

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, documents=documents)
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


def _recompute_rope(module: nn.Module, incompatible_keys: object) -> None:
    """``load_state_dict`` post-hook of :class:`Transformer`: recompute the rotary tables."""
    assert isinstance(module, Transformer)
    if not module.rope_cos.is_meta:
        module.reset_rope()


def _trunc_normal(std: float) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor]:
    """An init function: normal(0, std) truncated at 3 std."""
    return lambda t, g: nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=g)


class Transformer(nn.Module):
    """Llama-style decoder: ``forward(tokens [B, S]) -> logits [B, S, vocab_size]``."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    tok_embeddings: nn.Embedding | None
    norm: nn.RMSNorm | None
    output: nn.Linear | None
    #: The parts forge-pp splits into pipeline stages (``forge_core.contracts``, Pipeline stages).
    forge_pipeline_parts = {
        "first": ("tok_embeddings",),
        "blocks": "layers",
        "last": ("norm", "output"),
    }

    def __init__(self, config: ModelConfig, ffn_factory: FFNFactory | None = None) -> None:
        super().__init__()
        custom = config.custom_ffn_layers
        if custom and ffn_factory is None:
            raise ForgeConfigError(
                f"{type(config).__name__} puts its own FFN module in blocks {list(custom)}, but no "
                "ffn_factory builds it: pass Transformer(config, ffn_factory=...) (for MoE "
                "blocks, forge_moe_ep.moe_transformer(config))"
            )
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerBlock(
                    config,
                    ffn_factory(config, i) if ffn_factory is not None and i in custom else None,
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
        if not self.rope_cos.is_meta:  # NOTE: on meta, to_empty + init_weights (or a load) do it
            self.reset_rope()
        # NOTE: non-persistent: a load never fills them, so it recomputes them (after to_empty
        # they hold whatever memory torch.empty found).
        self.register_load_state_dict_post_hook(_recompute_rope)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the head when ``tie_embeddings`` (``to_empty`` unties them)."""
        if self.output is None or self.tok_embeddings is None:  # a pipeline stage: not both
            return
        if self.config.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        insert_embeds: torch.Tensor | None = None,
        insert_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """Logits for ``tokens [B, S]``.

        ``positions [S]`` (int64): the place of each token in its sequence, for RoPE; default
        ``0 .. S-1``. A context-parallel rank holds slices of each sequence and passes their
        global positions (``forge_core.contracts.set_sequence_shard``).

        Packed documents: ``positions [B, S]``, each token's place in its own document
        (restarting at 0 where one starts): RoPE takes them, and attention stays inside each
        document (:mod:`forge_core.documents`). A context-parallel rank, whose tokens are not
        in order, passes its tokens' positions with the whole sequence's ``documents``.

        ``insert_embeds [B, N, dim]`` with ``insert_mask [B, S]`` (N True positions per row):
        those positions take the given embeddings instead of their token's (see
        :func:`insert_embeddings`); a vision-language model puts projected image embeddings at
        its image placeholder tokens this way. Passed as forward arguments so that FSDP2's
        ``cast_forward_inputs`` casts them to the decoder's compute dtype.
        """
        S = tokens.shape[1]
        # NOTE: given positions, only their number is checked (their values would wait for the
        # device); a context-parallel rank's sequence shard has checked the whole length.
        check_sequence_length(
            S if positions is None else positions.shape[-1], self.config.max_seq_len
        )
        if documents is None and positions is not None and positions.dim() == 2:
            documents = Documents.from_positions(positions)
        # NOTE: a pipeline stage after the first has no embedding and gets hidden states.
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        if (insert_embeds is None) != (insert_mask is None):
            raise ForgeConfigError("insert_embeds and insert_mask go together: pass both or none")
        if insert_embeds is not None and insert_mask is not None:
            h = insert_embeddings(h, insert_embeds, insert_mask)
        if positions is None:
            cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        else:  # NOTE: not checked against max_seq_len here: that would wait for the device
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for block in self.layers.values():
            # NOTE: documents by keyword: tensor-parallel input preparation counts positional
            # inputs, and leaves keyword ones as they are.
            h = block(h, cos, sin) if documents is None else block(h, cos, sin, documents=documents)
        if self.norm is not None:  # NOTE: None on a pipeline stage before the last
            h = self.norm(h)
        return h if self.output is None else self.output(h)

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
                    _trunc_normal(std),
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

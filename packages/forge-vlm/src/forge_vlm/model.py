"""The vision-language model: a ViT encoder, an MLP adapter and forge's decoder, joined.

Module names (plans, FSDP units and AC refer to them):

====================================  =================================================
``encoder.patch_embed``               ``Conv2d(C, dim, patch, stride=patch)``
``encoder.pos_embed``                 learned positions ``[num_patches, dim]``
``encoder.layers.<i>``                pre-norm ViT block: ``norm1``, ``attention.{wq,wk,wv,wo}``,
                                      ``norm2``, ``mlp.{fc1,fc2}`` (biases, LayerNorm, GELU)
``encoder.norm``                      final LayerNorm
``adapter.{fc1,fc2}``                 ``Linear -> GELU -> Linear`` to the decoder's width
``decoder``                           the reference ``forge_core.Transformer``
====================================  =================================================

``VLMWrapper.forward(tokens [B, S], images [B, C, H, W])``: the encoder yields patch features,
the adapter pools and projects them to ``[B, N, dim]``, and the decoder takes them at the ``N``
positions where ``tokens == image_token_id`` (``Transformer.forward``'s ``insert_embeds``; a
gather and a where, no host sync). Everything is built on the meta device and materialized with
``init_weights(seed)``: identical values sharded or not, as for the decoder.

The ViT blocks opt into tensor parallelism with class attributes (``_tp_col`` / ``_tp_row``):
heads and the MLP hidden size are split, the block output is replicated (no sequence
parallelism in the encoder). The SigLIP tower carries the same layout as a ``_tp_plan``.
"""

from __future__ import annotations

import math
from typing import Protocol, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from forge_core import ForgeConfigError, ModelConfig, Transformer
from forge_core.init import canonical_name, fill_param_
from forge_core.model import FFNFactory

from .checks import check_vlm
from .config import (
    AdapterConfig,
    VisionEncoderConfig,
    VLMConfig,
    num_image_tokens,
)

__all__ = [
    "Adapter",
    "HFVisionEncoder",
    "VLMWrapper",
    "VisionAttention",
    "VisionBlock",
    "VisionEncoder",
    "build_vision_encoder",
    "build_vlm",
]


_OUTPUT_PROJECTIONS = ("wo", "fc2", "out_proj")


class _InitWeights(Protocol):
    """A VLM part that fills its own parameters from a seed."""

    def init_weights(self, seed: int = 0) -> None: ...


def _init_by_name(model: nn.Module, seed: int, depth_std: float) -> None:
    """Deterministic init, the same values sharded or not (each parameter from its own name's
    generator): norms weight 1 bias 0; biases 0; output projections truncated N(0, depth_std);
    every other weight and free parameter (positions) truncated N(0, 0.02)."""
    for mod_name, module in model.named_modules():
        is_norm = isinstance(module, nn.LayerNorm | nn.RMSNorm)
        for p_name, param in module.named_parameters(recurse=False):
            name = canonical_name(f"{mod_name}.{p_name}" if mod_name else p_name)
            if is_norm or p_name == "bias":
                value = 1.0 if is_norm and p_name == "weight" else 0.0

                def constant(t: torch.Tensor, g: torch.Generator, v: float = value) -> torch.Tensor:
                    return t.fill_(v)

                fill_param_(param, name, seed, constant)
                continue
            last = mod_name.rsplit(".", 1)[-1]
            std = depth_std if last in _OUTPUT_PROJECTIONS else 0.02

            def trunc_normal(t: torch.Tensor, g: torch.Generator, s: float = std) -> torch.Tensor:
                return nn.init.trunc_normal_(t, 0.0, s, -3 * s, 3 * s, generator=g)

            fill_param_(param, name, seed, trunc_normal)


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over patches (local heads from the projection width)."""

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.dim)
        self.wk = nn.Linear(config.dim, config.dim)
        self.wv = nn.Linear(config.dim, config.dim)
        self.wo = nn.Linear(config.dim, config.dim)

    def forward(self, x_BND: torch.Tensor) -> torch.Tensor:
        B, N, _ = x_BND.shape
        q, k, v = (
            proj(x_BND).view(B, N, -1, self.head_dim).transpose(1, 2)
            for proj in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(B, N, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm ViT block: ``x + attn(norm1(x))`` then ``h + mlp(norm2(h))``."""

    # Tensor-parallel opt-in (forge_tp_plans reads these): column-split the input projections,
    # row-split the output ones; each block's output is replicated on the tp ranks.
    _tp_col = ("attention.wq", "attention.wk", "attention.wv", "mlp.fc1")
    _tp_row = ("attention.wo", "mlp.fc2")

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.attention = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        assert config.mlp_dim is not None  # VisionEncoderConfig.__post_init__ fills it in
        self.mlp = VisionMLP(config.dim, config.mlp_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.norm1(x))
        return h + self.mlp(self.norm2(h))


class VisionEncoder(nn.Module):
    """forge's ViT: ``forward(images [B, C, H, W]) -> patch features [B, num_patches, dim]``."""

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = nn.Conv2d(
            config.in_channels, config.dim, config.patch_size, stride=config.patch_size
        )
        self.pos_embed = nn.Parameter(torch.empty(config.num_patches, config.dim))
        self.layers = nn.ModuleDict({str(i): VisionBlock(config) for i in range(config.n_layers)})
        self.norm = nn.LayerNorm(config.dim, eps=config.norm_eps)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c = self.config
        if images.shape[1:] != (c.in_channels, c.image_size, c.image_size):
            raise ForgeConfigError(
                f"images of shape {tuple(images.shape)}: the encoder takes "
                f"[batch, {c.in_channels}, {c.image_size}, {c.image_size}] (vision.in_channels, "
                "vision.image_size)"
            )
        h = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.layers.values():
            h = block(h)
        return self.norm(h)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        _init_by_name(self, seed, 0.02 / math.sqrt(2 * self.config.n_layers))


class HFVisionEncoder(nn.Module):
    """Hugging Face's SigLIP vision tower built from a config (random weights, nothing
    downloaded): ``forward(images) -> last_hidden_state [B, num_patches, dim]``."""

    # Same layout as forge's ViT, in SigLIP's module names (forge_tp_plans reads it).
    _tp_plan = {
        "model.encoder.layers.*.self_attn.q_proj": "colwise",
        "model.encoder.layers.*.self_attn.k_proj": "colwise",
        "model.encoder.layers.*.self_attn.v_proj": "colwise",
        "model.encoder.layers.*.self_attn.out_proj": "rowwise",
        "model.encoder.layers.*.mlp.fc1": "colwise",
        "model.encoder.layers.*.mlp.fc2": "rowwise",
    }

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        try:
            from transformers import SiglipVisionConfig, SiglipVisionModel
        except ImportError:
            raise ForgeConfigError(
                "vision.backend='siglip' needs transformers: pip install 'forge-vlm[hf]'"
            ) from None
        self.config = config
        assert config.mlp_dim is not None  # VisionEncoderConfig.__post_init__ fills it in
        hf_config = SiglipVisionConfig(
            hidden_size=config.dim,
            intermediate_size=config.mlp_dim,
            num_hidden_layers=config.n_layers,
            num_attention_heads=config.n_heads,
            num_channels=config.in_channels,
            image_size=config.image_size,
            patch_size=config.patch_size,
            layer_norm_eps=config.norm_eps,
            vision_use_head=False,
        )
        hf_config._attn_implementation = "sdpa"
        self.model = SiglipVisionModel(hf_config)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=images).last_hidden_state

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        _init_by_name(self, seed, 0.02 / math.sqrt(2 * self.config.n_layers))
        for module in self.modules():  # the position-id buffer is empty after to_empty
            ids = getattr(module, "position_ids", None)
            if isinstance(ids, torch.Tensor):
                ids.copy_(torch.arange(ids.shape[-1], device=ids.device).expand_as(ids))


def build_vision_encoder(config: VisionEncoderConfig) -> nn.Module:
    """forge's ViT or the SigLIP tower, as ``config.backend`` says."""
    return HFVisionEncoder(config) if config.backend == "siglip" else VisionEncoder(config)


class Adapter(nn.Module):
    """``[B, num_patches, vision dim] -> [B, N, decoder dim]``: optional ``pool x pool`` average
    pooling over the patch grid, then ``fc2(gelu(fc1(x)))``."""

    def __init__(self, config: AdapterConfig, in_dim: int, out_dim: int, grid: int) -> None:
        super().__init__()
        if config.out_dim is not None and config.out_dim != out_dim:
            raise ForgeConfigError(
                f"adapter.out_dim={config.out_dim} differs from the decoder's dim={out_dim}; set "
                "them equal (or leave adapter.out_dim unset)"
            )
        if grid % config.pool:
            raise ForgeConfigError(f"adapter.pool={config.pool} does not divide the grid {grid}")
        self.pool, self.grid = config.pool, grid
        hidden = config.hidden_dim or out_dim
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim)

    def forward(self, features_BPD: torch.Tensor) -> torch.Tensor:
        x = features_BPD
        if self.pool > 1:
            B, _, D = x.shape
            x = x.transpose(1, 2).reshape(B, D, self.grid, self.grid)
            x = F.avg_pool2d(x, self.pool).flatten(2).transpose(1, 2)
        return self.fc2(F.gelu(self.fc1(x)))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        _init_by_name(self, seed, 0.02)


class VLMWrapper(nn.Module):
    """``forward(tokens [B, S], images [B, C, H, W]) -> logits [B, S, vocab]``.

    Its parts are components (``forge_components``): FSDP2, AC and compile treat each on its
    own, and the stage-order contract runs per component.
    """

    forge_components = ("encoder", "adapter", "decoder")
    #: Pipeline stages (forge-pp): the encoder and adapter go with the first stage; a later
    #: stage has neither and takes the decoder's hidden states.
    forge_pipeline_parts = {
        "first": ("encoder", "adapter", "decoder.tok_embeddings"),
        "blocks": "decoder.layers",
        "last": ("decoder.norm", "decoder.output"),
    }

    def __init__(
        self,
        encoder: nn.Module,
        adapter: nn.Module,
        decoder: Transformer,
        *,
        image_token_id: int,
        image_tokens: int,
    ) -> None:
        super().__init__()
        self.encoder, self.adapter, self.decoder = encoder, adapter, decoder
        self.config = decoder.config  # the training harness reads vocab_size from here
        self.image_token_id = image_token_id
        self.image_tokens = image_tokens

    def forward(self, tokens: torch.Tensor, images: torch.Tensor | None = None) -> torch.Tensor:
        if self.encoder is None:  # a pipeline stage after the first: hidden states in
            return self.decoder(tokens)
        if images is None:
            raise ForgeConfigError("a vision-language model takes images with its tokens")
        if tokens.shape[1] < self.image_tokens:
            raise ForgeConfigError(
                f"a sequence of {tokens.shape[1]} tokens cannot hold the {self.image_tokens} "
                "image tokens of an image; lengthen it or pool more (adapter.pool)"
            )
        if images.shape[0] != tokens.shape[0]:
            raise ForgeConfigError(
                f"{images.shape[0]} images for {tokens.shape[0]} sequences: one image per sequence"
            )
        image_embeds = self.adapter(self.encoder(images))
        return self.decoder(tokens, image_embeds, tokens == self.image_token_id)

    def freeze_encoder(self) -> None:
        """The encoder gets no gradients (and so no optimizer state in forge's loop)."""
        self.encoder.requires_grad_(False)

    @property
    def encoder_frozen(self) -> bool:
        """Whether the encoder gets no gradients (False on a pipeline stage without it)."""
        if self.encoder is None:
            return False
        return not any(p.requires_grad for p in self.encoder.parameters())

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Each part from its own seed stream (names repeat between encoder and decoder)."""
        self.decoder.init_weights(seed)
        # cast: a VLM's encoder and adapter define init_weights(seed) (forge's own parts do);
        # nn.Module's __getattr__ is typed Tensor | Module, which hides the method from mypy.
        # Both are None on a pipeline stage after the first.
        if self.encoder is not None:
            cast(_InitWeights, self.encoder).init_weights(seed + 1)
        if self.adapter is not None:
            cast(_InitWeights, self.adapter).init_weights(seed + 2)


def build_vlm(
    model_config: ModelConfig,
    vision_config: VisionEncoderConfig,
    adapter_config: AdapterConfig,
    vlm_config: VLMConfig,
    *,
    ffn_factory: FFNFactory | None = None,
) -> VLMWrapper:
    """Build the VLM (on the current default device, e.g. under ``torch.device('meta')``).

    Checks the configs against each other first (:func:`forge_vlm.checks.check_vlm`).
    ``ffn_factory`` builds the decoder's MoE blocks, as for ``Transformer``.
    """
    check_vlm(model_config, vision_config, adapter_config, vlm_config)
    token_id = (
        model_config.vocab_size - 1
        if vlm_config.image_token_id is None
        else vlm_config.image_token_id
    )
    model = VLMWrapper(
        build_vision_encoder(vision_config),
        Adapter(adapter_config, vision_config.dim, model_config.dim, vision_config.grid),
        Transformer(model_config, ffn_factory),
        image_token_id=token_id,
        image_tokens=num_image_tokens(vision_config, adapter_config),
    )
    if vlm_config.freeze_encoder:
        model.freeze_encoder()
    return model

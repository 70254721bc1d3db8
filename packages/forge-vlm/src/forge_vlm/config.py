"""Vision-language model configs: the vision encoder, the adapter, and how they meet the decoder.

Pure Python (no torch import), so that ``forge.load_config`` can read the ``[vision]``,
``[adapter]`` and ``[vlm]`` sections and reject a bad combination before any process group
exists; :mod:`forge_vlm.model` builds the modules from them.

A VLM here is ``VLMWrapper(encoder, adapter, decoder)``: a ViT turns ``[B, C, H, W]`` images into
``(H/p) x (W/p)`` patch features, the adapter (an MLP projector, optionally average-pooling
``pool x pool`` patches into one token) maps them to the decoder's width, and the decoder (the
reference Transformer) sees them at the image placeholder positions of its token sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from forge_core.errors import (
    ForgeConfigError,
    auto_flag,
    check_auto_flag,
    check_blocks,
    check_field_types,
    check_int,
    check_number,
    did_you_mean,
    params_problem,
)

__all__ = [
    "AC_SCOPES",
    "AdapterConfig",
    "VISION_BACKENDS",
    "VLM_DECODER_PRESETS",
    "VLM_DESIGNS",
    "VLM_PRESETS",
    "VLMConfig",
    "VisionEncoderConfig",
    "num_image_tokens",
]

#: ``forge``: forge's own ViT. ``siglip``: Hugging Face's ``SiglipVisionModel`` built from a
#: ``SiglipVisionConfig`` with these fields (random weights; needs transformers).
VISION_BACKENDS = ("forge", "siglip")
#: ``joint``: projected image embeddings replace the image placeholder tokens of the sequence,
#: and the decoder attends over text and image positions alike.
VLM_DESIGNS = ("joint",)
#: Which components ``ac_mode`` checkpoints: ``all`` (encoder and decoder), ``language``
#: (decoder), ``vision`` (encoder). The adapter has no blocks and is never checkpointed.
AC_SCOPES = ("all", "language", "vision")


def _positive_int(section: str, obj: object, name: str) -> None:
    check_int(f"{section}.{name}", getattr(obj, name))


def _choice(key: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ForgeConfigError(
            f"{key}={value!r} is invalid: choose one of {list(allowed)}"
            + did_you_mean(str(value), allowed)
        )


@dataclass(frozen=True)
class VisionEncoderConfig:
    """Shape of the vision encoder (a pre-norm ViT).

    ``image_size`` must be a multiple of ``patch_size``; the encoder yields
    ``(image_size / patch_size) ** 2`` patch features of width ``dim``. ``mlp_dim`` defaults to
    ``4 * dim``. ``backend`` picks forge's ViT or Hugging Face's SigLIP vision tower.
    """

    image_size: int = 16
    patch_size: int = 4
    in_channels: int = 3
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    mlp_dim: int | None = None
    norm_eps: float = 1e-6
    backend: str = "forge"

    def __post_init__(self) -> None:
        check_field_types(self, "vision")
        for name in ("image_size", "patch_size", "in_channels", "dim", "n_heads"):
            _positive_int("vision", self, name)
        check_blocks("vision.n_layers", self.n_layers)
        if self.mlp_dim is None:
            object.__setattr__(self, "mlp_dim", 4 * self.dim)
        _positive_int("vision", self, "mlp_dim")
        check_number(
            "vision.norm_eps",
            self.norm_eps,
            0,
            1,
            lo_open=True,
            hi_open=True,
            why="LayerNorm divides by sqrt(variance + eps): 0 or less gives inf or NaN, 1 or "
            "more swamps the activations (1e-6 is usual)",
        )
        _choice("vision.backend", self.backend, VISION_BACKENDS)
        if self.image_size % self.patch_size:
            raise ForgeConfigError(
                f"vision.image_size={self.image_size} is not divisible by vision.patch_size="
                f"{self.patch_size}; choose a patch size in "
                f"{[p for p in range(1, self.image_size + 1) if self.image_size % p == 0]}"
            )
        if self.dim % self.n_heads:
            raise ForgeConfigError(
                f"vision.dim={self.dim} is not divisible by vision.n_heads={self.n_heads}"
            )
        sizes = f"dim={self.dim}, n_layers={self.n_layers}, mlp_dim={self.mlp_dim}"
        too_many = params_problem("the vision encoder", self.num_params(), sizes)
        if too_many:
            raise ForgeConfigError(too_many)

    def num_params(self) -> int:
        """About the encoder's parameter count: patch embedding, positions, blocks (attention
        and MLP weights). NOTE: for the size check only: biases and norms are left out."""
        assert self.mlp_dim is not None  # NOTE: __post_init__ fills it
        d, patch = self.dim, self.in_channels * self.patch_size**2 * self.dim
        return patch + self.num_patches * d + self.n_layers * (4 * d * d + 2 * d * self.mlp_dim)

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid**2

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class AdapterConfig:
    """The projector from vision features to the decoder's width.

    ``pool``: average ``pool x pool`` neighbouring patches into one image token (1 = keep every
    patch), which divides the image tokens by ``pool ** 2``. Then ``Linear(vision dim, hidden)
    -> GELU -> Linear(hidden, out_dim)``. ``hidden_dim`` defaults to ``out_dim``; ``out_dim``
    defaults to the decoder's ``dim`` and must equal it.
    """

    pool: int = 1
    hidden_dim: int | None = None
    out_dim: int | None = None

    def __post_init__(self) -> None:
        check_field_types(self, "adapter")
        _positive_int("adapter", self, "pool")
        for name in ("hidden_dim", "out_dim"):
            if getattr(self, name) is not None:
                _positive_int("adapter", self, name)


@dataclass(frozen=True)
class VLMConfig:
    """How the parts are joined and parallelized.

    - ``design``: see ``VLM_DESIGNS``.
    - ``image_token_id``: the placeholder token id; None = the decoder's last vocabulary id.
      Each sample holds exactly as many placeholders as the adapter makes image tokens.
    - ``freeze_encoder``: the encoder's parameters get no gradients and no optimizer state.
    - ``shard_frozen_encoder``: ``"auto"`` keeps a frozen encoder replicated (no FSDP2 all-gather
      at all) when its weights take at most as much memory as this rank's shard of the trainable
      parameters with their gradients and AdamW state (16 bytes per trainable parameter / DP
      degree), and shards it per block otherwise; true / false force it.
    - ``encoder_tp``: split the encoder over the ``tp`` axis too (heads and MLP hidden), with its
      own plan (``encoder_tp_plan`` import path, else the encoder's built-in plan). The decoder
      uses ``[tp]``'s plan.
    - ``ac_scope``: see ``AC_SCOPES``.
    """

    design: str = "joint"
    image_token_id: int | None = None
    freeze_encoder: bool = False
    shard_frozen_encoder: bool | str = "auto"
    encoder_tp: bool = False
    encoder_tp_plan: str | None = None
    ac_scope: str = "all"

    def __post_init__(self) -> None:
        check_field_types(self, "vlm")
        _choice("vlm.design", self.design, VLM_DESIGNS)
        _choice("vlm.ac_scope", self.ac_scope, AC_SCOPES)
        check_auto_flag("vlm.shard_frozen_encoder", self.shard_frozen_encoder)
        for name in ("freeze_encoder", "encoder_tp"):
            if not isinstance(getattr(self, name), bool):
                raise ForgeConfigError(f"vlm.{name}={getattr(self, name)!r} must be true or false")
        if self.image_token_id is not None:
            check_int("vlm.image_token_id", self.image_token_id, 0)
        if self.encoder_tp_plan is not None and not isinstance(self.encoder_tp_plan, str):
            raise ForgeConfigError(
                f"vlm.encoder_tp_plan={self.encoder_tp_plan!r} must be an import path "
                "'package.module:NAME'"
            )

    @property
    def shard_frozen_flag(self) -> bool | None:
        """None for ``"auto"``, else the bool."""
        return auto_flag(self.shard_frozen_encoder)


def num_image_tokens(vision: VisionEncoderConfig, adapter: AdapterConfig) -> int:
    """Image tokens per image that the decoder sees."""
    return (vision.grid // adapter.pool) ** 2


#: Model presets that are VLMs: the vision encoder, adapter and ``[vlm]`` settings of each; its
#: decoder is the reference decoder preset ``VLM_DECODER_PRESETS[name]`` (forge_core's PRESETS).
VLM_PRESETS: dict[str, tuple[VisionEncoderConfig, AdapterConfig, VLMConfig]] = {
    # 16x16 images in 4x4 patches: 16 image tokens of the debug decoder's width.
    "debug_vlm": (VisionEncoderConfig(), AdapterConfig(), VLMConfig()),
}
VLM_DECODER_PRESETS: dict[str, str] = {"debug_vlm": "debug"}

"""Pure checks of a vision-language layout (no torch import: a launcher runs them on the config
before any rank starts).

:func:`vlm_problems`, :func:`encoder_tp_problems` and :func:`ac_scope_problems` return every
problem as a one-line message (empty: fine); :func:`check_vlm`, :func:`check_encoder_tp` and
:func:`ac_components` raise the first of them (for the apply paths)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from forge_core.errors import did_you_mean, refuse

from .config import AC_SCOPES, num_image_tokens

if TYPE_CHECKING:
    from forge_core.model_config import ModelConfig

    from .config import AdapterConfig, VisionEncoderConfig, VLMConfig

__all__ = [
    "ac_components",
    "ac_scope_problems",
    "check_encoder_tp",
    "check_vlm",
    "encoder_tp_problems",
    "vlm_problems",
]

_AC_TABLE = {"all": ("encoder", "decoder"), "language": ("decoder",), "vision": ("encoder",)}


def vlm_problems(
    decoder: ModelConfig,
    vision: VisionEncoderConfig,
    adapter: AdapterConfig,
    vlm: VLMConfig,
    *,
    seq_len: int | None = None,
    tp: int = 1,
) -> list[str]:
    """Every cross-config problem of a VLM: the patch grid against ``adapter.pool``, the
    adapter's width, the image token id, the image tokens against the sequence (``seq_len``, or
    ``model.max_seq_len`` when None) and, with ``vlm.encoder_tp``, the encoder against ``tp``."""
    problems = []
    if vision.grid % adapter.pool:
        problems.append(
            f"adapter.pool={adapter.pool} does not divide the {vision.grid} x {vision.grid} patch "
            f"grid (vision.image_size / vision.patch_size); choose a pool in "
            f"{[p for p in range(1, vision.grid + 1) if vision.grid % p == 0]}"
        )
    if adapter.out_dim is not None and adapter.out_dim != decoder.dim:
        problems.append(
            f"adapter.out_dim={adapter.out_dim} differs from the decoder's model.dim={decoder.dim}: "
            "image embeddings must have the decoder's width; set adapter.out_dim = model.dim "
            "(or leave it unset)"
        )
    token_id = decoder.vocab_size - 1 if vlm.image_token_id is None else vlm.image_token_id
    if token_id >= decoder.vocab_size:
        problems.append(
            f"vlm.image_token_id={token_id} is outside the decoder's vocabulary "
            f"(model.vocab_size={decoder.vocab_size})"
        )
    n_img = num_image_tokens(vision, adapter)
    limit, what = (
        (decoder.max_seq_len, "model.max_seq_len")
        if seq_len is None
        else (seq_len, "training.seq_len")
    )
    if n_img > limit:
        problems.append(
            f"each image becomes {n_img} tokens ((vision.image_size/patch_size/adapter.pool)^2) "
            f"but the sequence holds {limit} ({what}); raise adapter.pool or patch_size, or "
            "lengthen the sequence"
        )
    if vlm.encoder_tp and tp > 1:
        problems += encoder_tp_problems(vision, tp)
    return problems


def check_vlm(
    decoder: ModelConfig,
    vision: VisionEncoderConfig,
    adapter: AdapterConfig,
    vlm: VLMConfig,
    *,
    seq_len: int | None = None,
    tp: int = 1,
) -> None:
    """Raise the first of :func:`vlm_problems` (a ``ForgeConfigError``); pure, like it."""
    refuse(vlm_problems(decoder, vision, adapter, vlm, seq_len=seq_len, tp=tp))


def check_encoder_tp(vision: VisionEncoderConfig, tp: int) -> None:
    """Raise the first of :func:`encoder_tp_problems` (a ``ForgeConfigError``)."""
    refuse(encoder_tp_problems(vision, tp))


def encoder_tp_problems(vision: VisionEncoderConfig, tp: int) -> list[str]:
    """The encoder's own TP problems: heads and the MLP hidden size must split over ``tp``."""
    problems = []
    if vision.n_heads % tp:
        divisors = [d for d in range(1, vision.n_heads + 1) if vision.n_heads % d == 0]
        problems.append(
            f"tp={tp} does not divide vision.n_heads={vision.n_heads} (the encoder's heads are "
            f"split across the tp ranks); choose tp in {divisors} or set vlm.encoder_tp=false"
        )
    mlp_dim = vision.mlp_dim  # set to 4 * dim by VisionEncoderConfig when left out
    if mlp_dim is not None and mlp_dim % tp:
        problems.append(
            f"tp={tp} does not divide vision.mlp_dim={mlp_dim} (the encoder's MLP hidden "
            "size is split across the tp ranks); change mlp_dim or set vlm.encoder_tp=false"
        )
    return problems


def ac_scope_problems(scope: str, frozen_encoder: bool = False) -> list[str]:
    """``[message]`` when ``ac_scope`` is unknown, or ``vision`` with a frozen encoder."""
    if scope not in _AC_TABLE:
        return [
            f"ac_scope={scope!r} is invalid: choose one of {list(AC_SCOPES)}"
            + did_you_mean(str(scope), AC_SCOPES)
        ]
    if frozen_encoder and scope == "vision":
        return [
            "ac_scope='vision' with a frozen encoder: the encoder keeps no activations for "
            "backward, so checkpointing it saves nothing; use ac_scope='language' or 'all'"
        ]
    return []


def ac_components(scope: str, frozen_encoder: bool = False) -> tuple[str, ...]:
    """The components ``ac_scope`` checkpoints (``all`` | ``language`` | ``vision``).

    A frozen encoder keeps no activations for backward, so checkpointing it saves nothing: it
    is left out of ``all``, and ``vision`` alone is refused.
    """
    refuse(ac_scope_problems(scope, frozen_encoder))
    return tuple(c for c in _AC_TABLE[scope] if not (frozen_encoder and c == "encoder"))

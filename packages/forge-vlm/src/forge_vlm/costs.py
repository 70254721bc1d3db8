"""What a vision-language model adds to a training step's activations, for ``forge plan``: the
vision encoder (when trained), the adapter and the image embeddings, all made before the
decoder's first block."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import ac_components
from .config import AdapterConfig, VisionEncoderConfig, VLMConfig, num_image_tokens

__all__ = ["VLMActivations", "vlm_activation_bytes"]


@dataclass(frozen=True)
class VLMActivations:
    """Bytes a VLM's vision side keeps per micro-batch: ``none`` without AC, ``full`` under
    AC full (a checkpointed ViT block keeps its input), ``recompute``: one ViT block recomputed
    in backward (0 when the encoder is not checkpointed); ``selective`` (each ViT attention
    checkpointed) and ``op`` (a ViT block keeps its input and its matmul and SDPA outputs) with
    what their backward recomputes at once."""

    none: int
    full: int
    recompute: int
    selective: int = 0
    selective_recompute: int = 0
    op: int = 0
    op_recompute: int = 0


def vlm_activation_bytes(
    vision: VisionEncoderConfig,
    adapter: AdapterConfig,
    vlm: VLMConfig,
    *,
    b: int,
    s: int,
    dim: int,
    tp: int,
    itemsize: int,
) -> VLMActivations:
    """The vision side of ``b`` samples of ``s`` tokens (decoder width ``dim``, ``tp`` ranks):
    the patch embeddings, the adapter's hidden and output rows and the merged image tokens
    (``9 b s`` for the image-token mask and positions; the pooled patches when the adapter
    pools); a trained ViT adds per block its LayerNorm inputs/outputs and mean/rstd, q/k/v/out,
    logsumexp and GELU MLP (its heads and MLP split over tp with ``encoder_tp``), and the stem."""
    e, v, a = itemsize, vision, adapter
    n, n_img, tv = v.num_patches, num_image_tokens(v, a), tp if vlm.encoder_tp else 1
    extra = b * n * v.dim * e + 2 * b * n_img * (a.hidden_dim or dim) * e + b * n_img * dim * e
    extra += 9 * b * s + (b * n_img * v.dim * e if a.pool > 1 else 0)
    if vlm.freeze_encoder:
        return VLMActivations(extra, extra, 0, extra, 0, extra, 0)
    mlp, d = v.mlp_dim, v.dim
    assert mlp  # filled in by VisionEncoderConfig.__post_init__
    attn = 4 * b * n * (d // tv) * e + 4 * b * n * (v.n_heads // tv)  # q, k, v, out; logsumexp
    vit = 4 * b * n * d * e + 16 * b * n + attn + 2 * b * n * (mlp // tv) * e
    stem = b * v.in_channels * v.image_size**2 * e + b * n * d * e + 8 * b * n
    # op: the block's input; q, k, v, SDPA's output and logsumexp; wo's, fc1's and fc2's outputs
    op = b * n * d * e + attn + 2 * b * n * d * e + b * n * (mlp // tv) * e
    if "encoder" not in ac_components(vlm.ac_scope, vlm.freeze_encoder):
        none = extra + v.n_layers * vit + stem
        return VLMActivations(none, none, 0, none, 0, none, 0)
    return VLMActivations(
        none=extra + v.n_layers * vit + stem,
        full=extra + v.n_layers * b * n * d * e + stem,
        recompute=vit,
        selective=extra + v.n_layers * (vit - attn) + stem,
        selective_recompute=attn,
        op=extra + v.n_layers * op + stem,
        op_recompute=max(0, vit - (op - b * n * d * e)),
    )

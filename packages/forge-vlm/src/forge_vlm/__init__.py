"""forge_vlm: vision-language models that every forge parallelism applies to.

- :class:`VLMWrapper` ``(encoder, adapter, decoder)`` with ``forward(tokens, images)``: the joint-
  decoder design, where projected image embeddings replace the image placeholder tokens
- :class:`VisionEncoder` (forge's ViT) or :class:`HFVisionEncoder` (Hugging Face SigLIP from a
  config), :class:`Adapter` (MLP projector with optional token pooling), :func:`build_vlm`
- configs (defined in forge_core so config files can hold them): :class:`VisionEncoderConfig`,
  :class:`AdapterConfig`, :class:`VLMConfig`

The wrapper declares its components, so forge-fsdp-wrap shards encoder blocks, encoder, adapter,
decoder blocks, decoder and root as separate FSDP2 units, AC picks components by scope, and the
stage-order contract holds per component. Tensor parallelism is applied per component (the
decoder with the reference plan, the encoder with its own plan from class attributes). Depends
on forge_core and torch (transformers only for the SigLIP tower).
"""

from forge_core.errors import ForgeConfigError, did_you_mean
from forge_core.vlm_config import (
    AC_SCOPES,
    VLM_PRESETS,
    AdapterConfig,
    VisionEncoderConfig,
    VLMConfig,
    check_encoder_tp,
    check_vlm,
    num_image_tokens,
)

from .model import (
    Adapter,
    HFVisionEncoder,
    VisionBlock,
    VisionEncoder,
    VLMWrapper,
    build_vision_encoder,
    build_vlm,
)

__all__ = [
    "AC_SCOPES",
    "VLM_PRESETS",
    "Adapter",
    "AdapterConfig",
    "HFVisionEncoder",
    "VLMConfig",
    "VLMWrapper",
    "VisionBlock",
    "VisionEncoder",
    "VisionEncoderConfig",
    "ac_components",
    "build_vision_encoder",
    "build_vlm",
    "check_encoder_tp",
    "check_vlm",
    "num_image_tokens",
]


def ac_components(scope: str, frozen_encoder: bool = False) -> tuple[str, ...]:
    """The components ``ac_scope`` checkpoints (``all`` | ``language`` | ``vision``).

    A frozen encoder keeps no activations for backward, so checkpointing it saves nothing: it
    is left out of ``all``, and ``vision`` alone is refused.
    """
    table = {"all": ("encoder", "decoder"), "language": ("decoder",), "vision": ("encoder",)}
    if scope not in table:
        raise ForgeConfigError(
            f"ac_scope={scope!r} is invalid: choose one of {list(AC_SCOPES)}"
            + did_you_mean(str(scope), AC_SCOPES)
        )
    if frozen_encoder and scope == "vision":
        raise ForgeConfigError(
            "ac_scope='vision' with a frozen encoder: the encoder keeps no activations for "
            "backward, so checkpointing it saves nothing; use ac_scope='language' or 'all'"
        )
    return tuple(c for c in table[scope] if not (frozen_encoder and c == "encoder"))

"""forge_vlm: vision-language models that every forge parallelism applies to.

- :class:`VLMWrapper` ``(encoder, adapter, decoder)`` with ``forward(tokens, images)``: the joint-
  decoder design, where projected image embeddings replace the image placeholder tokens
- :class:`VisionEncoder` (forge's ViT) or :class:`HFVisionEncoder` (Hugging Face SigLIP from a
  config), :class:`Adapter` (MLP projector with optional token pooling), :func:`build_vlm`
- configs (:mod:`forge_vlm.config`, pure Python, so a launcher checks them before torch): :class:`VisionEncoderConfig`,
  :class:`AdapterConfig`, :class:`VLMConfig`

The wrapper declares its components, so forge-fsdp-wrap shards encoder blocks, encoder, adapter,
decoder blocks, decoder and root as separate FSDP2 units, AC picks components by scope, and the
stage-order contract holds per component. Tensor parallelism is applied per component (the
decoder with the reference plan, the encoder with its own plan from class attributes). Depends
on forge_core and torch (transformers only for the SigLIP tower).
"""

from typing import TYPE_CHECKING

from forge_core.lazy import lazy_exports

from .checks import check_encoder_tp, check_vlm
from .config import (
    AC_SCOPES,
    VLM_PRESETS,
    AdapterConfig,
    VisionEncoderConfig,
    VLMConfig,
    num_image_tokens,
)

# NOTE: the model is imported on first use, so that the configs and the pure checks
# (forge_vlm.checks) load without torch.
_EXPORTS = {
    "Adapter": "model",
    "HFVisionEncoder": "model",
    "VisionBlock": "model",
    "VisionEncoder": "model",
    "VLMWrapper": "model",
    "build_vision_encoder": "model",
    "build_vlm": "model",
    "ac_components": "checks",
    "synthetic_vlm_batch": "data",
}

if TYPE_CHECKING:
    from .checks import ac_components
    from .data import synthetic_vlm_batch
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
    "synthetic_vlm_batch",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

"""The models a forge config describes, built on the meta device.

- :func:`model_from_config`: a job's model from its ``ForgeConfig`` (a field model, a VLM, or the
  reference Transformer with MoE blocks when asked);
- :func:`build_meta_model`: the reference Transformer or a VLM from the layers' own configs.

Kept apart from :mod:`forge.build` (the stages) so that the pre-launch checks can build a meta
model without importing the stage pipeline that imports them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from forge_core import ForgeConfigError, ModelConfig
from forge_domain import FieldNet
from forge_moe_ep import MoE, moe_transformer
from forge_vlm import AdapterConfig, VisionEncoderConfig, VLMConfig, build_vlm, check_vlm

from .config import ForgeConfig

__all__ = ["build_meta_model", "hf_meta_model", "model_from_config"]


def build_meta_model(
    model_config: ModelConfig,
    vision_config: VisionEncoderConfig | None = None,
    adapter_config: AdapterConfig | None = None,
    vlm_config: VLMConfig | None = None,
) -> nn.Module:
    """forge's reference Transformer (MoE blocks if the config has them), or a VLM, on meta.

    The VLM needs all three of ``vision_config``, ``adapter_config`` and ``vlm_config``; their
    cross-config checks run here (the TP ones in :meth:`ParallelPlan.parallelize`).
    """
    if vision_config is None or adapter_config is None or vlm_config is None:
        if any(p is not None for p in (vision_config, adapter_config, vlm_config)):
            raise ForgeConfigError(
                "a vision-language model needs vision_config, adapter_config and vlm_config "
                "together"
            )
        with torch.device("meta"):
            return moe_transformer(model_config)
    check_vlm(model_config, vision_config, adapter_config, vlm_config)  # TP: parallelize
    with torch.device("meta"):
        factory = MoE.for_block if model_config.custom_ffn_layers else None
        return build_vlm(
            model_config, vision_config, adapter_config, vlm_config, ffn_factory=factory
        )


def hf_meta_model(directory: str) -> nn.Module:
    """transformers' causal LM of ``directory``'s config.json, on the meta device, in float32
    (the master weights; FSDP2's ``param_dtype`` casts for compute), without a KV cache (a
    training forward needs none). Code in the directory never runs (``trust_remote_code``
    stays off): a model transformers does not know is one line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
        config.use_cache = False
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(
                config, trust_remote_code=False, dtype=torch.float32
            )
    except (ValueError, KeyError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ForgeConfigError(
            f"model.hf={directory!r}: transformers cannot build a causal LM from its "
            f"config.json ({first})"
        ) from None


def model_from_config(cfg: ForgeConfig) -> nn.Module:
    """The model a config describes, on the meta device: a Hugging Face model
    (``[model] hf``), a field model (``[field]``, ``forge_domain.FieldNet``), a VLM, or the
    reference Transformer (MoE blocks if asked)."""
    if cfg.hf is not None:
        return hf_meta_model(cfg.hf.dir)
    if cfg.is_field:
        with torch.device("meta"):
            return FieldNet(cfg.field_section())
    if cfg.is_vlm:
        return build_meta_model(cfg.decoder, *cfg.vlm_sections())
    return build_meta_model(cfg.decoder)

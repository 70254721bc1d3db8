"""forge_moe_ep: a mixture-of-experts layer and expert parallelism with a sync-free dispatch.

- :class:`MoE` plugs into the reference Transformer's FFN slot (:func:`moe_transformer`);
  :class:`MoEConfig` (the ``[moe]`` section: ``moe_every``, ``num_experts``, ``top_k``, ...)
  and :class:`MoEModelConfig` (forge_core's ``ModelConfig`` joined with them; torch-free,
  :mod:`forge_moe_ep.config`) configure it.
- :func:`apply_expert_parallel` shards the experts over the ``ep`` mesh axis, which is carved
  out of the data-parallel ranks.
- Dispatch modes: ``dropless`` (exact; with EP one deferred host wait per layer per forward) and
  ``capacity`` (fixed per-sequence capacity, dropped tokens counted, no host sync at all); see
  :mod:`forge_moe_ep.dispatch`.
- :func:`moe_metrics` reads tokens dropped and host syncs.
- :func:`convert_hf_moe` turns Hugging Face MoE blocks (Qwen3-MoE, Qwen2-MoE, Mixtral,
  DeepSeek-V2, DeepSeek-V3, GPT-OSS, OLMoE, GLM4-MoE, Llama 4) into :class:`MoE` layers with
  equal outputs; :func:`restore_hf_moe` puts them back for ``save_pretrained``
  (:mod:`forge_moe_ep.hf`).

Depends on forge_core, forge_kernels and torch.
"""

from typing import TYPE_CHECKING

from forge_core.lazy import lazy_exports

# NOTE: imported on first use, so that the pure checks (forge_moe_ep.checks) load without torch.
_EXPORTS = {
    "capacity_per_sequence": "dispatch",
    "GroupedExperts": "moe",
    "MoE": "moe",
    "Router": "moe",
    "moe_metrics": "moe",
    "moe_transformer": "moe",
    "apply_expert_parallel": "parallel",
    "HFMoE": "hf",
    "convert_hf_moe": "hf",
    "restore_hf_moe": "hf",
    "EXPERT_ACTIVATIONS": "config",
    "check_expert_parallel": "checks",
    "MOE_DISPATCH_MODES": "config",
    "MOE_FIELDS": "config",
    "MOE_PRESETS": "config",
    "MOE_ROUTERS": "config",
    "MoEConfig": "config",
    "MoEModelConfig": "config",
    "split_moe_fields": "config",
}

if TYPE_CHECKING:
    from .checks import check_expert_parallel
    from .config import (
        EXPERT_ACTIVATIONS,
        MOE_DISPATCH_MODES,
        MOE_FIELDS,
        MOE_PRESETS,
        MOE_ROUTERS,
        MoEConfig,
        MoEModelConfig,
        split_moe_fields,
    )
    from .dispatch import capacity_per_sequence
    from .hf import HFMoE, convert_hf_moe, restore_hf_moe
    from .moe import GroupedExperts, MoE, Router, moe_metrics, moe_transformer
    from .parallel import apply_expert_parallel

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"

__all__ = [
    "EXPERT_ACTIVATIONS",
    "MOE_DISPATCH_MODES",
    "MOE_FIELDS",
    "MOE_PRESETS",
    "MOE_ROUTERS",
    "GroupedExperts",
    "HFMoE",
    "MoEConfig",
    "MoEModelConfig",
    "MoE",
    "Router",
    "apply_expert_parallel",
    "capacity_per_sequence",
    "check_expert_parallel",
    "convert_hf_moe",
    "moe_metrics",
    "moe_transformer",
    "restore_hf_moe",
    "split_moe_fields",
]

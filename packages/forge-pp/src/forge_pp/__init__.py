"""forge_pp: pipeline parallelism, the first stage of forge's order (PP split -> TP -> CP -> EP -> ...).

- :class:`PPConfig` (``[pp]``) and :data:`SCHEDULES`: schedule, micro-batches, stages per rank,
  split points (:mod:`forge_pp.config`, no torch import)
- :func:`pp_problems`, :func:`stages_per_rank_problems`, :func:`schedule_problems`,
  :func:`check_pp`, :func:`hf_pp_problems`: pre-launch checks (:mod:`forge_pp.checks`)
- :func:`pipeline_hf_model`: a Hugging Face decoder of :data:`HF_PP_FAMILIES` made cuttable
  (:mod:`forge_pp.hf`; the split calls it)
- :func:`pipeline_split`: cut a model on meta into this rank's stages (the rank model keeps the
  unsplit parameter names); :func:`balanced_blocks`, :func:`stage_indices`: which blocks and
  stages go where
- :func:`attach_schedule`: run the parallelized stages with a torch.distributed.pipelining
  schedule, through ``forge_core.training.forward_backward``
- :func:`bubble_fraction`: the idle fraction a schedule leaves, in theory;
  :func:`pipeline_actions`: each pipeline rank's forwards and backwards in the order the
  schedule runs them; :func:`replay_peak`: the peak bytes held over such an order

Depends on forge_core and torch.
"""

from typing import TYPE_CHECKING

from forge_core.lazy import lazy_exports

_EXPORTS = {
    "HF_PP_FAMILIES": "checks",
    "hf_pp_problems": "checks",
    "pipeline_hf_model": "hf",
    "SCHEDULES": "config",
    "PPConfig": "config",
    "ScheduleInfo": "config",
    "check_pp": "checks",
    "pp_problems": "checks",
    "schedule_problems": "checks",
    "stage_count": "checks",
    "stages_per_rank_problems": "checks",
    "PipelineSplit": "split",
    "balanced_blocks": "split",
    "pipeline_split": "split",
    "split_model": "split",
    "stage_indices": "split",
    "attach_schedule": "schedule",
    "share_buffers": "schedule",
    "pipeline_stages": "schedule",
    "bubble_fraction": "theory",
    "pipeline_actions": "theory",
    "replay_peak": "theory",
}

if TYPE_CHECKING:
    from .checks import (
        HF_PP_FAMILIES,
        check_pp,
        hf_pp_problems,
        pp_problems,
        schedule_problems,
        stage_count,
        stages_per_rank_problems,
    )
    from .config import SCHEDULES, PPConfig, ScheduleInfo
    from .hf import pipeline_hf_model
    from .schedule import attach_schedule, pipeline_stages, share_buffers
    from .split import PipelineSplit, balanced_blocks, pipeline_split, split_model, stage_indices
    from .theory import bubble_fraction, pipeline_actions, replay_peak

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"

__all__ = [
    "HF_PP_FAMILIES",
    "PPConfig",
    "PipelineSplit",
    "SCHEDULES",
    "ScheduleInfo",
    "attach_schedule",
    "balanced_blocks",
    "bubble_fraction",
    "check_pp",
    "hf_pp_problems",
    "pipeline_actions",
    "pipeline_hf_model",
    "pipeline_split",
    "pipeline_stages",
    "pp_problems",
    "replay_peak",
    "schedule_problems",
    "share_buffers",
    "split_model",
    "stage_count",
    "stage_indices",
    "stages_per_rank_problems",
]

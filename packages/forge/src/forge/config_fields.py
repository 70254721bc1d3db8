"""The one mapping from a ``ForgeConfig`` and its resolved ``Layout`` to :class:`ParallelPlan`'s
fields (:meth:`forge.build.ParallelPlan.from_config`, which ``forge build`` and ``forge train``
use): kept apart from the stages so that it reads as one table."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .config import ForgeConfig
from .layout import Layout

__all__ = ["config_fields"]


def config_fields(cfg: ForgeConfig, layout: Layout, *, one_device: bool) -> dict[str, Any]:
    """ParallelPlan's fields for ``cfg`` under ``layout`` (``data`` is ``"none"`` on one
    device): the layout's resolved decisions, ``[training]``, ``[tp]``, ``[float8]``, ``[vlm]``
    ``[pp]`` and ``[cp]``."""
    t = cfg.training
    return {
        "data": "none" if one_device else layout.data,
        "ac_mode": t.ac_mode,
        "compile_model": t.compile,
        "compile_scope": t.compile_scope,
        "param_dtype": getattr(torch, t.param_dtype),
        "reshard_after_forward": t.reshard_after_forward,
        "cpu_offload": t.cpu_offload,
        "tp_plan": cfg.tp.plan,
        "sequence_parallel": cfg.tp.sequence_parallel_flag,  # None: per model, by forge_tp_plans
        "loss_parallel": layout.loss_parallel,
        "allow_plan_import": cfg.tp.allow_import,
        # the layout's resolved fp8 all-gather: "auto" is decided once, by resolve_layout
        "float8": replace(cfg.float8, fsdp_float8_all_gather=layout.float8_all_gather)
        if layout.float8
        else cfg.float8,
        "vlm": cfg.vlm,
        "pp": cfg.pp,
        "cp": cfg.cp,
        "expert_tp": layout.parallelism.expert_tp,
    }

"""The one place forge derives decisions from a config and a world size.

:func:`resolve_layout` turns a :class:`~forge.config.ForgeConfig` and a number of ranks into a
frozen :class:`Layout`: the resolved degrees of every mesh axis (``dp_shard`` and ``ep``
inferred), the data-parallel mode actually used, the sequence- and loss-parallel choices of the
decoder, and the batch each rank and micro-batch sees. ``forge build``, ``forge train``,
``forge plan``, the pre-launch checks and :meth:`forge.ParallelPlan.from_config` all read it,
so a default changed here changes them alike. Pure Python: no torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from forge_core.config import ParallelismConfig
from forge_tp_plans import checks as tp_checks

if TYPE_CHECKING:
    from .config import ForgeConfig

__all__ = ["Layout", "resolve_layout"]


@dataclass(frozen=True)
class Layout:
    """Every decision derived from a config and a world size (see the module docstring).

    ``data``: the data-parallel mode used: ``parallelism.data``, or ``"none"`` when every rank
    is taken by pp/tp/domain. ``sequence_parallel``: of forge's decoder
    (``tp.sequence_parallel``, or for ``"auto"`` the TP layer's own rule,
    :func:`forge_tp_plans.checks.default_sequence_parallel`, for forge's models: they all have a
    registered plan); false without tp, and false on pipeline stages (``parallelism.pp > 1``),
    as is ``loss_parallel``. ``ParallelPlan.from_config`` hands the TP layer the ask
    (``tp.sequence_parallel``) instead: its plan may parallelize a Hugging Face model, whose
    plan is basic TP, so "auto" is decided there, for the model it meets.
    ``batch_per_rank``: samples of the global batch on each data-parallel rank;
    ``micro_batch``: of those, per gradient-accumulation micro-step (the last one of a
    non-divisible split is refused by the checks).
    ``float8``: Float8 training of the Linears (``float8.enabled``). ``float8_all_gather``:
    FSDP2 all-gathers the Float8 weights in fp8, as forge-float8 resolves ``[float8]
    fsdp_float8_all_gather`` (:meth:`forge_float8.Float8Config.resolve_fsdp_all_gather`) for
    this layout on ``device_type``'s backend ("cpu": gloo, else nccl); false without Float8.
    ``refused``: what was asked that the layout cannot honour (an explicit
    ``tp.sequence_parallel`` / ``tp.loss_parallel`` on pipeline stages, in the TP layer's words);
    the pre-launch checks report these with every other problem.
    """

    world_size: int
    parallelism: ParallelismConfig
    data: str
    sequence_parallel: bool
    loss_parallel: bool
    batch_per_rank: int
    micro_batch: int
    float8: bool = False
    float8_all_gather: bool = False
    device_type: str = "cuda"
    refused: tuple[str, ...] = ()

    @property
    def tp(self) -> int:
        return self.parallelism.tp

    @property
    def ep(self) -> int:
        """The expert-parallel degree, resolved (an ``ep = -1`` in the config decided here)."""
        return self.parallelism.ep

    @property
    def dp_degree(self) -> int:
        return self.parallelism.dp_degree


def resolve_layout(cfg: ForgeConfig, world_size: int, *, device_type: str = "cuda") -> Layout:
    """The :class:`Layout` of ``cfg`` on ``world_size`` ranks of ``device_type`` ("cuda", the
    default, as ``forge plan`` plans; "cpu" for gloo ranks); raises ForgeConfigError when the
    degrees do not fit ``world_size`` (the message names the fields and the fix)."""
    experts = cfg.routed_experts
    par = cfg.parallelism.resolve(world_size, num_experts=experts)
    # NOTE: with every rank used by pp/tp/domain there is no data-parallel axis to shard over;
    # cp ranks hold the same parameters, so FSDP2 / DDP run over them (dp_shard x cp).
    data = par.data if par.dp_degree * par.cp > 1 or world_size == 1 else "none"
    pipelined = par.pp > 1
    sp, lp = cfg.tp.sequence_parallel_flag, cfg.tp.loss_parallel
    # NOTE: the TP layer's words for what pipeline stages cannot give; reported by the checks
    refused = (
        tp_checks.pipeline_stage_problems(sequence_parallel=sp, loss_parallel=lp, pp=par.pp)
        if pipelined
        else []
    )
    if sp is None or pipelined:
        # NOTE: the TP layer's rule, looked up at call time: it is the one place it is decided.
        # On a pipeline stage it is off whatever was asked (what passes between stages is a
        # plain tensor); an explicit true is refused by the checks, never silently dropped.
        sp = tp_checks.default_sequence_parallel(
            registered_plan=True,
            tied_embeddings=cfg.model.tie_embeddings,
            pipeline_stage=pipelined,
        )
    t = cfg.training
    per_rank = max(1, math.ceil(t.global_batch_size / par.dp_degree))
    micro = max(1, math.ceil(t.global_batch_size / (par.dp_degree * t.grad_accum)))
    return Layout(
        world_size=world_size,
        parallelism=par,
        data=data,
        sequence_parallel=par.tp > 1 and sp,
        # NOTE: the last pipeline stage returns plain logits, so no loss parallel under pp
        loss_parallel=par.tp > 1 and not pipelined and lp,
        batch_per_rank=per_rank,
        micro_batch=micro,
        float8=cfg.float8.enabled,
        float8_all_gather=cfg.float8.enabled
        and cfg.float8.resolve_fsdp_all_gather(
            data=data, tp=par.tp, dp_backend="gloo" if device_type == "cpu" else "nccl"
        ),
        device_type=device_type,
        refused=tuple(refused),
    )

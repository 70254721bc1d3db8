"""Running a rank's pipeline stages with a torch.distributed.pipelining schedule.

:func:`attach_schedule` turns a :class:`~forge_pp.split.PipelineSplit` whose stage modules are
parallelized and materialized into a trainable rank model: the schedule is kept on it as
``forge_pipeline_step`` (``forge_core.contracts``), which ``forge_core.training.forward_backward``
calls instead of the model. Calling the rank model itself is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core.contracts import (
    PIPELINE_STEP_ATTR,
    after_step_functions,
    pop_aux_losses,
    register_after_optimizer_step,
)
from forge_core.errors import ForgeConfigError, refuse
from forge_core.stages import applied_stages, record_stage
from torch.distributed.device_mesh import DeviceMesh

from .checks import schedule_problems
from .config import PPConfig
from .split import PipelineSplit

__all__ = ["attach_schedule", "pipeline_stages", "share_buffers"]

STAGES_ATTR = "forge_pipeline_stages"


def pipeline_stages(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(stage index, stage module)`` of a pipeline rank model, in stage order; ``[]`` for a
    model that is not split (reports read TP plans and Float8 reports per stage here)."""
    return list(model.__dict__.get(STAGES_ATTR, ()))


LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _AttachAux(torch.autograd.Function):
    """Identity on a stage's output whose backward also sends ``coef`` into an auxiliary loss.

    NOTE: an auxiliary loss (MoE load balancing) made on a middle stage cannot be added to the
    loss, which only the last stage computes; instead its gradient rides on the stage output's
    backward, as if it had been added with weight ``coef`` (1 / micro-batches: the mean over
    micro-batches, as forward_backward does with grad_accum)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.coef = coef
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.coef), None


def _aux_hook(coef: float) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor | None]:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        aux = pop_aux_losses(module)
        if aux is None or not torch.is_grad_enabled():
            return None
        return _AttachAux.apply(output, aux.to(output.device), coef)

    return hook


def share_buffers(split: PipelineSplit) -> None:
    """Give the rank model the (materialized) buffers of its stage modules, so that it holds no
    meta tensors once the stages are on their device."""
    for stage in split.stages:
        for path in split.views:
            own = split.model.get_submodule(path)
            for name, buffer in stage.get_submodule(path).named_buffers(recurse=False):
                own.register_buffer(name, buffer, persistent=False)


def _refuse_call(*args: Any, **kwargs: Any) -> Any:
    raise ForgeConfigError(
        "this model is split into pipeline stages (parallelism.pp > 1): it is not called as a "
        "whole; train it with forge_core.training.forward_backward, which runs the schedule"
    )


def attach_schedule(
    split: PipelineSplit,
    device_mesh: DeviceMesh,
    pp_cfg: PPConfig,
    device: torch.device | str,
) -> nn.Module:
    """Build the schedule over ``split``'s (parallelized) stage modules; return the rank model.

    The rank model gets ``forge_pipeline_step(inputs, targets, loss_fn) -> loss sum``: the
    ``inputs`` tuple (tokens; and images for a VLM) goes to stage 0, targets to the last stage,
    whose ``loss_fn(output, targets)`` returns the loss to back-propagate (already scaled: gradients are not divided by the micro-batch count) and a
    detached loss to report. The reports are summed over micro-batches and pipeline ranks, so
    every rank returns the same number.
    """
    from torch.distributed.pipelining import PipelineStage, schedules

    refuse(schedule_problems(pp_cfg))
    pp_mesh = device_mesh["pp"]
    group = pp_mesh.get_group()
    pp = pp_mesh.size()
    micro = pp_cfg.num_microbatches(pp)
    stages = [
        PipelineStage(module, index, split.num_stages, torch.device(device), group=group)
        for module, index in zip(split.stages, split.indices, strict=True)
    ]
    reports: list[torch.Tensor] = []
    current: list[LossFn] = []
    real_inputs: list[tuple[torch.Tensor, ...]] = []

    def real_first_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        # NOTE: torch 2.11 infers the shapes passed between stages by running the first stage
        # on zeros (under no_grad) at the first step; a model that checks its inputs (a VLM
        # counts its image tokens) refuses zeros. The first stage then sees a real micro-batch
        # of the step instead; the shapes are the same.
        if torch.is_grad_enabled() or not real_inputs:
            return None
        return real_inputs[0]

    for module, index in zip(split.stages, split.indices, strict=True):
        module.register_forward_hook(_aux_hook(1.0 / micro))
        for fn in after_step_functions(module):  # e.g. Float8's scale precompute
            register_after_optimizer_step(split.model, fn)
        if index == 0:
            module.register_forward_pre_hook(real_first_inputs)

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        scaled, report = current[0](output, target)
        reports.append(report)
        return scaled

    cls = getattr(schedules, pp_cfg.info.torch_class)
    multi = issubclass(cls, schedules.PipelineScheduleMulti)
    schedule = cls(
        stages if multi else stages[0], n_microbatches=micro, loss_fn=loss, scale_grads=False
    )
    first, last = 0 in split.indices, split.num_stages - 1 in split.indices

    def step(
        inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, loss_fn: LossFn
    ) -> torch.Tensor:
        batch = targets.shape[0]
        if batch % micro:
            raise ForgeConfigError(
                f"a batch of {batch} on this rank does not split into "
                f"pp.microbatches={micro}; use a batch that divides by it"
            )
        current[:] = [loss_fn]
        reports.clear()
        # NOTE: contiguous: torch 2.11's stage checks its inputs' strides against the ones it
        # inferred (tokens[:, :-1] is a strided view of the batch).
        args = tuple(t.contiguous() for t in inputs) if first else ()
        real_inputs[:] = [tuple(t[: t.shape[0] // micro] for t in args)] if first else []
        kwargs: dict[str, Any] = {"target": targets.contiguous(), "losses": []} if last else {}
        # NOTE: return_outputs=False: the last stage would otherwise keep every micro-batch's
        # logits to the end of the step to return them merged (nobody reads them here).
        try:
            schedule.step(*args, return_outputs=False, **kwargs)
        finally:
            real_inputs.clear()
        total = torch.zeros((), device=targets.device)
        # NOTE: the last micro reports: torch's first step may run the loss once more while it
        # infers the shapes passed between stages.
        for report in reports[len(reports) - micro :] if last else ():
            total += report.float()
        dist.all_reduce(total, group=group)  # only the last stage's rank has the reports
        return total

    model = split.model
    model.__dict__[PIPELINE_STEP_ATTR] = step
    model.__dict__["forward"] = _refuse_call
    model.__dict__["forge_pipeline"] = schedule
    model.__dict__[STAGES_ATTR] = list(zip(split.indices, split.stages, strict=True))
    for name in applied_stages(split.stages[0]):  # the rank model reports its stages' order
        if name not in applied_stages(model):
            record_stage(model, name)
    return model

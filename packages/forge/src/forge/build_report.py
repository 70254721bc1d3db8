"""The pieces of ``forge build``'s report that look into the built model: the decoder's TP
plan and Float8 conversion, parameter bytes, host syncs, TP gradients, the MoE and VLM lines.

Kept apart from :mod:`forge.job` (the build job) so that :mod:`forge.kinds` can say which of
them a kind of model reports without importing the job.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core import ParallelismConfig, count_host_syncs
from forge_core.mesh_dims import sub_mesh
from forge_core.stages import unwrap
from forge_core.training import forward_backward
from forge_float8 import float8_report
from forge_moe_ep import moe_metrics
from forge_pp import pipeline_stages
from forge_tp_plans import describe_tp_plan, tp_gradient_mismatches
from forge_vlm import VLMWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .config import ForgeConfig

__all__ = [
    "count_step_syncs",
    "decoder_of",
    "float8_text",
    "moe_report",
    "param_bytes",
    "tp_description",
    "tp_gradient_report",
    "vlm_wrapper",
]


def vlm_wrapper(model: nn.Module) -> VLMWrapper:
    """The ``forge_vlm.VLMWrapper`` inside a VLM config's model (DDP / compile unwrapped)."""
    # NOTE: only forge.kinds.VLMKind calls it: its model_from_config is build_vlm's VLMWrapper
    # (FSDP2 swaps in a subclass); unwrap is typed nn.Module only.
    return cast(VLMWrapper, unwrap(model))


def decoder_of(model: nn.Module) -> nn.Module:
    """The language model: a VLM's decoder, else the model itself."""
    return getattr(unwrap(model), "decoder", model)


def tp_description(model: nn.Module, par: ParallelismConfig) -> str:
    """The ``tp:`` line of forge build's and forge train's reports: the decoder's applied plan;
    under pp, each of this rank's stages' (basic TP: no sequence or loss parallelism)."""
    stages = pipeline_stages(unwrap(model))
    if not stages:
        return describe_tp_plan(decoder_of(model))
    return "\n".join(
        f"stage {index}: {describe_tp_plan(decoder_of(stage))}" for index, stage in stages
    )


def float8_text(model: nn.Module) -> str:
    """The float8 line of the report: what ``apply_float8`` converted and skipped (per stage
    under pp, where each stage module was converted on its own)."""
    stages = pipeline_stages(unwrap(model))
    if not stages:
        return str(float8_report(decoder_of(model)))
    return "\n".join(
        f"stage {index}: {float8_report(decoder_of(stage))}" for index, stage in stages
    )


def param_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def count_step_syncs(
    model: nn.Module, batch: torch.Tensor, device: torch.device, mesh: DeviceMesh
) -> str:
    """Host syncs of one forward + backward (what a GPU would wait for), as a short text.

    The step is the training step itself (``forward_backward``): a pipelined rank model runs
    its schedule over every micro-batch (the count is of this rank's stages), a context-parallel
    one its sequence shards."""
    with count_host_syncs(device) as counter:
        forward_backward(model, batch, mesh=mesh)
    model.zero_grad(set_to_none=True)
    ops = ", ".join(f"{op} x{n}" for op, n in sorted(counter.ops.items()))
    return f"{counter.count}" + (f" ({ops})" if ops else "")


def tp_gradient_report(model: nn.Module, batch: torch.Tensor, mesh: DeviceMesh) -> list[str]:
    """Replicated-over-tp parameters whose gradients differ across the tp ranks after one more
    forward + backward (``forge_tp_plans.tp_gradient_mismatches``; every rank takes part): a
    plan that leaves a parameter replicated where each rank sees only its part of the features
    trains silently wrong. Empty when they all agree."""
    forward_backward(model, batch, mesh=mesh)
    found = tp_gradient_mismatches(model, mesh)
    model.zero_grad(set_to_none=True)
    return found


def moe_report(
    cfg: ForgeConfig,
    par: ParallelismConfig,
    model: nn.Module,
    batch: torch.Tensor,
    device: torch.device,
    mesh: DeviceMesh,
) -> str:
    """The MoE line of the report (every rank takes part: the counted step runs collectives)."""
    metrics = moe_metrics(model)  # read before the counted step adds to them
    if par.pp > 1:  # each pipeline rank holds its stages' MoE layers: the pipeline's sum
        counts = torch.tensor(
            [metrics["moe_layers"], metrics["tokens_routed"], metrics["tokens_dropped"]],
            dtype=torch.int64,
            device=device,
        )
        dist.all_reduce(counts, group=sub_mesh(mesh, "pp").get_group())
        keys = ("moe_layers", "tokens_routed", "tokens_dropped")
        metrics = {**metrics, **dict(zip(keys, counts.tolist(), strict=True))}
    syncs = count_step_syncs(model, batch, device, mesh)
    m = cfg.decoder
    return (
        f"moe:    {metrics['moe_layers']} MoE layers x {m.num_experts} experts (top-{m.top_k}), "
        f"ep={par.ep} ({m.num_experts // par.ep} experts per rank), dispatch {m.moe_dispatch}; "
        f"tokens dropped {metrics['tokens_dropped']} of {metrics['tokens_routed']} routed in "
        f"{cfg.training.steps} steps; host syncs "
        f"counted in one forward+backward: {syncs} (rank 0)"
    )

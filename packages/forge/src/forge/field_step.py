"""A field model's training step (``forge_domain.FieldNet`` on 2-D fields, split by height
over the ``domain`` axis): what :class:`forge.kinds.FieldKind` trains with."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core.mesh_dims import axis_size, dp_rank_and_size
from forge_core.training import reduce_over_dp, set_gradient_sync
from forge_domain import domain_group, shard_spatial, sync_domain_gradients
from torch.distributed.device_mesh import DeviceMesh

from .data import FieldBatch

__all__ = ["field_step"]


def field_step(
    model: nn.Module, batch: FieldBatch, mesh: DeviceMesh, device: torch.device, grad_accum: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A field model's step: mean squared error over every grid point of the global batch.

    With a ``domain`` axis each rank computes its height slab. Its squared errors (padding rows
    left out) are scaled by ``dp x domain / elements of the global batch``: FSDP2/DDP average
    gradients over the data-parallel ranks and ``sync_domain_gradients`` over the domain ranks,
    which leaves the gradient of the global mean.
    """
    x, y = batch.inputs.to(device), batch.targets.to(device)
    count = torch.tensor(float(x.numel() * dp_rank_and_size(mesh)[1]), device=device)
    split = axis_size(mesh, "domain") > 1
    valid = x.shape[-2]
    if split:
        x, shard = shard_spatial(x, mesh)
        y, _ = shard_spatial(y, mesh)
        valid = max(0, min(shard.rows, shard.size - shard.start))  # rows that are not padding
    scale = dp_rank_and_size(mesh)[1] * axis_size(mesh, "domain") / count
    loss_sum = torch.zeros((), device=device)
    for i, (xm, ym) in enumerate(zip(x.chunk(grad_accum), y.chunk(grad_accum), strict=True)):
        set_gradient_sync(model, i == grad_accum - 1)
        sse = ((model(xm) - ym)[..., :valid, :].float() ** 2).sum()
        (sse * scale).backward()
        loss_sum += sse.detach()
    if split:
        sync_domain_gradients(model, mesh)
        dist.all_reduce(loss_sum, group=domain_group(mesh))
    return reduce_over_dp(loss_sum, mesh), count

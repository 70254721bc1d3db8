"""A debug check for the silent wrong-gradient case of tensor parallelism.

A parameter a plan leaves replicated over tp must get the same gradient on every tp rank: the
ranks apply the same optimizer step to it. When it works on a rank's own part of the features
(a per-head norm after a column-parallel projection, an activation's learned scale on sharded
hidden units) each rank's gradient covers only its part, and unless the plan sums them
(``replicated_with_grad_allreduce``) the copies drift apart with no error. Run
:func:`tp_gradient_mismatches` after a backward (a test, ``forge build``'s parity run) to list
them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core.mesh_dims import get_tp_mesh
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .fused_styles import _local

__all__ = ["tp_gradient_mismatches"]


def _sharded_over_tp(param: torch.Tensor) -> bool:
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return any(isinstance(p, Shard) and names[i] == "tp" for i, p in enumerate(param.placements))


def tp_gradient_mismatches(
    model: nn.Module, device_mesh: DeviceMesh, *, rtol: float = 1e-5
) -> list[str]:
    """Names of the parameters not sharded over tp whose gradients differ across the tp ranks
    (largest difference above ``rtol`` x the largest magnitude), with the relative difference.

    Call on every rank after a backward, before the optimizer step; a collective pair
    (all-reduce MAX and MIN) per parameter over the tp group. Empty without a tp axis.
    FSDP2-sharded parameters compare their local shards: tp peers hold the same shard.
    """
    tp_mesh = get_tp_mesh(device_mesh)
    if tp_mesh is None or tp_mesh.size() == 1:
        return []
    group = tp_mesh.get_group()
    found = []
    for name, param in model.named_parameters():
        if param.grad is None or _sharded_over_tp(param):
            continue
        grad = _local(param.grad).detach().float()
        high, low = grad.clone(), grad.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        scale = float(torch.maximum(high.abs(), low.abs()).max()) if grad.numel() else 0.0
        spread = float((high - low).max()) if grad.numel() else 0.0
        if spread > rtol * max(scale, 1e-30):
            found.append(
                f"{name} (gradients differ across tp ranks by {spread / scale:.2g} relative)"
            )
    return found

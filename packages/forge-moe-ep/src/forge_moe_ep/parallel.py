"""``apply_expert_parallel``: shard the experts of every MoE layer over the ``ep`` mesh axis.

The ``ep`` axis is carved out of ``dp_shard`` (``forge_mesh.build_device_mesh`` makes the views):
EP peers are data-parallel ranks that see different tokens, so attention and the other dense
parts are never computed twice. Each EP rank holds ``num_experts / ep`` experts (a contiguous
range, DTensor ``Shard(0)``); ranks that hold the same experts form the experts' own
data-parallel axis (``expert_dp = dp_replicate x dp_shard_mod_ep``), over which FSDP2 shards and
reduces them. With more data-parallel ranks than experts, ``ep`` stays at most ``num_experts``
and the remaining ranks shard each expert's weights with FSDP2 instead.

Gradient bookkeeping: an expert's gradient arrives (through the all-to-all backward) summed over
the tokens of its ``ep`` peers; FSDP2 divides it by the full data-parallel degree (see
``forge_core.contracts.mark_expert_parallel``), which makes it the same average the dense
parameters get.
"""

from __future__ import annotations

import torch.nn as nn
from forge_core.contracts import mark_expert_parallel
from forge_core.errors import ForgeConfigError
from forge_core.mesh_dims import get_dp_group_mesh, get_ep_mesh
from forge_core.stages import stage
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .checks import check_expert_parallel
from .moe import MoE

__all__ = ["apply_expert_parallel", "check_expert_parallel"]


def apply_expert_parallel(model: nn.Module, device_mesh: DeviceMesh | None) -> nn.Module:
    """Shard every :class:`MoE`'s experts over ``device_mesh``'s ``ep`` axis; returns ``model``.

    ``device_mesh`` is the full forge mesh (``forge_mesh.build_device_mesh``). Without an ``ep``
    axis the experts stay whole on every rank; the MoE layers still learn the data-parallel
    group their token counts are summed over (aux-loss-free balancing). Order: after TP, before
    Float8 / AC / compile / FSDP2 (enforced). Works on meta-device or materialized models.
    """
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        raise ForgeConfigError(
            "apply_expert_parallel found no forge_moe_ep.MoE layer in the model; build it with "
            "forge_moe_ep.moe_transformer(config) (model.moe_every > 0)"
        )
    ep_mesh = get_ep_mesh(device_mesh)
    ep = 1 if ep_mesh is None else ep_mesh.size()
    for moe in moes:
        check_expert_parallel(moe.num_experts, ep)
    count_mesh = get_dp_group_mesh(device_mesh)
    with stage(model, "ep"):
        for moe in moes:
            moe.count_group = None if count_mesh is None else count_mesh.get_group()
            if ep_mesh is None:
                continue
            experts = moe.experts
            for name, param in list(experts.named_parameters(recurse=False)):
                if isinstance(param, DTensor):
                    raise ForgeConfigError(
                        f"expert weight {name} is already a DTensor ({param.placements}); apply "
                        "expert parallelism before FSDP2 and only once"
                    )
                sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
                setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            mark_expert_parallel(experts, ep)
            moe.ep_group = ep_mesh.get_group()
    return model

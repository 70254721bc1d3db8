"""Rank functions of the domain-parallel tests that build through forge's ParallelPlan (the
conv net and forge_domain's own rank functions: packages/forge-domain/tests/domain_jobs.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from domain_jobs import H, W, _net
from forge_core.training import global_grad_norm, local_batch
from forge_domain import domain_group, shard_spatial, sync_domain_gradients
from forge_mesh import build_device_mesh


def train_domain_data(steps: int = 10) -> dict[str, Any]:
    """domain 2 x data (FSDP2) 2 against the single-device net: 10 AdamW steps of MSE."""
    from forge.build import ParallelPlan

    mesh = build_device_mesh({"dp_shard": 2, "domain": 2}, "cpu")
    reference = _net()
    net = ParallelPlan(mesh, param_dtype=torch.float32).parallelize(copy.deepcopy(reference))
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(steps, 4, 3, H, W, generator=g)
    targets = torch.randn(steps, 4, 2, H // 2, W // 2, generator=g)
    records: dict[str, list[tuple[float, float]]] = {"ref": [], "par": []}
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    group = domain_group(mesh)
    dp = mesh["dp_shard"]
    for x, t in zip(xs, targets, strict=True):
        loss = F.mse_loss(reference(x), t)
        loss.backward()
        records["ref"].append((float(loss), float(global_grad_norm(list(reference.parameters())))))
        opt_ref.step()
        opt_ref.zero_grad()

        x_local, t_local = local_batch(x, dp), local_batch(t, dp)
        slab, _ = shard_spatial(x_local, mesh)
        t_slab, _ = shard_spatial(t_local, mesh)
        loss = F.mse_loss(net(slab), t_slab)  # this slab's mean; the model's loss is their mean
        loss.backward()
        sync_domain_gradients(net, mesh)  # FSDP2 averaged over dp_shard already
        reported = loss.detach().clone()
        for grp in (group, dp.get_group()):
            dist.all_reduce(reported, group=grp)
        reported /= 4
        records["par"].append((float(reported), float(global_grad_norm(list(net.parameters())))))
        opt.step()
        opt.zero_grad()
    from forge_core.stages import applied_stages

    records["stages"] = applied_stages(net)
    return records

"""Rank functions and the conv net of the domain-parallel tests (the one that trains through
forge's ParallelPlan: tests/integration/domain/jobs.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from forge_domain import (
    WidthCircularConv2d,
    apply_domain_parallel,
    domain_group,
    shard_spatial,
    sync_domain_gradients,
    unshard_spatial,
)
from forge_mesh import build_device_mesh

H, W = 16, 12


class ConvNet(nn.Module):
    """3x3, 5x5, strided, dilated and width-wrapping convs, GroupNorm, a LayerNorm over
    (C, H, W), residuals: every layer kind domain parallelism converts."""

    def __init__(self, c_in: int = 3, c: int = 8, c_out: int = 2, layer_norm: bool = True) -> None:
        super().__init__()
        self.stem = nn.Conv2d(c_in, c, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, c)
        self.conv5 = nn.Conv2d(c, c, 5, padding=2)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.norm2 = nn.GroupNorm(4, 2 * c)
        self.wrap = WidthCircularConv2d(2 * c, 2 * c, 3, padding=1)
        self.dilated = nn.Conv2d(2 * c, 2 * c, 3, padding=2, dilation=2)
        self.ln = nn.LayerNorm([2 * c, H // 2, W // 2]) if layer_norm else nn.Identity()
        self.head = nn.Conv2d(2 * c, c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.norm1(self.stem(x)))
        h = h + self.conv5(h)
        h = F.silu(self.norm2(self.down(h)))
        h = h + self.wrap(h)
        h = self.ln(h + self.dilated(h))
        return self.head(h)


def _net(seed: int = 0, **kwargs: Any) -> ConvNet:
    torch.manual_seed(seed)
    net = ConvNet(**kwargs)
    with torch.no_grad():  # non-trivial affine parameters
        for m in net.modules():
            if isinstance(m, nn.GroupNorm | nn.LayerNorm):
                m.weight.normal_(1.0, 0.2)
                m.bias.normal_(0.0, 0.2)
    return net


def forward_backward_equal(domain: int, height: int = H, layer_norm: bool = True) -> dict:
    """Domain-split forward/backward against the unsplit net: output, input and parameter grads.

    The loss is ``sum(out * weights)``: each rank sums its slab, the total is the sum over
    ranks, so summed (= domain x averaged) parameter gradients equal the unsplit ones.
    """
    mesh = build_device_mesh({"domain": domain, "data": "none"}, "cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, height, W, generator=g)
    reference = _net(layer_norm=layer_norm)
    net = apply_domain_parallel(copy.deepcopy(reference), mesh)
    padded = -(-height // domain) * domain
    x_pad = F.pad(x, (0, 0, 0, padded - height))
    x_ref = x_pad.clone().requires_grad_(True)
    y_ref = reference(x_ref)
    weights = torch.randn(y_ref.shape, generator=g)
    (y_ref * weights).sum().backward()

    x_full = x.clone().requires_grad_(True)
    slab, shard = shard_spatial(x_full, mesh)
    y = net(slab)
    w_slab, w_shard = shard_spatial(weights, mesh)
    (y * w_slab).sum().backward()
    sync_domain_gradients(net, mesh)
    x_grad = x_full.grad.clone()
    dist.all_reduce(x_grad, group=domain_group(mesh))  # each rank holds its rows' gradient
    y_full = unshard_spatial(y.detach(), w_shard, mesh)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    return {
        "out": rel(y_full, y_ref.detach()),
        "input_grad": rel(x_grad, x_ref.grad[..., :height, :]),
        "param_grads": {
            n: rel(p.grad * domain, q.grad)
            for (n, p), q in zip(net.named_parameters(), reference.parameters(), strict=True)
        },
        "shard": (shard.size, shard.padded_size, shard.rows),
        "types": sorted({type(m).__name__ for m in net.modules()}),
    }


def _credit_style_group_norm(x: torch.Tensor, norm: nn.GroupNorm, group) -> torch.Tensor:
    """CREDIT's design: slab statistics combined with a plain (non-differentiable) all_reduce."""
    B = x.shape[0]
    xg = x.reshape(B, norm.num_groups, -1)
    size = dist.get_world_size(group)
    mean = xg.mean(-1, keepdim=True)
    dist.all_reduce(mean.data, group=group)  # autograd never sees the other ranks' share
    mean = mean / size
    var = (xg - mean).square().mean(-1, keepdim=True)
    dist.all_reduce(var.data, group=group)
    var = var / size
    out = ((xg - mean) / torch.sqrt(var + norm.eps)).reshape(x.shape)
    return out * norm.weight.view(1, -1, 1, 1) + norm.bias.view(1, -1, 1, 1)


def group_norm_input_grads(domain: int) -> dict[str, float]:
    """Input-gradient error of forge's DomainGroupNorm and of CREDIT's design (forward too)."""
    mesh = build_device_mesh({"domain": domain, "data": "none"}, "cpu")
    group = domain_group(mesh)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 8, 16, 6, generator=g) * 3 + torch.linspace(-2, 2, 16)[:, None]
    weights = torch.randn(2, 8, 16, 6, generator=g)
    norm = nn.GroupNorm(2, 8)
    holder = nn.Sequential(copy.deepcopy(norm))
    apply_domain_parallel(holder, mesh)

    x_ref = x.clone().requires_grad_(True)
    (norm(x_ref) * weights).sum().backward()
    out: dict[str, float] = {}
    for name, fn in (
        ("forge", holder),
        ("credit", lambda t: _credit_style_group_norm(t, norm, group)),
    ):
        x_full = x.clone().requires_grad_(True)
        slab, shard = shard_spatial(x_full, mesh)
        y = fn(slab)
        (y * shard_spatial(weights, mesh)[0]).sum().backward()
        grad = x_full.grad.clone()
        dist.all_reduce(grad, group=group)
        y_full = unshard_spatial(y.detach(), shard, mesh)
        out[f"{name}_out"] = float((y_full - norm(x)).abs().max())
        out[f"{name}_grad"] = float((grad - x_ref.grad).abs().max())
    return out

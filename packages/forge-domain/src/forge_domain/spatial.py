"""Cutting fields into height slabs and back, and the domain group's gradient average.

``shard_spatial`` pads the height to a multiple of the domain size (zeros at the bottom) and
returns this rank's slab with a :class:`SpatialShard` record; ``unshard_spatial`` gathers the
slabs and removes the padding. The model sees the padded field: a domain-split model equals the
unsplit model run on the same padded field (crop its output the same way).

Gradients (who reduces what). Each domain rank computes the loss of its slab; the model's loss
is their mean, so a replicated parameter's gradient is the mean of the ranks' gradients
(contributions that cross slab edges already came back through the halo exchange's backward).
:func:`sync_domain_gradients` averages over the ``domain`` group only. FSDP2 or DDP average
over the data-parallel axes only (their meshes never contain ``domain``). Call it after the
backward (after FSDP2's reduce-scatter, on the sharded gradients) and before the optimizer
step; each gradient is then reduced once over each axis, never twice, never skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core.errors import ForgeConfigError
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .layers import domain_group

__all__ = [
    "SpatialShard",
    "shard_spatial",
    "sync_domain_gradients",
    "unpad_shard_interp",
    "unshard_spatial",
]


@dataclass(frozen=True)
class SpatialShard:
    """How a field was cut: its height before padding, the padded height, the slab's rows."""

    dim: int
    size: int
    padded_size: int
    start: int
    rows: int

    @property
    def padding(self) -> int:
        return self.padded_size - self.size


def shard_spatial(
    tensor: torch.Tensor, device_mesh: DeviceMesh, dim: int = -2
) -> tuple[torch.Tensor, SpatialShard]:
    """This rank's height slab of ``tensor`` (the full field, the same on every domain rank).

    The height (``dim``) is zero-padded at the end to a multiple of the domain size first.
    Returns ``(slab, shard)``; :func:`unshard_spatial` undoes it.
    """
    group = domain_group(device_mesh)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    dim = dim % tensor.dim()
    H = tensor.shape[dim]
    padded = -(-H // size) * size
    if padded != H:
        pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, padded - H]
        tensor = torch.nn.functional.pad(tensor, pad)
    rows = padded // size
    shard = SpatialShard(dim=dim, size=H, padded_size=padded, start=rank * rows, rows=rows)
    return tensor.narrow(dim, shard.start, rows).contiguous(), shard


def unshard_spatial(
    slab: torch.Tensor, shard: SpatialShard, device_mesh: DeviceMesh
) -> torch.Tensor:
    """Gather the slabs of every domain rank and remove the padding (not differentiable).

    A slab whose height is not the one :func:`shard_spatial` produced is an error, never
    interpolated.
    """
    group = domain_group(device_mesh)
    size = dist.get_world_size(group)
    if slab.dim() <= shard.dim or slab.shape[shard.dim] != shard.rows:
        raise ForgeConfigError(
            f"slab of shape {tuple(slab.shape)} does not have the {shard.rows} rows on dim "
            f"{shard.dim} that shard_spatial cut; the model must keep the height (a layer "
            "that changes it needs its own shard record)"
        )
    parts = [torch.empty_like(slab) for _ in range(size)]
    dist.all_gather(parts, slab.contiguous(), group=group)
    return torch.cat(parts, dim=shard.dim).narrow(shard.dim, 0, shard.size)


def unpad_shard_interp(
    y_pred: torch.Tensor,
    shard: SpatialShard,
    device_mesh: DeviceMesh,
    image_h: int,
    image_w: int,
) -> torch.Tensor:
    """CREDIT's name: gather the prediction slabs, remove the padding, check ``[..., H, W]``.

    Unlike CREDIT's, a field that does not come out as ``image_h x image_w`` is an error, not
    silently interpolated to that size.
    """
    full = unshard_spatial(y_pred, shard, device_mesh)
    if tuple(full.shape[-2:]) != (image_h, image_w):
        raise ForgeConfigError(
            f"the gathered prediction is {tuple(full.shape[-2:])}, not ({image_h}, {image_w}); "
            "forge does not interpolate it: fix the model or the shard record"
        )
    return full


def sync_domain_gradients(
    model: nn.Module, device_mesh: DeviceMesh, *, bucket_bytes: int = 25 * 2**20
) -> None:
    """Average every gradient of ``model`` over the ``domain`` group, in flat buckets per dtype.

    DTensor gradients (TP, FSDP2) are averaged on their local shards: the domain group is
    orthogonal to their meshes, so peers hold the same shard. On gloo the sum is divided
    afterwards (no AVG there); elsewhere ``ReduceOp.AVG``.
    """
    group = domain_group(device_mesh)
    size = dist.get_world_size(group)
    if size == 1:
        return
    avg = dist.get_backend(group) != "gloo"
    grads = [
        p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        for p in model.parameters()
        if p.grad is not None
    ]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault((grad.dtype, grad.device), []).append(grad)
    for bucket_grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        used = 0
        for g in [*bucket_grads, None]:
            if g is not None and (
                not bucket or used + g.numel() * g.element_size() <= bucket_bytes
            ):
                bucket.append(g)
                used += g.numel() * g.element_size()
                continue
            _reduce_bucket(bucket, group, size, avg)
            bucket, used = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)


def _reduce_bucket(
    bucket: list[torch.Tensor], group: dist.ProcessGroup, size: int, avg: bool
) -> None:
    if not bucket:
        return
    flat = torch.cat([g.reshape(-1) for g in bucket])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM, group=group)
    if not avg:
        flat /= size
    offset = 0
    for g in bucket:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()

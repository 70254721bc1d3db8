"""Every rank's share of a parallelized model's parameters, computed on one process.

A model parallelized on rank 0 of a ``fake`` process group (meta tensors, nothing allocated)
holds DTensors whose global shape, placements and mesh say what every other rank holds:
:func:`per_rank_bytes` turns them into each rank's parameter, padded (FSDP2's allocation),
gradient and AdamW-state bytes, for every rank at once. ``Shard`` chunks as ``torch.chunk``
does (``ceil(L/n)`` per rank, the last ranks get less or nothing); a tensor dim carrying a
``_StridedShard`` (FSDP2 over TP- or EP-sharded weights) is chunked right to left, inner mesh
dims first and FSDP2's last, which is how FSDP2 stores it. Rank 0's arithmetic is checked
against ``to_local()`` on every call. ``forge plan`` is built on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, cast

import torch
import torch.nn as nn
from forge_core.torch_compat import fsdp_param_groups, mesh_group_ranks, strided_shard_type
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Placement, Shard

__all__ = [
    "BYTE_KINDS",
    "SHARD_PLACEMENTS",
    "local_sizes",
    "per_rank_bytes",
    "rank_coordinates",
    "unique_params",
]

BYTE_KINDS = ("params", "padded", "grads", "optim")
_STRIDED_SHARD = strided_shard_type()
SHARD_PLACEMENTS = (
    Shard,
    _STRIDED_SHARD,
)  # NOTE: torch 2.15's _StridedShard is not a Shard subclass
#: How a parameter groups for the per-rank arithmetic: shape, mesh, placements, FSDP2's mesh dim.
_ParamKey = tuple[tuple[int, ...], DeviceMesh | None, tuple[Placement, ...], int | None]


class _ShardLike(Protocol):
    """What ``Shard`` and ``_StridedShard`` (no common base but ``Placement``) share here."""

    dim: int


def rank_coordinates(mesh: DeviceMesh, world_size: int) -> torch.Tensor:
    """``[world_size, mesh.ndim]``: every rank's coordinate in ``mesh`` (-1 if not in it)."""
    groups = mesh_group_ranks(mesh)  # every group's ranks
    grid = torch.stack(torch.meshgrid(*[torch.arange(n) for n in mesh.shape], indexing="ij"), -1)
    grid = grid.reshape(-1, mesh.ndim)
    coords = torch.full((world_size, mesh.ndim), -1, dtype=torch.long)
    coords[groups] = grid.repeat(groups.numel() // grid.shape[0], 1)
    return coords


def local_sizes(
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    mesh: DeviceMesh,
    coords: torch.Tensor,
    padded_dim: int | None = None,
) -> list[torch.Tensor]:
    """Per tensor dim, its local size on every rank; mesh dim ``padded_dim`` (FSDP2's) gives
    every rank the full ``ceil(L/n)`` chunk (FSDP2's padded allocation)."""
    sizes = [torch.full((coords.shape[0],), n, dtype=torch.long) for n in shape]
    by_dim: dict[int, list[int]] = {}
    for j, p in enumerate(placements):
        if isinstance(p, SHARD_PLACEMENTS):  # both kinds name the tensor dim they split
            by_dim.setdefault(cast(_ShardLike, p).dim % len(shape), []).append(j)
    for k, dims in by_dim.items():
        if any(isinstance(placements[j], _STRIDED_SHARD) for j in dims):
            dims.reverse()  # FSDP2 sharded the TP/EP-local tensor: inner mesh dims first
        for j in dims:
            cur, n = sizes[k], mesh.shape[j]
            chunk = (cur + n - 1) // n
            own = (cur - coords[:, j] * chunk).clamp(min=0).minimum(chunk)
            sizes[k] = chunk if j == padded_dim else own
    return sizes


def per_rank_bytes(
    modules: Sequence[nn.Module],
    world_size: int,
    coords: dict[DeviceMesh, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """params / padded / grads / optim bytes of every rank holding ``modules``' parameters (a
    model, or a pipeline rank's stage modules: each parameter counted once); rank 0's arithmetic
    checked against ``to_local``. ``coords``: a cache of mesh coordinates."""
    units = [u for module in modules for u in module.modules() if isinstance(u, FSDPModule)]
    fsdp_dim = {
        id(fp.sharded_param): fp.mesh_info.shard_mesh_dim
        for unit in units
        for group in fsdp_param_groups(unit)
        for fp in group.fsdp_params
    }
    out = {k: torch.zeros(world_size, dtype=torch.long) for k in BYTE_KINDS}
    coords = {} if coords is None else coords
    groups: dict[_ParamKey, list[nn.Parameter]] = {}  # params that shard alike: one arithmetic
    for p in unique_params(modules):
        key: _ParamKey = (tuple(p.shape), None, (), None)
        if isinstance(p, DTensor):
            key = (tuple(p.shape), p.device_mesh, tuple(p.placements), fsdp_dim.get(id(p)))
        groups.setdefault(key, []).append(p)
    for (shape, mesh, placements, fdim), params in groups.items():
        local: int | torch.Tensor = math.prod(shape)  # a DTensor's: per rank, [world_size]
        padded = local
        if mesh is not None:
            if mesh not in coords:
                coords[mesh] = rank_coordinates(mesh, world_size)
            sizes = local_sizes(shape, placements, mesh, coords[mesh])
            first = params[0]
            assert isinstance(first, DTensor)  # a mesh in the key: DTensor parameters
            rank0, truth = [int(x[0]) for x in sizes], list(first.to_local().shape)
            if rank0 != truth:
                raise AssertionError(f"{shape} {placements}: rank 0 {rank0} != to_local {truth}")
            local = _product(sizes)
            padded = _product(local_sizes(shape, placements, mesh, coords[mesh], fdim))
        trained = [q for q in params if q.requires_grad]
        out["params"] += local * sum(q.element_size() for q in params)
        out["padded"] += padded * sum(q.element_size() for q in params)
        out["grads"] += local * sum(q.element_size() for q in trained)
        out["optim"] += local * 8 * len(trained)  # AdamW: exp_avg, exp_avg_sq in float32
    return out


def unique_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The parameters of ``modules``, each once (pipeline stage modules share submodules)."""
    return list({id(p): p for module in modules for p in module.parameters()}.values())


def _product(sizes: list[torch.Tensor]) -> int | torch.Tensor:
    """Elementwise product of per-rank sizes (1 for none), as ``math.prod`` would give."""
    total: int | torch.Tensor = 1
    for n in sizes:
        total = total * n
    return total

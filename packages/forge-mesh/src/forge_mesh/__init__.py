"""forge_mesh: a named DeviceMesh from a parallelism config.

:func:`build_device_mesh` lays the ranks out as ``pp, dp_replicate, dp_shard, cp, domain, tp``
(outermost first; tp innermost so tensor-parallel peers are neighbours on one node), keeping only
axes of size > 1, and adds flattened views for the data-parallel groups:

- ``dp``           = dp_replicate x dp_shard  (loss averaging, data loading, DDP)
- ``dp_shard_cp``  = dp_shard x cp            (the FSDP2 shard group when cp > 1)
- ``dp_cp``        = dp_replicate x dp_shard x cp (DDP's group when cp > 1; every rank that
  holds other tokens: MoE token counts)

With ``cp > 1`` both cp views exist even when the other axes do not (they are then the ``cp``
axis itself): context-parallel ranks hold the same parameters and see other tokens, so their
gradients are reduced with the data-parallel ones.

With ``ep > 1`` the ``dp_shard`` axis is also unflattened into ``dp_shard_mod_ep x ep`` (EP peers
are neighbouring ranks), giving the views ``ep`` (the all-to-all group of the MoE layers),
``dp_shard_mod_ep`` and ``expert_dp`` (``dp_replicate x dp_shard_mod_ep``: FSDP2's mesh for the
expert weights). With ``cp > 1`` it is ``dp_shard x cp`` that is unflattened so (ep innermost;
ep peers may then be cp peers: they hold other tokens, which is all EP needs). These share the root mesh, so expert weights sharded ``Shard(0)`` over ``ep``
compose with FSDP2 over ``expert_dp``.

Works with ``cpu`` (gloo), ``cuda`` (nccl) and the ``fake`` backend, on which a plan for
thousands of ranks runs in one process on meta tensors (see ``tools/bench_build.py``).
The config is validated against the world size before any process-group work, and
:func:`check_mesh_matches` refuses a mesh built for another layout than a config's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from forge_core import ForgeConfigError, ParallelismConfig
from forge_core.mesh_dims import (
    AXES,
    SLICES_ATTR,
    VIEWS_ATTR,
    axis_size,
    get_dp_mesh,
    get_tp_mesh,
    has_dp_mesh,
)
from forge_core.torch_compat import flatten_mesh, unflatten_mesh_dim
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__version__ = "0.1.0"
__all__ = [
    "build_device_mesh",
    "check_mesh_matches",
    "get_dp_mesh",
    "get_tp_mesh",
    "has_dp_mesh",
    "init_distributed",
    "mesh_layout",
]

_FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


def mesh_layout(
    parallelism: ParallelismConfig | Mapping[str, Any], world_size: int, num_experts: int = 0
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Axis names and sizes of the root mesh for ``world_size`` ranks (pure; no process group).

    ``ep`` is carved out of ``dp_shard`` and not a root axis (see :func:`build_device_mesh`).
    """
    cfg = ParallelismConfig.from_any(parallelism).resolve(world_size, num_experts)
    # NOTE: fsdp2 with dp_replicate > 1 keeps dp_shard even at size 1: FSDP2 then gets the 2-D
    # (replicate, shard) mesh and replicates; a lone dp_replicate axis would make it shard instead.
    keep = {"dp_shard"} if cfg.data == "fsdp2" and cfg.dp_replicate > 1 else set()
    named = [(n, getattr(cfg, n)) for n in AXES if getattr(cfg, n) > 1 or n in keep]
    if not named:
        named = [("dp_shard", 1)]
    names, sizes = zip(*named, strict=True)
    return tuple(names), tuple(sizes)


def init_distributed(device_type: str = "cuda") -> None:
    """Initialize the default process group from torchrun/SLURM environment variables if needed."""
    if dist.is_initialized():
        return
    backend = {"cuda": "nccl", "cpu": "gloo"}.get(device_type, "gloo")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def _replicate_x_shard(mesh: DeviceMesh, shard: tuple[str, ...], name: str) -> DeviceMesh:
    """The 2-D HSDP mesh ``(dp_replicate, name)``, ``name`` being the axes ``shard`` as one.

    NOTE: slicing a flattened view together with a root axis (``mesh["dp_replicate",
    "dp_shard_cp"]``) is deprecated in torch; flattening all of them and splitting the result
    in two gives the same groups from public-facing mesh operations only.
    """
    whole = flatten_mesh(mesh[("dp_replicate", *shard)], f"dp_replicate_{name}")
    replicate = mesh["dp_replicate"].size()
    sizes = (replicate, whole.size() // replicate)
    return unflatten_mesh_dim(whole, f"dp_replicate_{name}", sizes, ("dp_replicate", name))


def _expert_views(mesh: DeviceMesh, ep: int, hsdp_cp: DeviceMesh | None) -> dict[str, DeviceMesh]:
    """``ep``, ``dp_shard_mod_ep`` and ``expert_dp``: ``ep`` is carved out of ``dp_shard``, or
    with cp > 1 out of ``dp_shard x cp`` (``hsdp_cp``: the HSDP mesh with cp, if any)."""
    views = getattr(mesh, VIEWS_ATTR)
    if "cp" not in (mesh.mesh_dim_names or ()):
        base, dim = mesh, "dp_shard"
    elif hsdp_cp is not None:
        base, dim = hsdp_cp, "dp_shard_cp"
    else:
        base = views["dp_shard_cp"]
        dim = (base.mesh_dim_names or ("dp_shard_cp",))[0]
    # NOTE: ep is the innermost of the pieces, so that FSDP2 can compose the experts' mesh with
    # it (its dims must come before ep's). With cp the ep peers include cp peers: they hold
    # other tokens of the same sequences, which is all EP needs.
    shard = base[dim].size()
    sparse = unflatten_mesh_dim(base, dim, (shard // ep, ep), ("dp_shard_mod_ep", "ep"))
    names = sparse.mesh_dim_names or ()
    expert_dp = (
        ("dp_replicate", "dp_shard_mod_ep") if "dp_replicate" in names else ("dp_shard_mod_ep",)
    )
    views = {
        "ep": sparse["ep"],
        "dp_shard_mod_ep": sparse["dp_shard_mod_ep"],
        "expert_dp": sparse[expert_dp],
    }
    if "tp" in names:  # experts split over ep and tp at once (expert tensor parallelism)
        views["ep_tp"] = sparse[("ep", "tp")]
    return views


def build_device_mesh(
    parallelism: ParallelismConfig | Mapping[str, Any],
    device_type: str = "cuda",
    *,
    num_experts: int = 0,
) -> DeviceMesh:
    """Build the named DeviceMesh for ``parallelism`` over the current world.

    ``parallelism`` is a :class:`ParallelismConfig`, a dict of its fields, or a CREDIT-style
    ``{data, tensor, domain}`` dict. The default process group is initialized from the environment
    when it is not already (torchrun/SLURM); for the fake backend initialize it yourself with
    ``dist.init_process_group("fake", rank=r, world_size=n)``. Raises ``ForgeConfigError`` (before
    any collective) when the degrees do not fit the world size. ``num_experts`` (the model's;
    0 for a dense model) resolves ``ep=-1``.
    """
    cfg = ParallelismConfig.from_any(parallelism)
    world_size = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )
    names, sizes = mesh_layout(cfg, world_size, num_experts)  # validates before any PG work
    cfg = cfg.resolve(world_size, num_experts)
    if not dist.is_initialized():
        init_distributed(device_type)
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
    # torch deprecates slicing flattened dims from the root mesh, so forge keeps the views itself
    # (read by forge_core.mesh_dims.sub_mesh / has_axis).
    views = {}
    for flat, parts in _FLATTENED.items():
        if all(p in names for p in parts):
            views[flat] = flatten_mesh(mesh[parts], flat)
        elif flat != "dp" and "cp" in names:  # see the module docstring: cp joins the dp groups
            present = tuple(p for p in parts if p in names)
            views[flat] = mesh["cp"] if present == ("cp",) else flatten_mesh(mesh[present], flat)
    setattr(mesh, VIEWS_ATTR, views)
    hsdp = None
    if cfg.cp > 1 and "dp_replicate" in names:
        # HSDP with cp: get_dp_mesh's (dp_replicate, dp_shard_cp), made without the deprecated
        # slice of a flattened view and kept where sub_mesh looks for its slices.
        shard = ("dp_shard", "cp") if "dp_shard" in names else ("cp",)
        hsdp = _replicate_x_shard(mesh, shard, "dp_shard_cp")
        mesh.__dict__.setdefault(SLICES_ATTR, {})[("dp_replicate", "dp_shard_cp")] = hsdp
    if cfg.ep > 1:
        views.update(_expert_views(mesh, cfg.ep, hsdp))
    return mesh


#: Mesh axes a ``[parallelism]`` section sizes (``ep`` is a view carved from ``dp_shard``).
_LAYOUT_AXES = (*AXES, "ep")


def check_mesh_matches(par: ParallelismConfig, mesh: DeviceMesh | None) -> None:
    """Refuse a mesh whose axis sizes differ from the config's resolved ``[parallelism]``.

    NOTE: a plan reads the layout from the mesh; a config that says tp=2 next to a mesh without
    a tp axis would otherwise be followed silently without TP (and its TP options ignored).
    """
    wrong = {
        axis: (getattr(par, axis), axis_size(mesh, axis))
        for axis in _LAYOUT_AXES
        if getattr(par, axis) != axis_size(mesh, axis)
    }
    if wrong:
        ranks = mesh.size() if mesh is not None else 1
        said = ", ".join(f"{a}={want}" for a, (want, _) in wrong.items())
        has = ", ".join(f"{a}={got}" for a, (_, got) in wrong.items())
        fix = ", ".join(f"parallelism.{a}={got}" for a, (_, got) in wrong.items())
        mesh_text = "device_mesh=None (one device)" if mesh is None else "the device_mesh"
        raise ForgeConfigError(
            f"the config's [parallelism] resolves to {said} on {ranks} rank(s), but {mesh_text} "
            f"has {has}: build the mesh from the same config "
            "(forge_mesh.build_device_mesh(cfg.resolved_parallelism(world_size), ...)) or set "
            f"{fix} in the config"
        )

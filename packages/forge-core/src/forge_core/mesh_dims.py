"""Mesh-axis names and helpers every layer shares (no layer imports forge_mesh for these).

Axis order, outermost first: ``pp, dp_replicate, dp_shard, cp, domain, tp`` (tp innermost so its
ranks are neighbours: one node, the fastest links). A forge mesh holds only the axes of size > 1
(a world of one rank gets a 1-D ``dp_shard`` of size 1), plus flattened views built by
forge_mesh: ``dp`` (dp_replicate x dp_shard), ``dp_shard_cp`` (dp_shard x cp, the FSDP shard group
with context parallelism).

Expert parallelism is carved out of ``dp_shard``: forge_mesh unflattens it into
``dp_shard_mod_ep x ep`` (EP peers are neighbouring ranks) and keeps the views ``ep`` and
``expert_dp`` (``dp_replicate x dp_shard_mod_ep``: the ranks holding the same experts, over which
FSDP2 shards them). EP peers are data-parallel ranks: they see different tokens.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "AXES",
    "DP_AXES",
    "axis_size",
    "dp_rank_and_size",
    "get_dp_group_mesh",
    "get_dp_mesh",
    "get_ep_mesh",
    "get_ep_tp_mesh",
    "get_expert_dp_mesh",
    "get_tp_mesh",
    "has_axis",
    "has_dp_mesh",
    "sub_mesh",
]

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "domain", "tp")
DP_AXES = ("dp_replicate", "dp_shard")
#: Attribute on a root mesh holding its flattened views ``{name: 1-D DeviceMesh}`` (and the
#: 2-D ``ep_tp``: :func:`get_ep_tp_mesh`).
VIEWS_ATTR = "_forge_views"
#: Attribute on a mesh holding the sub-meshes :func:`sub_mesh` sliced from it.
SLICES_ATTR = "_forge_slices"


def _names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


def _views(mesh: DeviceMesh) -> dict[str, DeviceMesh]:
    return getattr(mesh, VIEWS_ATTR, {})


def has_axis(mesh: DeviceMesh | None, name: str) -> bool:
    """Whether ``mesh`` has a dimension (or a flattened view) called ``name``."""
    return mesh is not None and (name in _names(mesh) or name in _views(mesh))


def axis_size(mesh: DeviceMesh | None, name: str) -> int:
    """Size of axis ``name``, 1 when the mesh does not have it."""
    return sub_mesh(mesh, name).size() if has_axis(mesh, name) else 1


def sub_mesh(mesh: DeviceMesh | None, *names: str) -> DeviceMesh:
    """The sub-mesh over ``names`` (in that order); KeyError naming what the mesh has."""
    if mesh is None:
        raise KeyError(f"no mesh (one device) has no axis {list(names)}")
    missing = [n for n in names if not has_axis(mesh, n)]
    if missing:
        raise KeyError(f"mesh has no axis {missing}; its axes are {list(_names(mesh))}")
    if len(names) == 1 and names[0] in _views(mesh):
        return _views(mesh)[names[0]]
    # NOTE: kept on the mesh: slicing a DeviceMesh searches its rank tensor (``nonzero``), which
    # the training step would otherwise repeat on every call (and the host-sync counter see).
    cache: dict[tuple[str, ...], DeviceMesh] = mesh.__dict__.setdefault(SLICES_ATTR, {})
    if names not in cache:
        cache[names] = mesh[names[0]] if len(names) == 1 else mesh[names]
    return cache[names]


def _dp_axes(mesh: DeviceMesh) -> list[str]:
    shard = "dp_shard_cp" if has_axis(mesh, "dp_shard_cp") else "dp_shard"
    return [n for n in ("dp_replicate", shard) if has_axis(mesh, n)]


def has_dp_mesh(mesh: DeviceMesh | None) -> bool:
    """Whether ``mesh`` has any data-parallel axis."""
    return mesh is not None and bool(_dp_axes(mesh))


def get_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel sub-mesh: 1-D (one DP axis) or 2-D ``(dp_replicate, dp_shard)`` (HSDP).

    Raises ``ValueError`` when the mesh has no DP axis (e.g. a pure-TP mesh); check with
    :func:`has_dp_mesh` first.
    """
    axes = _dp_axes(mesh)
    if not axes:
        raise ValueError(
            f"mesh with axes {list(_names(mesh))} has no data-parallel axis "
            "(dp_replicate / dp_shard); use has_dp_mesh() first"
        )
    return sub_mesh(mesh, *axes)


def get_dp_group_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """A 1-D mesh over every rank that holds other tokens (for reducing statistics such as
    token counts): the data-parallel ranks, and the context-parallel ones when cp > 1.

    None when there is no such axis of size > 1.
    """
    for name in ("dp_cp", "dp", "dp_shard", "dp_replicate"):
        if has_axis(mesh, name) and sub_mesh(mesh, name).size() > 1:
            return sub_mesh(mesh, name)
    return None


def get_ep_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The 1-D expert-parallel mesh, or None when the mesh has no ``ep`` axis."""
    return sub_mesh(mesh, "ep") if has_axis(mesh, "ep") else None


def get_ep_tp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The 2-D ``(ep, tp)`` mesh experts split over both are placed on (forge_mesh keeps it as
    the view ``ep_tp``), or None when the mesh has none (no ep or tp axis, or ep carved out of
    ``dp_shard x cp``)."""
    return sub_mesh(mesh, "ep_tp") if has_axis(mesh, "ep_tp") else None


def get_expert_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards expert-parallel parameters over.

    ``dp_shard_mod_ep`` (1-D) or ``(dp_replicate, dp_shard_mod_ep)`` (HSDP) when the mesh has an
    ``ep`` axis; otherwise the dense data-parallel mesh (:func:`get_dp_mesh`).
    """
    return sub_mesh(mesh, "expert_dp") if has_axis(mesh, "expert_dp") else get_dp_mesh(mesh)


def get_tp_mesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The 1-D tensor-parallel sub-mesh, or None when the mesh has no ``tp`` axis."""
    return sub_mesh(mesh, "tp") if has_axis(mesh, "tp") else None


def dp_rank_and_size(mesh: DeviceMesh | None) -> tuple[int, int]:
    """This rank's index among the data-parallel replicas and their count (for data loading).

    Ranks that differ only along tp/cp/domain get the same index (they see the same batch).
    """
    index, count = 0, 1
    for name in DP_AXES:  # not dp_shard_cp: cp peers share a batch and split its sequence
        if has_axis(mesh, name):
            axis = sub_mesh(mesh, name)
            index, count = index * axis.size() + axis.get_local_rank(), count * axis.size()
    return index, count

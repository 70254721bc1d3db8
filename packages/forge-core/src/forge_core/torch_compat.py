"""The private torch APIs forge uses, one small function each, for torch 2.11 through 2.15.

forge runs on torch 2.11 (the lent GPU machines) through 2.15. A few things it needs are private
in torch (a mesh unflatten, FSDP2's parameter groups, autograd's running-backward flag). Their
access lives here and nowhere else in the layers, so a torch release that moves one breaks this
file, and ``packages/forge-core/tests/test_torch_compat.py`` names the function that broke instead of a
traceback deep in a layer. Where versions differ, the function says which needs which path.

Provides :func:`unflatten_mesh_dim`, :func:`flatten_mesh`, :func:`mesh_group_ranks`,
:func:`fsdp_param_groups`, :func:`fsdp_reshards_root_after_forward`, :func:`in_backward_pass`,
:func:`assert_on_device`, :func:`checkpoint_wrapper`, :func:`is_checkpoint_wrapper`,
:func:`inductor_cache_dir`, :func:`compiled_original`, :func:`is_compiled`,
:func:`non_persistent_buffer_names`, :func:`local_shape_and_offset`, :func:`strided_shard_type`,
:func:`overload_name`, :func:`scaled_mm`, :func:`dcp_metadata_path`, :func:`dcp_index_globals` and :class:`TorchDispatchMode` (the base of
forge's sync guard).
Modules that are slow to import are imported when first used. (``forge_kernels`` depends on
torch alone and calls ``torch._grouped_mm`` itself.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "TorchDispatchMode",
    "assert_on_device",
    "checkpoint_wrapper",
    "compiled_original",
    "dcp_index_globals",
    "dcp_metadata_path",
    "flatten_mesh",
    "fsdp_param_groups",
    "fsdp_reshards_root_after_forward",
    "in_backward_pass",
    "inductor_cache_dir",
    "is_checkpoint_wrapper",
    "is_compiled",
    "local_shape_and_offset",
    "mesh_group_ranks",
    "non_persistent_buffer_names",
    "overload_name",
    "scaled_mm",
    "strided_shard_type",
    "unflatten_mesh_dim",
]


def unflatten_mesh_dim(
    mesh: DeviceMesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...]
) -> DeviceMesh:
    """``mesh`` with axis ``dim`` split into axes ``names`` of ``sizes`` (row-major).

    NOTE: ``DeviceMesh._unflatten`` (torch >= 2.10). torch 2.11 rejects the axis given by name
    (its check is inverted: "dim dp_shard specified in `_unflatten` is not in ('dp_shard',)"),
    so it is passed by index, which 2.11 through 2.15 accept.
    """
    index = (mesh.mesh_dim_names or ()).index(dim)
    return mesh._unflatten(index, sizes, names)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1-D view of ``mesh`` (a slice of the root mesh) named ``name`` (``_flatten``)."""
    return mesh._flatten(name)


def mesh_group_ranks(mesh: DeviceMesh) -> torch.Tensor:
    """Every rank of every group this (sub)mesh's layout describes, group by group, flat.

    For a submesh of a world of N ranks that is all N ranks, ordered so that each consecutive
    ``mesh.size()`` of them form one group in row-major mesh order (``_layout`` / ``_rank_map``,
    torch >= 2.10).
    """
    return mesh._layout.remap_to_tensor(mesh._rank_map).reshape(-1)


def fsdp_param_groups(module: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of a ``fully_shard`` ed module (empty if it manages none).

    NOTE: torch 2.15 keeps a list (``_fsdp_param_groups``); torch 2.11 keeps one group or None
    (``_fsdp_param_group``).
    """
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def fsdp_reshards_root_after_forward(module: nn.Module) -> bool:
    """Whether FSDP2 decides the root's ``reshard_after_forward`` itself (it was left unset)."""
    return bool(module._get_fsdp_state()._auto_reshard_after_forward)  # type: ignore[operator]


def in_backward_pass() -> bool:
    """True while the autograd engine runs a backward (e.g. an activation-checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def assert_on_device(condition: torch.Tensor, message: str) -> None:
    """Check a boolean tensor on its device without a host sync (raises there, asynchronously)."""
    torch._assert_async(condition, message)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """torch's fp8 GEMM ``(a * scale_a) @ (b * scale_b)`` in ``out_dtype`` (b column-major)."""
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)


def checkpoint_wrapper(module: nn.Module, **kwargs: Any) -> nn.Module:
    """torch's activation-checkpoint wrapper around ``module`` (kwargs as torch takes them)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as wrap,
    )

    return wrap(module, **kwargs)


def is_checkpoint_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is torch's activation-checkpoint wrapper."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return isinstance(module, CheckpointWrapper)


def inductor_cache_dir() -> str:
    """Inductor's default on-disk cache folder (where ``TORCHINDUCTOR_CACHE_DIR`` points)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def compiled_original(module: nn.Module) -> nn.Module | None:
    """The module ``torch.compile(module)`` wrapped (``OptimizedModule._orig_mod``), else None."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` was compiled: wrapped by ``torch.compile(module)``, or compiled in
    place by ``module.compile()`` (which sets ``_compiled_call_impl``)."""
    return (
        compiled_original(module) is not None
        or getattr(module, "_compiled_call_impl", None) is not None
    )


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers registered with ``persistent=False``."""
    return set(module._non_persistent_buffers_set)


def local_shape_and_offset(
    global_shape: torch.Size, mesh: DeviceMesh, placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard shape and its offset in the global tensor for ``placements`` on
    ``mesh`` (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    return tuple(shape), tuple(offset)


def strided_shard_type() -> type:
    """DTensor's ``_StridedShard`` placement (FSDP2 over TP- or EP-sharded weights); not a
    ``Shard`` subclass in torch 2.15."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def overload_name(op: Any) -> str:
    """The overload of an ATen op (``"Tensor"`` of ``aten.add.Tensor``; ``OpOverload._overloadname``)."""
    return str(op._overloadname)


def dcp_metadata_path(reader: Any, rank: int | None = None) -> Any:
    """Where a DCP ``FileSystemReader`` reads its ``.metadata`` (per-rank when ``rank`` is given
    on torch releases that write one per rank)."""
    return reader._get_metadata_path(rank)


def dcp_index_globals() -> dict[tuple[str, str], Any]:
    """DCP's private globals that a checkpoint index (``.metadata``, a pickle) names, by the
    ``(module, name)`` the pickle spells: its storage record ``_StorageInfo``, its memory-format
    enum ``_MEM_FORMAT_ENCODING`` (where this torch has it) and the layout lookup
    ``torch.serialization._get_layout`` (a pickled ``torch.strided``). forge_checkpoint's
    restricted unpickler admits exactly these besides DCP's public classes.
    """
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    import torch.serialization as ser

    found = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): fs._StorageInfo,
        ("torch.serialization", "_get_layout"): ser._get_layout,
    }
    if hasattr(md, "_MEM_FORMAT_ENCODING"):
        found[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = (
            md._MEM_FORMAT_ENCODING
        )
    return found


def swap_parameter(module: nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    """Put ``value`` (any tensor, e.g. a differentiable function of the parameter) where the
    module's forward reads its parameter ``name``; returns what was there.

    NOTE: ``nn.Module._parameters``: ``setattr`` accepts only an ``nn.Parameter`` under a
    parameter's name. FSDP2 swaps its unsharded parameters in the same way.
    """
    previous = module._parameters[name]
    assert previous is not None
    module._parameters[name] = value  # type: ignore[assignment]
    return previous

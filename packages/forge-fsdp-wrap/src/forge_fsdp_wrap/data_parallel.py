"""FSDP2 (and HSDP), DDP and mixed precision: the last stage of forge's order.

FSDP2 shards each block as its own unit, then the root for what is left (embedding, final norm,
head). A 1-D data-parallel mesh shards; a 2-D ``(dp_replicate, dp_shard)`` mesh gives HSDP
(shard within a group, replicate across groups).

Expert-parallel blocks (a module marked by ``forge_core.contracts.mark_expert_parallel``, e.g.
forge_moe_ep's experts) are wrapped per sub-module instead: the experts on the experts'
data-parallel mesh with their gradients divided by the full data-parallel degree, then each
other child (attention, the MoE's router and shared expert), then the block for its norms. So
a block's reduce-scatter never runs between the all-to-alls of its MoE backward (which could
deadlock when ranks issue collectives on two groups in different orders). Parameters become DTensors; ``to_empty`` +
``init_weights`` materialize them afterwards (see ``forge.build_parallel_model``). An optimizer
that captured FSDP2's unsharded copies (built after a forward that no backward followed) is
stopped at its first step (:mod:`forge_fsdp_wrap.copies`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypedDict

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core.contracts import expert_parallel_modules
from forge_core.errors import ForgeConfigError
from forge_core.mesh_dims import get_dp_mesh, get_expert_dp_mesh, has_axis, has_dp_mesh, sub_mesh
from forge_core.stages import stage
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from .blocks import Block, component_blocks
from .copies import mark_copies, watch_for_copies

__all__ = [
    "apply_ddp",
    "apply_fsdp2",
    "default_mp_policy",
    "enable_autocast",
    "frozen_bytes_rule",
    "unshard_fsdp2_model",
]


class _ShardKwargs(TypedDict):
    """The keyword arguments every ``fully_shard`` call of :func:`apply_fsdp2` shares."""

    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy


def default_mp_policy(param_dtype: torch.dtype = torch.bfloat16) -> MixedPrecisionPolicy:
    """``param_dtype`` compute, float32 gradient reduction, inputs cast at every FSDP unit.

    Sharded (master) parameters stay in their own dtype (float32); FSDP2 casts the all-gathered
    copies to ``param_dtype`` for compute. Gradients are reduced in float32 so summing over many
    ranks does not lose bits. ``cast_forward_inputs=True`` makes each FSDP unit cast floating-point
    inputs to ``param_dtype`` at its forward boundary, so tensors produced outside the sharded
    blocks in another dtype (e.g. a VLM adapter's bf16 image embeddings fed to the decoder) arrive
    in the dtype the unit computes in without manual casts. It is pinned here explicitly rather
    than relying on the library default.
    """
    return MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=True
    )


def enable_autocast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Run ``model``'s forward under ``torch.autocast(dtype)``: float32 parameters, ``dtype`` compute.

    The mixed-precision counterpart of :func:`default_mp_policy` for DDP and single-device models,
    which have no FSDP2 policy. Done with forward hooks (the post-hook also runs when forward
    raises), so the module keeps its class and parameter names. Returns ``model``.
    """
    if model.__dict__.get("_forge_autocast") is not None:
        raise ForgeConfigError(
            f"autocast is already enabled on this model ({model._forge_autocast})"
        )
    active: list[torch.autocast] = []

    def enter(module: nn.Module, args: object) -> None:
        device = next(module.parameters()).device.type
        active.append(torch.autocast(device, dtype=dtype))
        active[-1].__enter__()

    def leave(module: nn.Module, args: object, output: object) -> None:
        active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    model.__dict__["_forge_autocast"] = dtype
    return model


def _check_reshard(reshard_after_forward: bool | int, shard_size: int) -> None:
    if isinstance(reshard_after_forward, bool):
        return
    if (
        not isinstance(reshard_after_forward, int)
        or reshard_after_forward < 1
        or shard_size % reshard_after_forward
    ):
        raise ForgeConfigError(
            f"reshard_after_forward={reshard_after_forward!r}: use True, False, or an int that divides "
            f"the shard group size {shard_size} (parameters are resharded to that many ranks after "
            "forward, e.g. the ranks of one node, so backward re-gathers over faster links)"
        )


def apply_fsdp2(
    model: nn.Module,
    device_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
    *,
    shard_frozen: bool | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 over the data-parallel axes of ``device_mesh``; returns ``model``.

    ``device_mesh`` is the full mesh; its DP sub-mesh is taken (2-D -> HSDP). Each block is one
    FSDP unit; the last block keeps its parameters after forward because backward starts with it
    and would re-gather them at once. ``reshard_after_forward``: True frees gathered parameters
    after forward, False keeps them until backward (more memory, no re-gather), an int reshards
    to that many ranks (must divide the shard group). ``cpu_offload`` keeps sharded parameters,
    gradients and optimizer steps on the CPU (``CPUOffloadPolicy``).

    A model made of components (``forge_core.contracts.model_components``, e.g. a VLM) gets
    units per component in forward order: the component's blocks, then the component, and the
    root last. A component whose parameters are all frozen is kept replicated instead (left out
    of FSDP2: no all-gather, no reduce-scatter) when ``shard_frozen`` is False, or for None when
    that costs no more memory than the rank's shard of the trainable model: frozen weight bytes
    <= 16 bytes x trainable parameters / DP degree (see :func:`frozen_bytes_rule`). It keeps its
    weights' dtype and computes under autocast in the policy's ``param_dtype``.
    """
    if not has_dp_mesh(device_mesh):
        raise ForgeConfigError(
            f"apply_fsdp2 needs a data-parallel axis, but the mesh has {list(device_mesh.mesh_dim_names or ())}; "
            "set parallelism.dp_shard (or dp_replicate) > 1, or data='none'"
        )
    dp_mesh = get_dp_mesh(device_mesh)
    if dp_mesh.mesh_dim_names == ("dp_replicate",):
        raise ForgeConfigError(
            "apply_fsdp2 got a mesh whose only data-parallel axis is dp_replicate: FSDP2 would shard over "
            "it. Add a dp_shard axis (size 1 to replicate only; forge_mesh.build_device_mesh does this) "
            "or use apply_ddp"
        )
    _check_reshard(reshard_after_forward, dp_mesh.size(dp_mesh.ndim - 1))
    with stage(model, "fsdp2"):
        offload = (
            CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            if cpu_offload
            else OffloadPolicy()
        )
        kwargs: _ShardKwargs = {
            "mesh": dp_mesh,
            "mp_policy": mp_policy or default_mp_policy(),
            "offload_policy": offload,
        }
        parts = component_blocks(model, required=False)  # no blocks: the root is the one unit
        with_blocks = [blocks for _, _, blocks in parts if blocks]
        replicated: list[nn.Parameter] = []
        replicated_parts: list[nn.Module] = []
        kept: list[nn.Module] = []  # units that keep their parameters after forward
        for name, part, blocks in parts:
            if name and _keep_frozen_replicated(model, part, dp_mesh.size(), shard_frozen):
                replicated.extend(part.parameters())
                replicated_parts.append(part)
                _compute_in(part, kwargs["mp_policy"].param_dtype)
                continue
            for i, (_, _, block) in enumerate(blocks):
                # NOTE: backward starts with the last block of the forward, so resharding it after
                # forward would only make FSDP all-gather the same parameters again immediately.
                last = bool(with_blocks) and blocks is with_blocks[-1] and i == len(blocks) - 1
                reshard = False if last else reshard_after_forward
                if reshard is not True:
                    kept.append(block)
                experts = expert_parallel_modules(block)
                if experts:
                    _shard_expert_parallel_block(block, experts, device_mesh, reshard, kwargs)
                else:
                    fully_shard(block, reshard_after_forward=reshard, **kwargs)
            if name and _has_own_parameters(part, blocks):
                # a component's own unit for what its blocks leave (embeddings, norms)
                fully_shard(part, reshard_after_forward=reshard_after_forward, **kwargs)
                if reshard_after_forward is not True:
                    kept.append(part)
        fully_shard(
            model,
            reshard_after_forward=reshard_after_forward,
            ignored_params=set(replicated) or None,
            **kwargs,
        )
        # NOTE: after fully_shard(model): its forward hook runs after FSDP2's post-forward.
        watch_for_copies(
            model, kept if reshard_after_forward is True else [model], replicated_parts
        )
    return model


def _has_own_parameters(part: nn.Module, blocks: list[Block]) -> bool:
    """Whether ``part`` holds parameters outside its blocks (a component made only of blocks,
    e.g. a ModuleList, needs no unit of its own: it may have no forward to gather it)."""
    in_blocks = {id(p) for _, _, block in blocks for p in block.parameters()}
    return any(id(p) not in in_blocks for p in part.parameters())


def frozen_bytes_rule(model: nn.Module, part: nn.Module, dp_size: int) -> tuple[int, float]:
    """``(bytes of part's weights on a rank, bytes of this rank's shard of the trainable
    parameters with gradients and AdamW state)``: a frozen part is kept replicated when the
    first is at most the second (``apply_fsdp2``'s ``shard_frozen=None``)."""

    def local_numel(p: torch.Tensor) -> int:
        return p.to_local().numel() if isinstance(p, DTensor) else p.numel()

    frozen = sum(local_numel(p) * p.element_size() for p in part.parameters())
    trainable = sum(local_numel(p) for p in model.parameters() if p.requires_grad)
    # fp32 weight + fp32 gradient + AdamW exp_avg + exp_avg_sq = 16 bytes per parameter.
    return frozen, 16 * trainable / dp_size


def _keep_frozen_replicated(
    model: nn.Module, part: nn.Module, dp_size: int, shard_frozen: bool | None
) -> bool:
    params = list(part.parameters())
    if not params or any(p.requires_grad for p in params):
        return False
    if shard_frozen is not None:
        return not shard_frozen
    frozen, budget = frozen_bytes_rule(model, part, dp_size)
    return frozen <= budget


def _compute_in(part: nn.Module, dtype: torch.dtype | None) -> None:
    """A replicated frozen part has no FSDP2 policy: run it under autocast in ``dtype``."""
    if dtype is not None and dtype != torch.float32:
        enable_autocast(part, dtype)


def _shard_expert_parallel_block(
    block: nn.Module,
    experts: list[nn.Module],
    device_mesh: DeviceMesh,
    reshard: bool | int,
    kwargs: _ShardKwargs,
) -> None:
    """Per-sub-module FSDP2 units for a block holding expert-parallel modules."""
    dense_mesh = kwargs["mesh"]
    expert_kwargs: _ShardKwargs = {**kwargs, "mesh": get_expert_dp_mesh(device_mesh)}
    for module in experts:
        # An int reshard size refers to the dense shard group; experts reshard fully instead.
        # fully_shard returns ``module`` itself, now an FSDPModule.
        sharded = fully_shard(
            module,
            reshard_after_forward=reshard if isinstance(reshard, bool) else True,
            **expert_kwargs,
        )
        # NOTE: the expert gradient arrives summed over its ep peers' tokens; dividing by the
        # full data-parallel degree (not the smaller expert mesh) gives the dense average.
        sharded.set_gradient_divide_factor(float(dense_mesh.size()))
        expert_mesh = expert_kwargs["mesh"]
        shard_group = expert_mesh.get_group(expert_mesh.ndim - 1)
        if dist.get_backend(shard_group) == "gloo" and shard_group.size() > 1:
            # gloo has no PREMUL_SUM: reduce with SUM and divide afterwards. NOTE: not with a
            # shard group of one, where FSDP2 (torch 2.15) would then divide twice.
            sharded.set_force_sum_reduction_for_comms(True)
    # Composite children (attention; the MoE with its router and shared expert) get their own
    # units; leaf children (norms) stay with the block's unit.
    for child in block.children():
        composite = any(True for _ in child.children())
        if composite and not isinstance(child, FSDPModule):
            fully_shard(child, reshard_after_forward=reshard, **kwargs)
    fully_shard(block, reshard_after_forward=reshard, **kwargs)


def apply_ddp(model: nn.Module, device_mesh: DeviceMesh) -> DistributedDataParallel:
    """Replicate ``model`` with DDP over the 1-D data-parallel axis; returns the DDP wrapper.

    The parameters must be materialized (DDP broadcasts rank 0's values when it wraps).
    """
    if not has_dp_mesh(device_mesh):
        raise ForgeConfigError(
            "apply_ddp needs a data-parallel axis (parallelism.dp_replicate > 1)"
        )
    # NOTE: with cp > 1 the context-parallel ranks hold the same parameters too: DDP averages
    # over dp x cp (forge_mesh's dp_cp view).
    dp_mesh = sub_mesh(device_mesh, "dp_cp") if has_axis(device_mesh, "dp_cp") else None
    dp_mesh = dp_mesh or get_dp_mesh(device_mesh)
    if dp_mesh.ndim != 1:
        raise ForgeConfigError(
            f"apply_ddp needs one data-parallel axis, got {dp_mesh.mesh_dim_names}; DDP replicates: "
            "use data='ddp' with dp_replicate only, or data='fsdp2' for HSDP"
        )
    if any(p.is_meta for p in model.parameters()):
        raise ForgeConfigError(
            "apply_ddp needs materialized parameters: call to_empty + init_weights first"
        )
    with stage(model, "ddp"):
        device = next(model.parameters()).device
        device_ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(
            model, process_group=dp_mesh.get_group(), device_ids=device_ids
        )
    return wrapped


@contextmanager
def unshard_fsdp2_model(model: nn.Module) -> Iterator[None]:
    """Gather every FSDP unit's full parameters for the duration; reshard on exit, even on error."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    try:
        for unit in units:
            unit.unshard()
        mark_copies(model, [model])  # an optimizer built in here would hold them
        yield
    finally:
        for unit in units:
            unit.reshard()

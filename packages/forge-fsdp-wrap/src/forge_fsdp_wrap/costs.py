"""FSDP2's and DDP's collectives in a training step, counted for ``forge plan``.

Read off the model as ``apply_fsdp2`` wrapped it (each unit's parameter group: its mesh, its
padded shard sizes, whether it reshards after forward), so the count is what FSDP2 will run,
not a formula of the config.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch.nn as nn
from forge_core.costs import CollectiveTally
from forge_core.torch_compat import fsdp_param_groups, fsdp_reshards_root_after_forward
from torch.distributed.fsdp import FSDPModule

__all__ = ["DDP_BUCKET_BYTES", "ddp_collectives", "fsdp_collectives", "module_pattern"]

DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def module_pattern(name: str) -> str:
    """A module name with wrapper parts dropped and block numbers folded to ``*``."""
    name = re.sub(r"\._checkpoint_wrapped_module|\._orig_mod", "", name)
    return re.sub(r"\.\d+(\.|$)", r".*\1", name) or "(root)"


def fsdp_collectives(
    tally: CollectiveTally,
    modules: Sequence[nn.Module],
    *,
    passes: int,
    pipelined: bool,
    itemsize: int,
) -> None:
    """Each FSDP2 unit's all-gathers, reduce-scatters and HSDP all-reduces in a step of
    ``passes`` forward+backward passes (``itemsize``: bytes per gathered parameter element;
    gradients are reduced in float32). ``pipelined``: the modules are pipeline stages."""
    # NOTE: torch leaves named_modules' return type unannotated (Any); typed here for the checker
    named: list[tuple[str, nn.Module]] = [nu for module in modules for nu in module.named_modules()]
    for name, unit in named:
        if not isinstance(unit, FSDPModule):
            continue
        for group in fsdp_param_groups(unit):  # one per unit in forge
            info, fps = group.mesh_info, group.fsdp_params
            what = f"FSDP2 unit {module_pattern(name)}"
            n, axis = info.shard_mesh_size, info.mesh.mesh_dim_names[info.shard_mesh_dim]
            numel = sum(fp.padded_sharded_param_size.numel() for fp in fps)
            trained = [fp for fp in fps if fp.sharded_param.requires_grad]
            grads = sum(fp.padded_sharded_param_size.numel() for fp in trained)
            post = group.post_forward_mesh_info
            # NOTE: a pipeline stage keeps its gathered parameters from its first forward to its
            # last backward (reshard_after_forward=False; torch's stage turns reshard after
            # backward off until the step's gradient reduction): one all-gather per step.
            gathers = 1 if pipelined and post is None else passes
            tally.add(
                "forward all_gather", axis, numel * n * itemsize, gathers, what + " params", n
            )
            # FSDP2 keeps the root's parameters after forward only when its reshard_after_forward
            # was left unset (forge sets it); every other resharded unit is gathered again.
            if post is not None and (name or not fsdp_reshards_root_after_forward(unit)):
                again, size = what + " params again", post.shard_mesh_size
                tally.add("backward all_gather", axis, numel * n * itemsize, passes, again, size)
            tally.add(
                "backward reduce_scatter", axis, grads * n * 4, int(grads > 0), what + " grads", n
            )
            if hasattr(info, "replicate_mesh_size"):
                rep, size = info.mesh.mesh_dim_names[0], info.replicate_mesh_size
                tally.add(
                    "backward all_reduce", rep, grads * 4, int(grads > 0), what + " (HSDP)", size
                )


def ddp_collectives(tally: CollectiveTally, params: Sequence[nn.Parameter]) -> None:
    """DDP's gradient all-reduces over ``dp_replicate``: one per bucket of float32 gradients."""
    total = sum(p.numel() * 4 for p in params if p.requires_grad)
    for i in range(math.ceil(total / DDP_BUCKET_BYTES)):
        nbytes = min(DDP_BUCKET_BYTES, total - i * DDP_BUCKET_BYTES)
        tally.add("backward all_reduce", "dp_replicate", nbytes, 1, "DDP gradient bucket")

"""Activation checkpointing: trade recompute for activation memory, per block.

Modes:

- ``none``       nothing is wrapped
- ``full``       every block is checkpointed: only block inputs are kept, the whole block is
                 recomputed in backward (most memory saved, ~1 extra forward)
- ``selective``  only the attention module of each block is checkpointed
- ``op``         op-level selective checkpointing of every block: outputs of matmuls, attention
                 kernels and communication ops are saved, the cheap element-wise rest (norms,
                 activations, RoPE) is recomputed. Recomputing a matmul costs FLOPs; recomputing
                 a SiLU costs only bandwidth, so this keeps most of the speed of ``none`` while
                 dropping the many element-wise intermediates.

Must run before compile and FSDP2 (checked by the stage-order contract): FSDP2 must shard the
wrapped blocks, and compile must see the checkpoint boundaries.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
import torch.nn as nn
from forge_core.errors import ForgeConfigError
from forge_core.stages import stage
from forge_core.torch_compat import checkpoint_wrapper
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .blocks import component_blocks
from .checks import AC_MODES, check_ac_mode

__all__ = ["AC_MODES", "apply_ac"]

_ATTENTION_NAMES = ("attention", "self_attn", "attn")


def _saved_ops() -> set[object]:
    """Ops whose outputs ``op`` mode keeps (those that exist in this torch build)."""
    aten = torch.ops.aten
    names = [
        (aten, "mm"),
        (aten, "addmm"),
        (aten, "bmm"),
        (aten, "_scaled_mm"),
        (aten, "_grouped_mm"),
        (aten, "_scaled_dot_product_flash_attention"),
        (aten, "_scaled_dot_product_efficient_attention"),
        (aten, "_scaled_dot_product_cudnn_attention"),
        (aten, "_scaled_dot_product_flash_attention_for_cpu"),
    ]
    ops = {getattr(ns, n).default for ns, n in names if hasattr(ns, n)}
    c10d = getattr(torch.ops, "_c10d_functional", None)
    for n in ("reduce_scatter_tensor", "all_to_all_single"):
        if c10d is not None and hasattr(c10d, n):
            ops.add(getattr(c10d, n).default)
    return ops


def _op_policy(
    saved: set[object], ctx: object, func: object, *args: object, **kwargs: object
) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _op_context_fn(saved: set[object]):  # noqa: ANN202 - torch's context_fn protocol
    return create_selective_checkpoint_contexts(partial(_op_policy, saved))


def _op_checkpoint_kwargs(saved: set[object]) -> dict[str, object]:
    kwargs: dict[str, object] = {"context_fn": partial(_op_context_fn, saved)}
    # NOTE: torch >= 2.15 can route the tensors SAC saves through active saved_tensors_hooks
    # (e.g. save_on_cpu offload); older versions silently bypass them. Opt in where available.
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
        kwargs["respect_saved_tensors_hooks"] = True
    return kwargs


def _attention_of(block: nn.Module) -> tuple[nn.Module, str]:
    for name in _ATTENTION_NAMES:
        if isinstance(getattr(block, name, None), nn.Module):
            return block, name
    raise ForgeConfigError(
        f"ac_mode='selective' checkpoints attention, but block {type(block).__name__} has none of "
        f"{list(_ATTENTION_NAMES)}; use ac_mode='full' or 'op'"
    )


def apply_ac(
    model: nn.Module, mode: str, *, components: tuple[str, ...] | list[str] | None = None
) -> nn.Module:
    """Apply activation checkpointing ``mode`` to ``model``'s blocks in place; returns ``model``.

    For a model made of components (a VLM), ``components`` names those whose blocks are
    checkpointed (None: all that have blocks).
    """
    check_ac_mode(mode)
    if mode == "none":  # nothing is wrapped, so nothing is recorded: a later mode may still run
        return model
    with stage(model, "ac"):
        op_kwargs = _op_checkpoint_kwargs(_saved_ops()) if mode == "op" else {}
        blocks = [b for _, _, part in component_blocks(model, components) for b in part]
        for container, key, block in blocks:
            if mode == "full":
                container.register_module(key, checkpoint_wrapper(block))
            elif mode == "selective":
                parent, name = _attention_of(block)
                parent.register_module(name, checkpoint_wrapper(getattr(parent, name)))
            else:
                container.register_module(key, checkpoint_wrapper(block, **op_kwargs))
    return model

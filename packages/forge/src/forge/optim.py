"""forge train's optimizer helpers: gradient clipping over every mesh and the LR schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from forge_core.training import global_grad_norm
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["adamw", "clip_grad_norm_", "warmup_cosine"]

#: torch.optim.AdamW's ``(foreach, fused)`` for each ``training.optimizer_impl``.
_IMPL_FLAGS: dict[str, tuple[bool | None, bool | None]] = {
    "auto": (None, None),
    "for-loop": (False, None),
    "foreach": (True, None),
    "fused": (None, True),
}


def adamw(
    parameters: list[nn.Parameter], *, lr: float, weight_decay: float, impl: str = "auto"
) -> torch.optim.AdamW:
    """forge train's AdamW in the implementation ``training.optimizer_impl`` names. The three
    compute the same update; ``fused`` reads and writes each parameter's state once per step
    (one kernel per dtype and device), where ``foreach`` makes several passes over it and
    ``for-loop`` launches per parameter.

    ``auto`` is ``fused`` when every parameter is on a GPU: on the H200 it took the optimizer
    from 23.8 to 14.6 ms of a ~1B model's step and ``forge train`` from 48.2k to 55.3k tokens/s
    (benchmarks/gpu/2026-11-28-h200/train.md); elsewhere it is torch's own default (the
    for-loop on CPU)."""
    if impl == "auto" and parameters and all(_local(p).is_cuda for p in parameters):
        impl = "fused"
    foreach, fused = _IMPL_FLAGS[impl]
    return torch.optim.AdamW(
        parameters, lr=lr, weight_decay=weight_decay, foreach=foreach, fused=fused
    )


def clip_grad_norm_(
    parameters: list[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Scale gradients so that their global ``norm_type``-norm is at most ``max_norm``; returns
    the norm, in the gradients' dtype and on their device (as torch's does).

    Unlike ``torch.nn.utils.clip_grad_norm_``, the norm covers gradients on several meshes at
    once (TP DTensors, FSDP2 shards, EP experts on their own mesh, plain tensors): each mesh's
    part is reduced over that mesh, then the parts are combined (:func:`global_grad_norm`).
    ``max_norm <= 0`` only measures. Clipping multiplies by ``max_norm / (norm + 1e-6)`` when
    that is below 1, as torch does. With a ``mesh`` that has a ``pp`` axis the norm covers every
    pipeline stage (:func:`global_grad_norm`).
    """
    norm = global_grad_norm(parameters, norm_type, mesh=mesh)
    if max_norm > 0:
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for q in parameters:
                if q.grad is not None:
                    q.grad.mul_(coef)
    first = next((q.grad for q in parameters if q.grad is not None), None)
    if first is None:
        return norm
    local = _local(first)
    return norm.to(device=local.device, dtype=local.dtype)


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return p.to_local() if isinstance(p, DTensor) else p


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR factor at optimizer step ``step`` (0-based): linear warmup, then cosine to ``min_ratio``.

    Warmup reaches the full LR at step ``warmup_steps - 1``; the cosine then falls from 1 to
    ``min_ratio`` at step ``total_steps`` and stays there.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

"""Routing layouts and token permute / unpermute / combine for MoE experts, with no host sync.

Provides:

- :class:`RoutingLayout` ``(counts, offs, gather_idx, scatter_idx)`` and
  :func:`routing_layout` / :func:`routing_layout_reference`: the expert-major, optionally
  padded row layout of ``expert_ids [T, K]`` (slot ``s = t*K + k``), ready for
  ``torch._grouped_mm(..., offs=layout.offs)``.
- :func:`permute` ``x [T, D] -> x_perm [capacity, D]``, :func:`unpermute`
  ``y_perm -> y_slots [T*K, D]``, :func:`combine` ``y_perm, weights [T, K] -> out [T, D]``
  (the weighted return to token order), all differentiable in every float input.
- :func:`rank_major_to_expert_major`: the reorder of all-to-all receive buffers (blocks ordered
  source rank then local expert) into expert-major order.
- :func:`routing_capacity` (the static row count) and :func:`backend_used` (which path runs).

Notable choices:

- Everything is sized from ``T, K, E, align`` (``capacity = T*K`` if ``align == 1`` else
  ``T*K + E*(align - 1)``), so no function reads a device value on the host (the precondition
  for ``torch.cuda.set_sync_debug_mode("error")`` and CUDA-graph capture). Rows past ``offs[-1]`` and
  padding rows hold the sentinel slot ``T*K`` in ``gather_idx``; ``permute`` writes exact zeros
  there.
- Within an expert, slots keep increasing slot order (the stable argsort), so the Triton and the
  PyTorch paths (and a native op following the same contract) agree bit for bit.
- Two backends: ``"triton"`` (default for CUDA tensors; also CPU tensors when
  ``TRITON_INTERPRET=1`` was set before the kernels were first imported) and ``"torch"`` (default
  on CPU; sync-free PyTorch ops: ``scatter_add_``, stable ``argsort``, ``searchsorted``).
  :func:`backend_used` resolves the choice; it is a pure function of device and request.
- ``combine`` gathers each token's K rows and sums them in k order in fp32 (fp64 for fp64
  rows): deterministic, no atomics; padding rows are never read (NaN there is harmless). Its output has ``y_perm``'s dtype; the weight gradient has ``weights``' dtype.
- Ids outside ``[0, E)`` are dropped by :func:`routing_layout` (``scatter_idx == capacity``). A
  slot whose ``scatter_idx`` is ``>= y_perm.shape[0]`` (dropped; e.g. over an expert's capacity)
  reads as a zero row in :func:`unpermute` and contributes nothing to :func:`combine` (zero
  weight gradient) on both backends.
- Under ``torch.compile`` the Triton path is an opaque ``autograd.Function`` (a graph break);
  the torch path compiles with ``fullgraph=True`` (checked on CPU, torch 2.15).
"""

from __future__ import annotations

import os
from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from .routing import RoutingLayout, check_routing_args, routing_capacity, routing_layout_reference

Backend = Literal["triton", "torch"]

__all__ = [
    "Backend",
    "RoutingLayout",
    "backend_used",
    "combine",
    "permute",
    "rank_major_to_expert_major",
    "rank_major_to_expert_major_reference",
    "routing_capacity",
    "routing_layout",
    "routing_layout_reference",
    "unpermute",
]


# --------------------------------------------------------------------------- backend choice
def _triton_module():
    """The kernels module, imported on first use (triton fixes interpreter mode at import)."""
    from forge_kernels import _permute_triton

    return _permute_triton


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_used(device: torch.device | str | torch.Tensor, backend: str | None = None) -> Backend:
    """The path the functions of this module take for tensors on ``device``.

    ``backend=None`` picks ``"triton"`` for CUDA tensors (when triton imports) and ``"torch"``
    otherwise. ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` in the environment before
    the kernels are first imported.
    """
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend={backend!r}; choose None, 'triton' or 'torch'")
    dev = device.device if isinstance(device, torch.Tensor) else torch.device(device)
    if backend == "torch":
        return "torch"
    if backend is None:
        return "triton" if dev.type == "cuda" and _triton_importable() else "torch"
    if not _triton_importable():
        raise ValueError("backend='triton' needs the triton package; install it or use 'torch'")
    if dev.type == "cuda":
        return "triton"
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        if not _triton_module().INTERPRETED:
            raise ValueError(
                "backend='triton' on CPU: the kernels were imported before TRITON_INTERPRET=1 "
                "was set; set it before the first call (e.g. at the top of the test module)"
            )
        return "triton"
    raise ValueError(
        f"backend='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1; got "
        f"{dev.type} tensors. Use backend='torch' or None."
    )


# --------------------------------------------------------------------------- routing layout
def routing_layout(
    expert_ids: torch.Tensor, num_experts: int, align: int = 1, *, backend: str | None = None
) -> RoutingLayout:
    """Expert-major (padded) layout of a top-k routing, computed on the device with no host sync.

    Args:
        expert_ids: int32/int64 [T, K], top-k expert ids per token, values in [0, num_experts).
        num_experts: E, the number of (local) experts.
        align: group size multiple (1 = unpadded; 8/16/32 for bf16/fp8/mxfp8 grouped GEMMs).
        backend: None (triton on CUDA, torch elsewhere), "triton" or "torch"; see
            :func:`backend_used`.

    Returns:
        :class:`RoutingLayout` with ``capacity = routing_capacity(T, K, E, align)`` rows.
    """
    check_routing_args(expert_ids, num_experts, align)
    if backend_used(expert_ids, backend) == "torch":
        return routing_layout_reference(expert_ids, num_experts, align)
    t, k = expert_ids.shape
    capacity = routing_capacity(t, k, num_experts, align)
    return RoutingLayout(
        *_triton_module().routing_layout_triton(expert_ids, num_experts, align, capacity)
    )


# --------------------------------------------------------------------------- autograd (triton)
class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gather_idx, scatter_idx, top_k):
        ctx.save_for_backward(scatter_idx)
        ctx.top_k, ctx.num_tokens = top_k, x.shape[0]
        return _triton_module().gather_rows(x, gather_idx, top_k, scatter_idx.numel())

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (scatter_idx,) = ctx.saved_tensors
        grad_x = _triton_module().combine_rows(
            grad_out.contiguous(), scatter_idx, None, ctx.num_tokens, ctx.top_k
        )
        return grad_x, None, None, None


class _UnpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_perm, gather_idx, scatter_idx):
        ctx.save_for_backward(gather_idx)
        ctx.num_slots = scatter_idx.numel()
        return _triton_module().gather_rows(y_perm, scatter_idx, 1, y_perm.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_slots):
        (gather_idx,) = ctx.saved_tensors
        grad_y = _triton_module().gather_rows(grad_slots.contiguous(), gather_idx, 1, ctx.num_slots)
        return grad_y, None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_perm, gather_idx, scatter_idx, weights):
        t, k = weights.shape
        w_flat = weights.contiguous().view(-1)
        ctx.save_for_backward(y_perm, gather_idx, scatter_idx, w_flat)
        ctx.top_k, ctx.w_shape, ctx.w_dtype = k, weights.shape, weights.dtype
        return _triton_module().combine_rows(y_perm, scatter_idx, w_flat, t, k)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        y_perm, gather_idx, scatter_idx, w_flat = ctx.saved_tensors
        kern, grad_out = _triton_module(), grad_out.contiguous()
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = kern.gather_rows(
                grad_out,
                gather_idx,
                ctx.top_k,
                w_flat.numel(),
                scale=w_flat,
                out_dtype=y_perm.dtype,
            )
        if ctx.needs_input_grad[3]:
            grad_w = kern.slot_row_dot(grad_out, y_perm, scatter_idx, ctx.top_k, ctx.w_dtype)
            grad_w = grad_w.view(ctx.w_shape)
        return grad_y, None, None, grad_w


# --------------------------------------------------------------------------- row movement
def _check_rows(name: str, t: torch.Tensor, layout: RoutingLayout) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, D]; got shape {tuple(t.shape)}")
    if t.device != layout.gather_idx.device:
        raise ValueError(
            f"{name} is on {t.device} but the layout is on {layout.gather_idx.device}; "
            "move one of them"
        )


def _check_capacity_rows(name: str, y_perm: torch.Tensor, layout: RoutingLayout) -> None:
    _check_rows(name, y_perm, layout)
    if y_perm.shape[0] != layout.gather_idx.numel():
        raise ValueError(
            f"{name} has {y_perm.shape[0]} rows but the layout has capacity "
            f"{layout.gather_idx.numel()}; pass the expert-major [capacity, D] output"
        )


def permute(
    x: torch.Tensor, layout: RoutingLayout, top_k: int, *, backend: str | None = None
) -> torch.Tensor:
    """Token rows into expert-major order: ``x [T, D] -> x_perm [capacity, D]``.

    Row r is ``x[gather_idx[r] // top_k]``; padding and unused rows are exact zeros.
    Differentiable in ``x`` (the gradient sums each token's K rows).
    """
    _check_rows("x", x, layout)
    if x.shape[0] * top_k != layout.scatter_idx.numel():
        raise ValueError(
            f"x has {x.shape[0]} tokens and top_k={top_k}, but the layout routes "
            f"{layout.scatter_idx.numel()} slots; expected T * top_k == T*K of the routing"
        )
    if backend_used(x, backend) == "triton":
        return _PermuteFn.apply(x, layout.gather_idx, layout.scatter_idx, top_k)
    # NOTE: the sentinel T*K maps to token T, an appended zero row: no masking, no sync.
    x_padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return x_padded[layout.gather_idx // top_k]


def _rows_or_zero(y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``y[rows]`` with zero rows where ``rows >= len(y)`` (dropped slots); no host sync."""
    if y.shape[0] == 0:
        # Every slot dropped: zeros that stay attached to y, so gradients upstream are zeros
        # (not None) and optimizer state keeps its shape.
        return y.sum(0, keepdim=True).expand(rows.numel(), -1)
    valid = rows < y.shape[0]
    picked = y[rows.clamp(max=y.shape[0] - 1)]
    # NOTE: where, not a multiply: the clamped row may hold NaN (uninitialized grouped_mm rows).
    return torch.where(valid.unsqueeze(-1), picked, picked.new_zeros(()))


def unpermute(
    y_perm: torch.Tensor, layout: RoutingLayout, *, backend: str | None = None
) -> torch.Tensor:
    """Expert-major rows back to slot order: ``y_slots[s] = y_perm[scatter_idx[s]]`` [T*K, D].

    Differentiable in ``y_perm`` (padding rows get zero gradient).
    """
    _check_capacity_rows("y_perm", y_perm, layout)
    if backend_used(y_perm, backend) == "triton":
        return _UnpermuteFn.apply(y_perm, layout.gather_idx, layout.scatter_idx)
    return _rows_or_zero(y_perm, layout.scatter_idx)


def combine(
    y_perm: torch.Tensor,
    layout: RoutingLayout,
    weights: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Weighted return to token order: ``out[t] = sum_k weights[t, k] * y_perm[scatter_idx[t*K+k]]``.

    Args:
        y_perm: [capacity, D] expert outputs in the layout's expert-major order. Padding rows
            are never read (they may hold garbage, NaN included).
        layout: the :class:`RoutingLayout` the rows were permuted with.
        weights: [T, K] routing weights (any float dtype).

    Returns:
        [T, D] in ``y_perm``'s dtype, summed over k in order in fp32 (fp64 for fp64 inputs);
        deterministic.
        Differentiable in ``y_perm`` and ``weights``.
    """
    _check_capacity_rows("y_perm", y_perm, layout)
    if weights.dim() != 2 or weights.numel() != layout.scatter_idx.numel():
        raise ValueError(
            f"weights must be [T, K] with T*K == {layout.scatter_idx.numel()} slots; got shape "
            f"{tuple(weights.shape)}"
        )
    if weights.device != y_perm.device:
        raise ValueError(f"weights are on {weights.device} but y_perm is on {y_perm.device}")
    if backend_used(y_perm, backend) == "triton":
        return _CombineFn.apply(y_perm, layout.gather_idx, layout.scatter_idx, weights)
    t, k = weights.shape
    acc = torch.float64 if y_perm.dtype == torch.float64 else torch.float32
    y_slots = _rows_or_zero(y_perm, layout.scatter_idx).view(t, k, y_perm.shape[1])
    out = (y_slots.to(acc) * weights.to(acc).unsqueeze(-1)).sum(1)
    return out.to(y_perm.dtype)


# --------------------------------------------------------------------------- rank -> expert major
def _check_counts_re(counts_re: torch.Tensor, capacity: int) -> None:
    if counts_re.dim() != 2 or counts_re.shape[0] < 1 or counts_re.shape[1] < 1:
        raise ValueError(
            f"counts_RE must be [R, E_local] with R, E_local >= 1; got shape "
            f"{tuple(counts_re.shape)}"
        )
    if counts_re.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"counts_RE must be int32 or int64; got {counts_re.dtype}")
    if not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be a non-negative int; got {capacity!r}")


def rank_major_to_expert_major_reference(
    counts_re: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rank_major_to_expert_major` in plain PyTorch ops, also without host sync."""
    _check_counts_re(counts_re, capacity)
    r, e = counts_re.shape
    counts = counts_re.long()
    in_start = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view(r, e)
    counts_er = counts.t().reshape(-1)  # blocks in expert-major order: b = e*R + r
    out_end = torch.cumsum(counts_er, 0)
    rows = torch.arange(capacity, device=counts_re.device)
    block = torch.searchsorted(out_end, rows, right=True)
    valid = block < r * e
    block = block.clamp(max=r * e - 1)
    src = in_start[block % r, block // r] + rows - (out_end - counts_er)[block]
    index = torch.where(valid, src, torch.full_like(src, capacity))
    offs = out_end.view(e, r)[:, -1].int()
    return index, offs


def rank_major_to_expert_major(
    counts_RE: torch.Tensor, capacity: int, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather index that reorders all-to-all receive rows from rank-major to expert-major.

    Received rows arrive as contiguous blocks ordered by source rank r, then local expert e
    (block (r, e) has ``counts_RE[r, e]`` rows). Output row i of the expert-major order (expert
    e, then source rank r, rows of a block in arrival order) is received row ``index[i]``.

    Args:
        counts_RE: int32/int64 [R, E_local] rows received from each rank for each local expert.
        capacity: static size of the receive buffer; must be >= ``counts_RE.sum()`` (not
            checked: that would sync; rows past ``capacity`` are dropped).
        backend: as in :func:`routing_layout`.

    Returns:
        ``(index int64 [capacity], offs int32 [E_local])``; ``index`` holds the sentinel
        ``capacity`` for rows past the last block, ``offs`` the cumulative per-expert ends.
    """
    _check_counts_re(counts_RE, capacity)
    if backend_used(counts_RE, backend) == "torch":
        return rank_major_to_expert_major_reference(counts_RE, capacity)
    return _triton_module().rank_major_to_expert_major_triton(counts_RE, capacity)

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
  on CPU; sync-free PyTorch ops: ``scatter_add_``, stable ``argsort``, ``searchsorted``,
  ``index_select``, ``bmm``). :func:`backend_used` resolves the choice; it is a pure function of
  device and request. Both run the same autograd Functions (row movers from
  :mod:`forge_kernels.permute._triton` or :mod:`forge_kernels.permute._rows`), and every backward
  is a gather: no accumulating scatter, no atomics.
- ``combine`` gathers each token's K rows and sums them in fp32 (fp64 for fp64 rows):
  deterministic; padding rows never reach the result (NaN there is harmless). Its output has
  ``y_perm``'s dtype; the weight gradient has ``weights``' dtype.
- Ids outside ``[0, E)`` are dropped by :func:`routing_layout` (``scatter_idx == capacity``). A
  slot whose ``scatter_idx`` is ``>= y_perm.shape[0]`` (dropped; e.g. over an expert's capacity)
  reads as a zero row in :func:`unpermute` and contributes nothing to :func:`combine` (zero
  weight gradient) on both backends.
- The lean path: masking padding rows and dropped slots costs the PyTorch path a pass over the
  rows. ``dense=True`` (static, no sync) is the caller's promise that the layout is a
  permutation of the slots (``align == 1`` and every id in ``[0, E)``, as for a top-k router's
  dropless dispatch): the passes are skipped. Not checked (a check would sync): a layout with
  padding or dropped slots under ``dense=True`` reads wrong rows.
- Under ``torch.compile`` both paths are ``autograd.Function`` s (the Triton one opaque).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from ..grouped_gemm import _interpreter_requested, _triton_importable
from ..routing import RoutingLayout, check_routing_args, routing_capacity, routing_layout_reference
from . import _rows

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
    from forge_kernels.permute import _triton as _permute_triton

    return _permute_triton


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
    if dev.type == "cpu" and _interpreter_requested():
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
    return RoutingLayout(*_triton_module().routing_layout_triton(expert_ids, num_experts, align))


# --------------------------------------------------------------------------- autograd
# One set of Functions for both backends: ``on_triton`` picks the kernels of
# forge_kernels.permute._triton or the PyTorch ops of forge_kernels.permute._rows (same signatures),
# so both share the same backward structure (gathers only). ``dense`` is the caller's static
# promise that nothing needs masking (used by the PyTorch ops; the kernels mask for free).
def _row_ops(on_triton: bool):
    return _triton_module() if on_triton else _rows


class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gather_idx, scatter_idx, top_k, on_triton, dense):
        ctx.save_for_backward(gather_idx, scatter_idx)
        ctx.top_k, ctx.num_tokens, ctx.on_triton, ctx.dense = top_k, x.shape[0], on_triton, dense
        ops = _row_ops(on_triton)
        return ops.gather_rows(x, gather_idx, top_k, scatter_idx.numel(), dense=dense)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        gather_idx, scatter_idx = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = None
        if not ctx.on_triton:
            grad_x = _rows.token_sum(
                grad_out, gather_idx, ctx.num_tokens, ctx.top_k, scatter_idx.numel(), ctx.dense
            )
        if grad_x is None:
            grad_x = _row_ops(ctx.on_triton).combine_rows(
                grad_out, scatter_idx, None, ctx.num_tokens, ctx.top_k, dense=ctx.dense
            )
        return grad_x, None, None, None, None, None


class _UnpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_perm, gather_idx, scatter_idx, on_triton, dense):
        ctx.save_for_backward(gather_idx)
        ctx.num_slots, ctx.on_triton, ctx.dense = scatter_idx.numel(), on_triton, dense
        return _row_ops(on_triton).gather_rows(y_perm, scatter_idx, 1, y_perm.shape[0], dense=dense)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_slots):
        (gather_idx,) = ctx.saved_tensors
        grad_y = _row_ops(ctx.on_triton).gather_rows(
            grad_slots.contiguous(), gather_idx, 1, ctx.num_slots, dense=ctx.dense
        )
        return grad_y, None, None, None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_perm, gather_idx, scatter_idx, weights, on_triton, dense):
        t, k = weights.shape
        w_flat = weights.contiguous().view(-1)
        ctx.save_for_backward(y_perm, gather_idx, scatter_idx, w_flat)
        ctx.top_k, ctx.w_shape = k, weights.shape
        ctx.on_triton, ctx.dense = on_triton, dense
        return _row_ops(on_triton).combine_rows(y_perm, scatter_idx, w_flat, t, k, dense=dense)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        y_perm, gather_idx, scatter_idx, w_flat = ctx.saved_tensors
        grad_y, grad_w = _row_ops(ctx.on_triton).combine_backward(
            grad_out.contiguous(),
            y_perm,
            gather_idx,
            scatter_idx,
            w_flat,
            ctx.top_k,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[3],
            dense=ctx.dense,
        )
        grad_w = None if grad_w is None else grad_w.view(ctx.w_shape)
        return grad_y, None, None, grad_w, None, None


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
    x: torch.Tensor,
    layout: RoutingLayout,
    top_k: int,
    *,
    backend: str | None = None,
    dense: bool = False,
) -> torch.Tensor:
    """Token rows into expert-major order: ``x [T, D] -> x_perm [capacity, D]``.

    Row r is ``x[gather_idx[r] // top_k]``; padding and unused rows are exact zeros.
    Differentiable in ``x`` (the gradient sums each token's K rows). ``dense``: see the module
    docstring (the lean path).
    """
    _check_rows("x", x, layout)
    if x.shape[0] * top_k != layout.scatter_idx.numel():
        raise ValueError(
            f"x has {x.shape[0]} tokens and top_k={top_k}, but the layout routes "
            f"{layout.scatter_idx.numel()} slots; expected T * top_k == T*K of the routing"
        )
    on_triton = backend_used(x, backend) == "triton"
    return _PermuteFn.apply(x, layout.gather_idx, layout.scatter_idx, top_k, on_triton, dense)


def unpermute(
    y_perm: torch.Tensor,
    layout: RoutingLayout,
    *,
    backend: str | None = None,
    dense: bool = False,
) -> torch.Tensor:
    """Expert-major rows back to slot order: ``y_slots[s] = y_perm[scatter_idx[s]]`` [T*K, D].

    Dropped slots read as zero rows. Differentiable in ``y_perm`` (padding rows get zero
    gradient). ``dense``: see the module docstring (the lean path).
    """
    _check_capacity_rows("y_perm", y_perm, layout)
    on_triton = backend_used(y_perm, backend) == "triton"
    return _UnpermuteFn.apply(y_perm, layout.gather_idx, layout.scatter_idx, on_triton, dense)


def combine(
    y_perm: torch.Tensor,
    layout: RoutingLayout,
    weights: torch.Tensor,
    *,
    backend: str | None = None,
    dense: bool = False,
) -> torch.Tensor:
    """Weighted return to token order: ``out[t] = sum_k weights[t, k] * y_perm[scatter_idx[t*K+k]]``.

    Args:
        y_perm: [capacity, D] expert outputs in the layout's expert-major order. Padding rows
            are never read into the result (they may hold garbage, NaN included).
        layout: the :class:`RoutingLayout` the rows were permuted with.
        weights: [T, K] routing weights (any float dtype).
        dense: see the module docstring (the lean path).

    Returns:
        [T, D] in ``y_perm``'s dtype, summed over k in fp32 (fp64 for fp64 inputs);
        deterministic. Differentiable in ``y_perm`` and ``weights`` (a dropped slot gets a
        zero weight gradient).
    """
    _check_capacity_rows("y_perm", y_perm, layout)
    if weights.dim() != 2 or weights.numel() != layout.scatter_idx.numel():
        raise ValueError(
            f"weights must be [T, K] with T*K == {layout.scatter_idx.numel()} slots; got shape "
            f"{tuple(weights.shape)}"
        )
    if weights.device != y_perm.device:
        raise ValueError(f"weights are on {weights.device} but y_perm is on {y_perm.device}")
    on_triton = backend_used(y_perm, backend) == "triton"
    return _CombineFn.apply(
        y_perm, layout.gather_idx, layout.scatter_idx, weights, on_triton, dense
    )


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

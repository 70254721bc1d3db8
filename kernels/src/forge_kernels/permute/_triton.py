"""Triton kernels behind :mod:`forge_kernels.permute` (private: call the public API there).

Provides launchers for:

- :func:`routing_layout_triton` (from :mod:`forge_kernels.permute._routing_triton`): counts / padded
  offs / gather / scatter indices, with no sort and no atomics.
- :func:`gather_rows`: ``out[r] = scale[idx[r]] * src[idx[r] // div]`` or zeros when
  ``idx[r] >= n_valid`` (permute, unpermute and all their backward gathers).
- :func:`combine_rows`: ``out[t] = sum_k w[t, k] * y[scatter[t*K + k]]``, one program per token
  tile, k summed in order in fp32 (fp64 for fp64 operands): deterministic, no atomics (also
  ``permute``'s backward).
- :func:`slot_row_dot`: ``out[s] = <g[s // K], y[scatter[s]]>`` (``combine``'s weight gradient).
- :func:`combine_backward`: ``combine``'s two gradients from the two launchers above (the
  signature of :func:`forge_kernels.permute._rows.combine_backward`).
- :func:`rank_major_to_expert_major_triton`: one scan program, then a branch-free binary search
  per output row over the expert-major block ends.

Notable choices: every output is sized from shapes only (no host reads); row offsets are
int64 inside the kernels so ``rows * stride`` cannot overflow; ids outside ``[0, E)`` are
masked (never written out of bounds; such slots get the out-of-range row ``capacity``).
Whether kernels run on the interpreter is decided by triton when this module is first
imported (``TRITON_INTERPRET=1``), hence the lazy import in ``permute.py`` and
:data:`INTERPRETED`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._routing_triton import on_input_device
from ._routing_triton import routing_layout_triton as routing_layout_triton  # re-exported
from ._rows import _acc

#: True when this module's kernels were built by the Triton interpreter (CPU tensors allowed).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------- row movement
def _row_blocks(n_cols: int, interpreted: bool) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D): small row tiles on a GPU, big ones in the interpreter (fewer programs)."""
    block_d = min(triton.next_power_of_2(max(n_cols, 1)), 1024 if interpreted else 512)
    block_r = 64 if interpreted else max(1, 2048 // block_d)
    return block_r, block_d


@triton.jit
def _gather_rows_kernel(
    src_ptr,
    idx_ptr,
    scale_ptr,
    out_ptr,
    n_rows,
    D,
    div,
    n_valid,
    stride_src,
    stride_out,
    HAS_SCALE: tl.constexpr,
    ACC_FP64: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < n_rows
    cmask = cols < D
    idx = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    valid = rmask & (idx >= 0) & (idx < n_valid)
    src_rows = idx // div
    vals = tl.load(
        src_ptr + src_rows[:, None] * stride_src + cols[None, :],
        mask=valid[:, None] & cmask[None, :],
        other=0.0,
    )
    if HAS_SCALE:
        acc_ty = tl.float64 if ACC_FP64 else tl.float32
        s = tl.load(scale_ptr + idx, mask=valid, other=0.0).to(acc_ty)
        vals = vals.to(acc_ty) * s[:, None]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, vals.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@on_input_device
def gather_rows(
    src: torch.Tensor,
    idx: torch.Tensor,
    div: int,
    n_valid: int,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    dense: bool = False,
) -> torch.Tensor:
    """``out[r] = scale[idx[r]] * src[idx[r] // div]`` if ``0 <= idx[r] < n_valid`` else 0.

    ``dense`` (as in :mod:`forge_kernels.permute._rows`) is ignored: the mask is free in here.
    """
    src = src if src.stride(-1) == 1 else src.contiguous()
    n_rows, d = idx.numel(), src.shape[1]
    out = torch.empty((n_rows, d), dtype=out_dtype or src.dtype, device=src.device)
    if n_rows == 0 or d == 0:
        return out
    block_r, block_d = _row_blocks(d, INTERPRETED)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(d, block_d))
    _gather_rows_kernel[grid](
        src,
        idx,
        scale if scale is not None else idx,
        out,
        n_rows,
        d,
        div,
        n_valid,
        src.stride(0),
        out.stride(0),
        HAS_SCALE=scale is not None,
        ACC_FP64=_acc(src, out) == torch.float64,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
    return out


@triton.jit
def _combine_kernel(
    y_ptr,
    scatter_ptr,
    w_ptr,
    out_ptr,
    T,
    D,
    K,
    n_rows,
    stride_y,
    stride_out,
    HAS_W: tl.constexpr,
    ACC_FP64: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = tok < T
    cmask = cols < D
    acc_ty = tl.float64 if ACC_FP64 else tl.float32
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=acc_ty)
    for k in range(0, K):
        slot = tok.to(tl.int64) * K + k
        row = tl.load(scatter_ptr + slot, mask=tmask, other=0)
        m = tmask & (row >= 0) & (row < n_rows)
        v = tl.load(
            y_ptr + row[:, None] * stride_y + cols[None, :],
            mask=m[:, None] & cmask[None, :],
            other=0.0,
        ).to(acc_ty)
        if HAS_W:
            w = tl.load(w_ptr + slot, mask=m, other=0.0).to(acc_ty)
            v = v * w[:, None]
        acc += v
    out_ptrs = out_ptr + tok.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])


@on_input_device
def combine_rows(
    y: torch.Tensor,
    scatter_idx: torch.Tensor,
    weights: torch.Tensor | None,
    num_tokens: int,
    top_k: int,
    dense: bool = False,
) -> torch.Tensor:
    """``out[t] = sum_k w[t*K + k] * y[scatter_idx[t*K + k]]`` (w = 1 when None), fp32/fp64 sum.

    ``dense`` is ignored (see :func:`gather_rows`).
    """
    y = y if y.stride(-1) == 1 else y.contiguous()
    d = y.shape[1]
    out = torch.empty((num_tokens, d), dtype=y.dtype, device=y.device)
    if num_tokens == 0 or d == 0:
        return out
    block_r, block_d = _row_blocks(d, INTERPRETED)
    grid = (triton.cdiv(num_tokens, block_r), triton.cdiv(d, block_d))
    _combine_kernel[grid](
        y,
        scatter_idx,
        weights if weights is not None else scatter_idx,
        out,
        num_tokens,
        d,
        top_k,
        y.shape[0],
        y.stride(0),
        out.stride(0),
        HAS_W=weights is not None,
        ACC_FP64=_acc(y, out) == torch.float64,
        BLOCK_T=block_r,
        BLOCK_D=block_d,
    )
    return out


@triton.jit
def _slot_row_dot_kernel(
    g_ptr,
    y_ptr,
    scatter_ptr,
    out_ptr,
    N,
    D,
    K,
    n_rows,
    stride_g,
    stride_y,
    ACC_FP64: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    acc_ty = tl.float64 if ACC_FP64 else tl.float32
    slot = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    smask = slot < N
    row = tl.load(scatter_ptr + slot, mask=smask, other=0)
    rmask = smask & (row >= 0) & (row < n_rows)
    tok = slot.to(tl.int64) // K
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=acc_ty)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        g = tl.load(
            g_ptr + tok[:, None] * stride_g + cols[None, :],
            mask=smask[:, None] & cmask[None, :],
            other=0.0,
        )
        y = tl.load(
            y_ptr + row[:, None] * stride_y + cols[None, :],
            mask=rmask[:, None] & cmask[None, :],
            other=0.0,
        )
        acc += g.to(acc_ty) * y.to(acc_ty)
    tl.store(out_ptr + slot, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=smask)


@on_input_device
def slot_row_dot(
    g: torch.Tensor,
    y: torch.Tensor,
    scatter_idx: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``out[s] = dot(g[s // K], y[scatter_idx[s]])`` in fp32 (fp64 if any is), as ``out_dtype``."""
    g = g if g.stride(-1) == 1 else g.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    n, d = scatter_idx.numel(), y.shape[1]
    out = torch.empty(n, dtype=out_dtype, device=y.device)
    if n == 0:
        return out
    if d == 0:
        return out.zero_()
    block_s = 64 if INTERPRETED else 8
    block_d = min(triton.next_power_of_2(d), 256)
    _slot_row_dot_kernel[(triton.cdiv(n, block_s),)](
        g,
        y,
        scatter_idx,
        out,
        n,
        d,
        top_k,
        y.shape[0],
        g.stride(0),
        y.stride(0),
        ACC_FP64=_acc(g, y, out) == torch.float64,
        BLOCK_S=block_s,
        BLOCK_D=block_d,
    )
    return out


def combine_backward(
    g: torch.Tensor,
    y: torch.Tensor,
    gather_idx: torch.Tensor,
    scatter_idx: torch.Tensor,
    weights: torch.Tensor,
    top_k: int,
    need_y: bool,
    need_w: bool,
    dense: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`combine_rows` (with weights) as ``(dY, dW)``, each when asked for.

    ``dY[r] = w[gather_idx[r]] * g[gather_idx[r] // K]`` (0 for a row without a slot;
    :func:`gather_rows` with ``scale``) in ``y``'s dtype and ``dW[s] = <g[s // K],
    y[scatter_idx[s]]>`` (0 for a dropped slot; :func:`slot_row_dot`) in ``weights``' dtype.
    ``dense`` is ignored (see :func:`gather_rows`).
    """
    grad_y = grad_w = None
    if need_y:
        grad_y = gather_rows(
            g, gather_idx, top_k, weights.numel(), scale=weights, out_dtype=y.dtype
        )
    if need_w:
        grad_w = slot_row_dot(g, y, scatter_idx, top_k, weights.dtype)
    return grad_y, grad_w


# --------------------------------------------------------------------------- rank -> expert major
@triton.jit
def _rm_scan_kernel(counts_ptr, in_start_ptr, out_end_ptr, offs_ptr, R, E, BLOCK: tl.constexpr):
    # in_start[r*E + e]: first received row of block (r, e) (rank-major order);
    # out_end[e*R + r]: end row of block (r, e) in expert-major order; offs[e] = out_end[e*R + R-1].
    n = R * E
    carry = tl.zeros([BLOCK], dtype=tl.int32)
    for q0 in range(0, n, BLOCK):
        q = q0 + tl.arange(0, BLOCK)
        m = q < n
        c = tl.load(counts_ptr + q, mask=m, other=0)
        tl.store(in_start_ptr + q, tl.cumsum(c, axis=0) - c + carry, mask=m)
        carry += tl.sum(c, axis=0)
    carry = tl.zeros([BLOCK], dtype=tl.int32)
    for q0 in range(0, n, BLOCK):
        q = q0 + tl.arange(0, BLOCK)
        m = q < n
        e = q // R
        r = q % R
        c = tl.load(counts_ptr + r * E + e, mask=m, other=0)
        incl = tl.cumsum(c, axis=0) + carry
        tl.store(out_end_ptr + q, incl, mask=m)
        tl.store(offs_ptr + e, incl, mask=m & (r == R - 1))
        carry += tl.sum(c, axis=0)


@triton.jit
def _rm_index_kernel(
    counts_ptr,
    in_start_ptr,
    out_end_ptr,
    index_ptr,
    R,
    E,
    capacity,
    NSTEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < capacity
    n = R * E
    # First expert-major block b whose end is > i (b == n: row past the last block).
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + n
    for _ in tl.static_range(NSTEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(out_end_ptr + mid, mask=m & active, other=0)
        go_right = active & (end <= i)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(active & (end > i), mid, hi)
    valid = m & (lo < n)
    b = tl.minimum(lo, n - 1)
    e = b // R
    r = b % R
    c = tl.load(counts_ptr + r * E + e, mask=valid, other=0)
    end = tl.load(out_end_ptr + b, mask=valid, other=0)
    src = tl.load(in_start_ptr + r * E + e, mask=valid, other=0) + (i - (end - c))
    tl.store(index_ptr + i, tl.where(valid, src.to(tl.int64), capacity), mask=m)


@on_input_device
def rank_major_to_expert_major_triton(
    counts_re: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index int64 [capacity], offs int32 [E]) for the rank-major -> expert-major reorder."""
    r, e = counts_re.shape
    dev = counts_re.device
    counts = counts_re.to(torch.int32).contiguous()
    in_start = torch.empty(r * e, dtype=torch.int32, device=dev)
    out_end = torch.empty(r * e, dtype=torch.int32, device=dev)
    offs = torch.empty(e, dtype=torch.int32, device=dev)
    index = torch.empty(capacity, dtype=torch.int64, device=dev)
    _rm_scan_kernel[(1,)](counts, in_start, out_end, offs, r, e, BLOCK=1024)
    if capacity > 0:
        block = 1024 if INTERPRETED else 256
        _rm_index_kernel[(triton.cdiv(capacity, block),)](
            counts,
            in_start,
            out_end,
            index,
            r,
            e,
            capacity,
            NSTEPS=(r * e).bit_length(),
            BLOCK=block,
        )
    return index, offs

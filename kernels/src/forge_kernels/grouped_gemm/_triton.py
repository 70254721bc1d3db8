"""Triton kernels for the ragged grouped GEMM behind :func:`forge_kernels.grouped_gemm`.

Provides:

- :class:`GemmConfig`, :func:`candidates`, :func:`best_configs` (from ``_tuning``): a launch
  configuration, what the autotuner times and what it picked.
- :func:`gmm_rows`: ``out[M, N] = a[rows_e] @ b[e]`` per group, zeros past ``offs[-1]``; the
  forward (``b = w``) and dX (``b = w.transpose(1, 2)``: any strides, no transpose is copied).
- :func:`gmm_ragged_k`: ``out[e] = a[rows_e].T @ b[rows_e]`` (the weight gradient, reduction over
  each group's rows; an empty group yields zeros).
- :data:`INTERPRETED`: whether the kernels in this module were built for the Triton interpreter.

Notable choices:

- **No host sync.** ``offs`` is only ever read inside the kernels. The launch grid is sized from
  static quantities: ``M // BLOCK_M + E + 1`` row tiles (an upper bound on the row tiles of E
  groups plus the zero "tail" segment past ``offs[-1]``, whatever the split) times the column
  tiles. Each program loads ``offs`` (E <= a few hundred int32: one vector), computes the
  per-segment tile counts and their prefix sum, and finds its segment by counting; programs past
  the real tile count exit at once. The weight-gradient kernel has a static grid over
  ``(E, K tiles, N tiles)`` and loops over its group's rows with device-side loop bounds.
- **Rows past offs[-1]** are segment ``E``: its tiles store zeros (torch._grouped_mm leaves them).
- **Every output element is written exactly once** per launch (no atomics, no split-K):
  relaunching is idempotent (the autotuner's repeats are harmless) and ``out`` may hold NaN.
- **Accumulation in fp32**; fp32 inputs use ``input_precision="ieee"`` by default (torch's
  ``allow_tf32=False`` math); ``fp32_precision="tf32"`` opts into TF32 (about 1e-3 relative).
- **64-bit addressing** of groups and rows: DeepSeek-V3 weights have over 2**31 elements.
- **Interpreter.** ``triton.jit`` decides at *decoration* time whether a kernel is compiled or
  interpreted (``TRITON_INTERPRET``, via ``triton.knobs`` on triton >= 3.4). triton's own
  ``@jit`` library functions (``tl.sum``, ``tl.cumsum``, ``tl.cdiv``, ``tl.zeros``) are
  decorated at ``import triton``, so the kernels here use only builtins (``tl.reduce`` /
  ``tl.associative_scan`` with a local ``_add``, ``tl.full``, integer division): the mode then
  depends on this module alone, imported lazily and reloadable by a test. Under the
  interpreter autotuning is bypassed (:data:`INTERPRETER_CONFIG`).
- **Hopper tuning**, **TMA** loads (stores stay masked, so a tile never writes another group's
  rows) and warp-specialized K loops: :mod:`forge_kernels.grouped_gemm._tuning`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

import forge_kernels.grouped_gemm._tuning as _tuning
from forge_kernels.grouped_gemm._tuning import (
    INTERPRETER_CONFIG,
    GemmConfig,
    best_configs,
    candidates,
    tma_eligible,
)

__all__ = [
    "INTERPRETED",
    "INTERPRETER_CONFIG",
    "GemmConfig",
    "best_configs",
    "candidates",
    "gmm_ragged_k",
    "gmm_rows",
    "tma_eligible",
]


def _interpret_mode() -> bool:
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


#: Decided once, when this module's kernels are decorated (that is when triton decides too).
INTERPRETED: bool = _interpret_mode()


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _find_segment(offs_ptr, tile_m, M, E, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Segment (group 0..E-1, or E for the rows past offs[-1]) owning virtual row tile ``tile_m``.

    Returns (segment, first row of the tile, end row of the segment). ``segment > E`` means the
    tile is past the last real tile. Tiles never straddle a group boundary: each segment's tiles
    start at the segment's first row.
    """
    idx = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + idx, mask=idx < E, other=0)
    ends = tl.where(idx == E, M, ends)
    starts = tl.load(offs_ptr + idx - 1, mask=(idx >= 1) & (idx <= E), other=0)
    # NOTE: clamping keeps malformed offs (past M) from reading out of bounds; offs must be
    # nondecreasing and <= M (checking that would need a host sync).
    ends = tl.minimum(ends, M)
    starts = tl.minimum(starts, M)
    sizes = tl.where(idx <= E, tl.maximum(ends - starts, 0), 0)
    tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    cum = tl.associative_scan(tiles, 0, _add)  # inclusive prefix sum of tiles per segment
    seg = tl.reduce((cum <= tile_m).to(tl.int32), 0, _add)
    sel = idx == seg
    seg_start = tl.reduce(tl.where(sel, starts, 0), 0, _add)
    seg_end = tl.reduce(tl.where(sel, ends, 0), 0, _add)
    seg_tile0 = tl.reduce(tl.where(sel, cum - tiles, 0), 0, _add)
    row0 = seg_start + (tile_m - seg_tile0) * BLOCK_M
    return seg, row0, seg_end


@triton.jit
def _gmm_rows_tile(
    a_ptr,
    b_ptr,
    c_ptr,
    offs_ptr,
    a_desc,
    b_desc,
    tile_id,
    M,
    N,
    K,
    E,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    E_POW2: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    B_TRANS: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    num_tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles_m = M // BLOCK_M + E + 1  # static upper bound, see the module docstring
    # L2 swizzle over the virtual (row tile, column tile) grid: GROUP_M consecutive row tiles
    # (mostly of one expert) sweep a column band together, so a[rows] and b[e] tiles stay in L2.
    tiles_per_band = GROUP_M * num_tiles_n
    band = tile_id // tiles_per_band
    first_m = band * GROUP_M
    band_m = tl.minimum(num_tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile_id % tiles_per_band) % band_m
    tile_n = (tile_id % tiles_per_band) // band_m

    seg, row0, seg_end = _find_segment(offs_ptr, tile_m, M, E, BLOCK_M, E_POW2)
    if seg <= E:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_mask = rows < seg_end
        col_mask = cols < N
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
        # The tail segment (rows past offs[-1]) runs zero iterations and stores zeros.
        k_tiles = tl.where(seg < E, (K + BLOCK_K - 1) // BLOCK_K, 0)
        if TMA:
            # Rows of the next group (or past M: zero-filled) may enter the tile; only the
            # store below is masked to this group's rows. K past its end is zero-filled.
            for kt in tl.range(0, k_tiles, warp_specialize=WARP_SPEC):
                a = a_desc.load([row0, kt * BLOCK_K])
                if B_TRANS:  # b_desc addresses w [E, N, K]: dX reads w[e] transposed
                    b = b_desc.load([seg, tile_n * BLOCK_N, kt * BLOCK_K])
                    b = b.reshape(BLOCK_N, BLOCK_K).trans(1, 0)
                else:
                    b = b_desc.load([seg, kt * BLOCK_K, tile_n * BLOCK_N])
                    b = b.reshape(BLOCK_K, BLOCK_N)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        else:
            a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
            b_ptrs = (
                b_ptr
                + seg.to(tl.int64) * stride_be
                + ks[:, None] * stride_bk
                + cols.to(tl.int64)[None, :] * stride_bn
            )
            for kt in range(0, k_tiles):
                k_mask = ks < K - kt * BLOCK_K
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(
            c_ptrs,
            acc.to(c_ptr.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )


@triton.jit
def _gmm_rows_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    offs_ptr,
    a_desc,  # tensor descriptors of a and b when TMA, else None
    b_desc,
    M,
    N,
    K,
    E,
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    M_BUCKET,  # autotune key only (log2 bucket of rows per group), unused in the body
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,
    E_POW2: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    B_TRANS: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """c[rows_e, :] = a[rows_e, :] @ b[e] for each group e; c[offs[-1]:, :] = 0."""
    pid = tl.program_id(0)
    if PERSISTENT:
        total = (M // BLOCK_M + E + 1) * ((N + BLOCK_N - 1) // BLOCK_N)
        for tile_id in range(pid, total, tl.num_programs(0)):
            _gmm_rows_tile(
                a_ptr, b_ptr, c_ptr, offs_ptr, a_desc, b_desc, tile_id, M, N, K, E,
                stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, E_POW2, INPUT_PRECISION, TMA, B_TRANS,
                WARP_SPEC,
            )  # fmt: skip
    else:
        _gmm_rows_tile(
            a_ptr, b_ptr, c_ptr, offs_ptr, a_desc, b_desc, pid, M, N, K, E,
            stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, E_POW2, INPUT_PRECISION, TMA, B_TRANS,
            WARP_SPEC,
        )  # fmt: skip


@triton.jit
def _gmm_ragged_k_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    offs_ptr,
    a_desc,  # tensor descriptors of a and b when TMA, else None
    b_desc,
    M,
    N,
    K,
    E,
    stride_am,
    stride_ak,
    stride_bm,
    stride_bn,
    stride_ce,
    stride_ck,
    stride_cn,
    M_BUCKET,  # autotune key only, unused in the body
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """c[e] = a[rows_e, :].T @ b[rows_e, :] ([K, N] per group; zeros for an empty group)."""
    pid = tl.program_id(0)
    num_tiles_k = (K + BLOCK_M - 1) // BLOCK_M
    num_tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    tiles_per_group = num_tiles_k * num_tiles_n
    # Group-major order: all tiles of one expert run together and share its rows in L2.
    e = pid // tiles_per_group
    t = pid % tiles_per_group
    tile_k = t // num_tiles_n
    tile_n = t % num_tiles_n

    end = tl.minimum(tl.load(offs_ptr + e), M)
    start = tl.minimum(tl.load(offs_ptr + e - 1, mask=e > 0, other=0), M)
    end = tl.maximum(end, start)

    ks = tile_k * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_K)
    k_mask = ks < K
    col_mask = cols < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    masked_start = start
    if TMA:
        # Whole row tiles of the group through descriptors (no masks needed: every row is the
        # group's); the partial last tile goes through the masked loop below.
        full_tiles = (end - start) // BLOCK_K
        for i in tl.range(0, full_tiles, warp_specialize=WARP_SPEC):
            r = start + i * BLOCK_K
            a = a_desc.load([r, tile_k * BLOCK_M]).trans(1, 0)
            b = b_desc.load([r, tile_n * BLOCK_N])
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        masked_start = start + full_tiles * BLOCK_K
    a_ptrs = a_ptr + (masked_start + rs).to(tl.int64)[None, :] * stride_am + ks[:, None] * stride_ak
    b_ptrs = (
        b_ptr + (masked_start + rs).to(tl.int64)[:, None] * stride_bm + cols[None, :] * stride_bn
    )
    # device-side bounds: no host sync, empty -> 0 trips (and at most 1 trip under TMA)
    for r0 in range(masked_start, end, BLOCK_K):
        r_mask = rs < end - r0
        a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=r_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_am
        b_ptrs += BLOCK_K * stride_bm
    c_ptrs = (
        c_ptr
        + e.to(tl.int64) * stride_ce
        + ks.to(tl.int64)[:, None] * stride_ck
        + cols[None, :] * stride_cn
    )
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _m_bucket(m: int, n: int, k: int, e: int) -> int:
    """log2 bucket of the average rows per group (autotune key; static, no sync), or
    :data:`~forge_kernels.grouped_gemm._tuning.SMALL_BUCKET` for a problem too small to tune."""
    if m * n * k < _tuning.SMALL_PROBLEM_MACS:
        return _tuning.SMALL_BUCKET
    avg = max(1, m // max(e, 1))
    return min(max(avg.bit_length(), 4), 14)


@functools.cache
def _num_sms(device_index: int) -> int:
    # NOTE: memoized device property (not configuration). With _autotuned, the only
    # module-level state here.
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _input_precision(dtype: torch.dtype, fp32_precision: str) -> str:
    if fp32_precision not in ("ieee", "tf32"):
        raise ValueError(f"fp32_precision={fp32_precision!r}; choose 'ieee' or 'tf32'")
    return fp32_precision if dtype == torch.float32 else "tf32"  # ignored for 16-bit dots


def _check_interpreter(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"the Triton grouped GEMM got {t.device.type} tensors but its kernels were compiled "
            "for a GPU; set TRITON_INTERPRET=1 before forge_kernels' Triton kernels are first "
            "imported to run them on CPU"
        )


def _launch(
    kernel: str, grid: Any, args: tuple, consts: dict[str, Any], config: GemmConfig | None
) -> None:
    """Launch ``kernel`` ("rows" or "ragged_k"): with ``config`` (the interpreter's config
    under the interpreter when ``None``), else through the autotuner for the inputs' width and
    TMA eligibility. ``args[4:6]`` are the descriptors from ``_tuning.descriptors``."""
    tma_ok = args[4] is not None
    if config is None and INTERPRETED:
        config = INTERPRETER_CONFIG
    if config is None:
        jit = _gmm_rows_kernel if kernel == "rows" else _gmm_ragged_k_kernel
        _tuning.autotuned(kernel, jit, args[0].dtype == torch.float32, tma_ok)[grid](
            *args, **consts
        )
        return
    if config.tma and not tma_ok:
        raise ValueError(
            f"config.tma=True, but TMA cannot address these operands ({args[0].device.type}, "
            "needs sm90+, unit last stride, 16-byte aligned base and strides); use tma=False"
        )
    meta = config.meta()
    _tuning.BLOCK_HOOKS[kernel]({"a_desc": args[4], "b_desc": args[5], **meta, **consts})
    jit = _gmm_rows_kernel if kernel == "rows" else _gmm_ragged_k_kernel
    jit[grid](*args, **meta, num_warps=config.num_warps, num_stages=config.num_stages, **consts)


def gmm_rows(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: GemmConfig | None = None,
    fp32_precision: str = "ieee",
) -> torch.Tensor:
    """Grouped GEMM over row groups: ``out[rows_e] = a[rows_e] @ b[e]``, zeros past ``offs[-1]``.

    Args:
        a: ``[M, K]``, any strides.
        b: ``[E, K, N]``, any strides (pass ``w.transpose(1, 2)`` for dX).
        offs: ``[E]`` int32 cumulative group ends on ``a``'s device (never read on the host).
        out: optional preallocated ``[M, N]`` output in ``a.dtype``; every element is written.
        config: fixed launch configuration; ``None`` autotunes on a GPU and uses
            :data:`INTERPRETER_CONFIG` under the interpreter.
        fp32_precision: ``"ieee"`` (default) or ``"tf32"`` for fp32 inputs on a GPU.

    Returns:
        ``out`` (``[M, N]``, ``a.dtype``).
    """
    _check_interpreter(a)
    m, k = a.shape
    e, _, n = b.shape
    if out is None:
        out = torch.empty((m, n), device=a.device, dtype=a.dtype)
    if out.numel() == 0:
        return out
    a_desc, b_desc, b_trans = _tuning.descriptors("rows", a, b, interpreted=INTERPRETED)
    args = (
        a, b, out, offs, a_desc, b_desc, m, n, k, e,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), _m_bucket(m, n, k, e),
    )  # fmt: skip
    consts = {
        "E_POW2": triton.next_power_of_2(e + 1),
        "INPUT_PRECISION": _input_precision(a.dtype, fp32_precision),
        "B_TRANS": b_trans,
    }

    def grid(meta: dict) -> tuple[int]:
        tiles = (m // meta["BLOCK_M"] + e + 1) * triton.cdiv(n, meta["BLOCK_N"])
        if meta["PERSISTENT"]:
            sms = _num_sms(a.device.index or 0) if a.is_cuda else 3
            return (min(tiles, sms),)
        return (tiles,)

    _launch("rows", grid, args, consts, config)
    return out


def gmm_ragged_k(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | None = None,
    fp32_precision: str = "ieee",
) -> torch.Tensor:
    """Grouped GEMM reducing over row groups: ``out[e] = a[rows_e].T @ b[rows_e]``.

    Args:
        a: ``[M, K]`` (e.g. the layer input x), any strides.
        b: ``[M, N]`` (e.g. the output gradient), any strides.
        offs: ``[E]`` int32 cumulative group ends (never read on the host).
        out: optional preallocated ``[E, K, N]``; every element is written (zeros for an empty
            group).
        out_dtype: dtype of a newly allocated ``out`` (default ``a.dtype``).
        config: fixed launch configuration (``None``: autotune / interpreter config).
        fp32_precision: ``"ieee"`` or ``"tf32"`` for fp32 inputs on a GPU.

    Returns:
        ``out`` (``[E, K, N]``).
    """
    _check_interpreter(a)
    m, k = a.shape
    n = b.shape[1]
    e = offs.shape[0]
    if out is None:
        out = torch.empty((e, k, n), device=a.device, dtype=out_dtype or a.dtype)
    if out.numel() == 0:
        return out
    a_desc, b_desc, _ = _tuning.descriptors("ragged_k", a, b, interpreted=INTERPRETED)
    args = (
        a, b, out, offs, a_desc, b_desc, m, n, k, e,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2), _m_bucket(m, n, k, e),
    )  # fmt: skip
    consts = {"INPUT_PRECISION": _input_precision(a.dtype, fp32_precision)}

    def grid(meta: dict) -> tuple[int]:
        return (e * triton.cdiv(k, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    if config is not None and config.persistent:
        raise ValueError("gmm_ragged_k has no persistent variant; use persistent=False")
    _launch("ragged_k", grid, args, consts, config)
    return out

"""Grouped (ragged, per-expert) GEMM with autograd and a sync-free dispatcher.

Provides:

- :func:`grouped_gemm` ``(x [M, K], w [E, K, N], offs [E]) -> [M, N]``: the semantics of
  ``torch._grouped_mm(x, w, offs=offs)`` (group ``e`` is rows ``offs[e-1]:offs[e]``, multiplied
  by ``w[e]``), differentiable in ``x`` and ``w``, except that rows past ``offs[-1]`` are
  **zeros** in the output and in dX (``torch._grouped_mm`` leaves them uninitialized).
- :func:`grouped_gemm_backend`: the backend :func:`grouped_gemm` takes for given inputs.
- :data:`BACKENDS`: ``("triton", "torch_grouped_mm", "reference")``.

Backends (``backend=None`` picks the first that applies):

1. ``"triton"`` on CUDA tensors: :mod:`forge_kernels.grouped_gemm._triton` (Hopper-tuned,
   autotuned, no host sync, tails zeroed inside the kernels). On CPU tensors only when forced
   and ``TRITON_INTERPRET=1`` (the numpy interpreter; tests use it). It is never picked
   automatically on CPU, even under ``TRITON_INTERPRET=1``: the interpreter is orders of
   magnitude slower and the variable leaks across a test session.
2. ``"torch_grouped_mm"``: ``torch._grouped_mm`` (the CPU default) with the rows past
   ``offs[-1]`` zeroed by a device-side mask in the forward and in dX, and K / N zero-padded to
   16-byte strides when they are not (``torch._grouped_mm`` refuses unaligned strides).
3. ``"reference"``: a per-group loop of plain matmuls. It reads ``offs`` on the host (a sync):
   the fallback for torch builds without ``torch._grouped_mm`` on the device, for dtypes other
   than bf16/fp16/fp32, and the slow baseline of the benchmark.

Notable choices:

- dX is the grouped GEMM of dOut against ``w.transpose(1, 2)`` (a strided view, no copy) and dW
  the grouped GEMM reducing over each group's rows (``x[rows_e].T @ dOut[rows_e]``, zeros for an
  empty group). Incoming gradients are made contiguous (autograd may hand in stride-0 tensors).
  On CPU, 16-bit GEMMs get the layout the CPU kernel is fastest with (a column-major copy of
  the rows; for bf16 dX also a row-major copy of ``w.T``): see ``_CPU_COLUMN_MAJOR_FWD``.
- ``offs`` of another integer dtype is converted on the device; offs must be nondecreasing and
  ``<= M``. That is not validated: validating would need a host sync.
- The Triton path accumulates in fp32; fp32 inputs use IEEE fp32 math there by default (as
  torch's own default, ``allow_tf32=False``); ``fp32_precision="tf32"`` opts into TF32 tensor
  cores. The torch backends accumulate as torch's matmuls do.
- ``dense=True``: the caller's promise that ``offs[-1] == M`` (every row belongs to a group, as
  in forge's MoE dispatch). There are then no rows past ``offs[-1]``, and the torch path skips
  its masked pass over the output and over dX (the Triton kernels' zero segment is empty
  anyway). Not checked (a check would need a host sync): under a false promise those rows of
  ``torch._grouped_mm``'s output are uninitialized.
- Module state: nothing that configures behaviour. The Triton module is imported lazily (so
  ``TRITON_INTERPRET`` is read when the Triton path first runs); two memos record facts of the
  installation (whether triton imports; whether ``torch._grouped_mm`` runs for a (device type,
  dtype)). The Triton module memoizes SM counts and its autotuners (with their tuning caches).
- torch.compile and autocast are not handled specially: under autocast, cast ``x`` and ``w``
  to one dtype first (mixed dtypes raise a ValueError).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "Backend", "grouped_gemm", "grouped_gemm_backend"]

Backend = Literal["triton", "torch_grouped_mm", "reference"]
BACKENDS: tuple[str, ...] = ("triton", "torch_grouped_mm", "reference")
_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------


@functools.cache
def _triton_importable() -> bool:
    # NOTE: memo of an installation fact (see the module docstring).
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _torch_grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch build runs ``torch._grouped_mm`` for (device type, dtype).

    NOTE: a memo of a property of the torch build (probed once on tiny aligned tensors), the
    one piece of module-level state here. The probe runs in a thread of its own: dispatch
    modes are per thread, and one active here (selective checkpointing's cache, a tracer)
    would record the probe's matmul as the caller's: op-level AC then handed the probe's
    output to the experts when it recomputed them (kernels/tests/test_grouped_gemm.py).
    """
    index = torch.cuda.current_device() if device_type == "cuda" else None
    return _probe_grouped_mm(device_type, index, dtype)


@functools.cache
def _probe_grouped_mm(device_type: str, index: int | None, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)

    def probe() -> bool:
        try:
            x = torch.zeros(8, 8, device=device, dtype=dtype)
            w = torch.zeros(2, 8, 8, device=device, dtype=dtype)
            offs = torch.tensor([4, 8], device=device, dtype=torch.int32)
            torch._grouped_mm(x, w, offs=offs)
        except (RuntimeError, NotImplementedError):
            return False
        return True

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(probe).result()


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def grouped_gemm_backend(x: torch.Tensor, backend: Backend | None = None) -> Backend:
    """The backend :func:`grouped_gemm` uses for input ``x`` (and a forced ``backend``).

    Raises:
        ValueError: ``backend`` is unknown or cannot run on ``x``'s device / dtype.
    """
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; choose one of {BACKENDS} or None")
        if backend == "triton":
            if not _triton_importable():
                raise ValueError("backend='triton' needs triton; install it or pick another")
            if not x.is_cuda and not _interpreter_requested():
                raise ValueError(
                    f"backend='triton' on {x.device.type} tensors needs TRITON_INTERPRET=1 "
                    "(set before the first Triton launch); use backend=None on CPU"
                )
        if backend != "reference" and x.dtype not in _MM_DTYPES:
            raise ValueError(
                f"backend={backend!r} supports {_MM_DTYPES}, got {x.dtype}; use 'reference'"
            )
        if backend == "torch_grouped_mm" and not _torch_grouped_mm_works(x.device.type, x.dtype):
            raise ValueError(
                f"this torch ({torch.__version__}) has no torch._grouped_mm for "
                f"{x.device.type}/{x.dtype}; use 'reference'"
            )
        return backend
    if x.dtype not in _MM_DTYPES:
        return "reference"
    if x.is_cuda and _triton_importable():
        return "triton"
    if _torch_grouped_mm_works(x.device.type, x.dtype):
        return "torch_grouped_mm"
    return "reference"


# ---------------------------------------------------------------------------------------------
# Triton path
# ---------------------------------------------------------------------------------------------


class _TritonGroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, fp32_precision: str
    ) -> torch.Tensor:
        from forge_kernels.grouped_gemm import _triton as kern

        ctx.save_for_backward(x, w, offs)
        ctx.fp32_precision = fp32_precision
        return kern.gmm_rows(x, w, offs, fp32_precision=fp32_precision)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        from forge_kernels.grouped_gemm import _triton as kern

        x, w, offs = ctx.saved_tensors
        prec = ctx.fp32_precision
        grad_out = grad_out.contiguous().to(x.dtype)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # dX rows past offs[-1] are written as zeros by the kernel's tail segment.
            dx = kern.gmm_rows(grad_out, w.transpose(1, 2), offs, fp32_precision=prec)
        if ctx.needs_input_grad[1]:
            dw = kern.gmm_ragged_k(x, grad_out, offs, out_dtype=w.dtype, fp32_precision=prec)
        return dx, dw, None, None


# ---------------------------------------------------------------------------------------------
# torch._grouped_mm path
# ---------------------------------------------------------------------------------------------


def _zero_rows_past_offs(t: torch.Tensor, offs: torch.Tensor, cols: int) -> torch.Tensor:
    """``t[:, :cols]`` (a fresh output of torch._grouped_mm) with rows >= offs[-1] zeroed.

    The mask is built on the device (no sync). NOTE: a fill, not a multiply: those rows are
    uninitialized memory and may hold NaN (0 * NaN = NaN). Out of place: selective activation
    checkpointing may have cached ``t`` (the ``_grouped_mm`` output) and refuses its mutation.
    """
    tail = (torch.arange(t.shape[0], device=t.device) >= offs[-1]).unsqueeze(1)
    return t[:, :cols].masked_fill(tail, 0)


def _align(n: int, dtype: torch.dtype) -> int:
    per16 = 16 // torch.empty((), dtype=dtype).element_size()
    return -(-n // per16) * per16


def _aligned(t: torch.Tensor, pads: dict[int, int]) -> torch.Tensor:
    """``t`` zero-padded at the end of the given dims to the given sizes, contiguous, 16-byte
    aligned (returned as is when it already is)."""
    if all(t.shape[d] == size for d, size in pads.items()):
        c = t.contiguous()  # ``t`` itself when it is contiguous already
        return c.clone() if c.data_ptr() % 16 else c
    pad: list[int] = []
    for d in reversed(range(t.dim())):
        pad += [0, pads.get(d, t.shape[d]) - t.shape[d]]
    return F.pad(t, pad).contiguous()


def _rows_of(
    t: torch.Tensor, offs: torch.Tensor, rows: int, cols: int, dense: bool
) -> torch.Tensor:
    """``t[:rows, :cols]``, with the rows past ``offs[-1]`` zeroed unless the caller said ``dense``.

    NOTE: ``t`` itself when nothing is cut: autograd accumulates a gradient in place only into a
    tensor that is not a view (x feeds two GEMMs in an MoE expert: a view costs an extra
    out-of-place add of all of dX).
    """
    if not dense:
        return _zero_rows_past_offs(t[:rows], offs, cols)
    return t if t.shape == (rows, cols) else t[:rows, :cols]


# NOTE: the CPU kernel of torch._grouped_mm (torch 2.11 to 2.15; one oneDNN matmul per group)
# is 4-9x faster in bf16 when mat1 is column-major and mat2 row-major than with both row-major
# (the natural layout of x @ w), measured at 8192x512 rows by 128 experts' 512x192 weights, one
# thread: forward 749 -> 133 ms, dX 299 -> 81 ms (copies included); fp16 gains in the forward
# only (1208 -> 460 ms; its dX gets slower) and fp32 in neither. dW (x.T, a column-major view,
# against row-major dOut) is already the fast layout. tools/bench_moe.py's probe re-measures it.
_CPU_COLUMN_MAJOR_FWD = (torch.bfloat16, torch.float16)
_CPU_COLUMN_MAJOR_DX = (torch.bfloat16,)


def _column_major(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` as a column-major ``[rows, cols]`` copy, 16-byte aligned: columns past ``t``'s are
    zeros (they meet the weights' zero padding); rows past ``t``'s are never read (no group
    reaches them) and stay unset."""
    out = t.new_empty(cols, rows).t()
    out[: t.shape[0], : t.shape[1]].copy_(t)
    if cols > t.shape[1]:
        out[:, t.shape[1] :].zero_()
    return out


class _TorchGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, dense: bool
    ) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[2]
        kp, np_ = _align(k, x.dtype), _align(n, x.dtype)
        ctx.save_for_backward(x, w, offs)
        ctx.dense = dense
        if m == 0:  # torch._grouped_mm refuses zero rows (its backward strides)
            return x.new_zeros(0, n)
        if x.device.type == "cpu" and x.dtype in _CPU_COLUMN_MAJOR_FWD:
            a = _column_major(x, _align(m, x.dtype), kp)
        else:
            a = _aligned(x, {1: kp})
        out = torch._grouped_mm(a, _aligned(w, {1: kp, 2: np_}), offs=offs)
        return _rows_of(out, offs, m, n, dense)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, w, offs = ctx.saved_tensors
        m, k = x.shape
        n = w.shape[2]
        kp, np_ = _align(k, x.dtype), _align(n, x.dtype)
        if m == 0:
            return torch.zeros_like(x), torch.zeros_like(w), None, None
        g = _aligned(grad_out.contiguous().to(x.dtype), {1: np_})
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wt = _aligned(w, {1: kp, 2: np_}).transpose(1, 2)
            if x.device.type == "cpu" and x.dtype in _CPU_COLUMN_MAJOR_DX:
                gx, wt = _column_major(g, _align(m, x.dtype), np_), wt.contiguous()
            else:
                gx = g
            dx = _rows_of(torch._grouped_mm(gx, wt, offs=offs), offs, m, k, ctx.dense)
        if ctx.needs_input_grad[1]:
            xt = _aligned(x, {1: kp}).t()
            dw = torch._grouped_mm(xt, g, offs=offs)[:, :k, :n].contiguous().to(w.dtype)
        return dx, dw, None, None


# ---------------------------------------------------------------------------------------------
# Reference path (host loop)
# ---------------------------------------------------------------------------------------------


def _reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # NOTE: reads offs on the host (a device sync on GPU); fallback and benchmark baseline only.
    # split/unbind/cat keep the backward to one concatenation per input (slicing per group
    # would allocate a full-size zero gradient per group).
    m = x.shape[0]
    sizes, start = [], 0
    for end in offs.tolist():
        end = min(max(int(end), start), m)
        sizes.append(end - start)
        start = end
    pieces = [xe @ we for xe, we in zip(torch.split(x[:start], sizes), w.unbind(0), strict=True)]
    pieces.append(x.new_zeros(m - start, w.shape[2]))
    return torch.cat(pieces, dim=0)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def _check_inputs(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(
            f"grouped_gemm wants x [M, K] and w [E, K, N]; got x {tuple(x.shape)}, "
            f"w {tuple(w.shape)}"
        )
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} but w has K={w.shape[1]} (w is [E, K, N])")
    if offs.dim() != 1 or offs.shape[0] != w.shape[0] or w.shape[0] == 0:
        raise ValueError(
            f"offs must be [E] with E = w.shape[0] = {w.shape[0]} >= 1 cumulative group ends; "
            f"got shape {tuple(offs.shape)}"
        )
    if offs.dtype.is_floating_point or offs.dtype.is_complex or offs.dtype == torch.bool:
        raise ValueError(f"offs must be an integer tensor (int32), got {offs.dtype}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype; got {x.dtype} and {w.dtype}")
    if not (x.device == w.device == offs.device):
        raise ValueError(
            f"x, w, offs must be on one device; got {x.device}, {w.device}, {offs.device}"
        )


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    offs: torch.Tensor,
    *,
    backend: Backend | None = None,
    fp32_precision: Literal["ieee", "tf32"] = "ieee",
    dense: bool = False,
) -> torch.Tensor:
    """Grouped GEMM: ``out[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ w[e]``; zeros past offs[-1].

    Args:
        x: ``[M, K]`` rows sorted by group (bf16, fp16 or fp32; other dtypes use the reference).
        w: ``[E, K, N]``, same dtype as ``x``.
        offs: ``[E]`` cumulative group ends (int32; other integer dtypes are converted on the
            device). Nondecreasing, ``offs[-1] <= M``; empty groups allowed. Never read on the
            host except by the ``"reference"`` backend.
        backend: force ``"triton"``, ``"torch_grouped_mm"`` or ``"reference"``; ``None`` picks
            as :func:`grouped_gemm_backend` says.
        fp32_precision: Triton path with fp32 inputs on a GPU: ``"ieee"`` (default, exact fp32
            products) or ``"tf32"`` (tensor cores, ~1e-3 relative error). Ignored otherwise.
        dense: promise that ``offs[-1] == M`` (no rows past the last group), which spares the
            torch path a masked pass over the output and dX; see the module docstring.

    Returns:
        ``[M, N]`` in ``x.dtype``. Differentiable in ``x`` (dX rows past ``offs[-1]`` are zero)
        and ``w`` (an expert without rows gets a zero gradient).
    """
    _check_inputs(x, w, offs)
    if fp32_precision not in ("ieee", "tf32"):
        raise ValueError(f"fp32_precision={fp32_precision!r}; choose 'ieee' or 'tf32'")
    chosen = grouped_gemm_backend(x, backend)
    if offs.dtype != torch.int32:
        offs = offs.to(torch.int32)
    if chosen == "triton":
        return _TritonGroupedGemm.apply(x, w, offs, fp32_precision)
    if chosen == "torch_grouped_mm":
        return _TorchGroupedMM.apply(x, w, offs, dense)
    return _reference(x, w, offs)

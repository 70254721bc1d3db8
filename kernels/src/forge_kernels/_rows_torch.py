"""PyTorch-op versions of the three row movers of :mod:`forge_kernels._permute_triton` (private).

:mod:`forge_kernels.permute` runs one set of autograd Functions on both backends: on CUDA they
call the Triton kernels, elsewhere these functions, which have the same signatures and the same
meaning (plus ``dense``). So the PyTorch path gets the kernels' backward structure too: every
backward is a gather, never an accumulating scatter (``index_put_(accumulate=True)``, which is
what plain indexing's autograd would run).

- :func:`gather_rows`: ``out[r] = scale[idx[r]] * src[idx[r] // div]``, or 0 when
  ``idx[r] >= n_valid``.
- :func:`combine_rows`: ``out[t] = sum_k w[t*K + k] * y[scatter_idx[t*K + k]]`` (w = 1 when
  None), summed in fp32 (fp64 for fp64 operands); a slot with ``scatter_idx >= len(y)`` adds 0.
- :func:`slot_row_dot`: ``out[s] = <g[s // K], y[scatter_idx[s]]>``, 0 for such slots.

Masking: an out-of-range index (a sentinel row, a dropped slot) reads a clamped row whose value
never reaches a result: gathered rows are zeroed in place (one pass over the output), dot
products are replaced by zeros with ``torch.where``, so NaN in a row nobody owns stays harmless.
``dense=True`` is the caller's promise that no index is out of range (a layout that is a
permutation of the slots: the lean path of :mod:`forge_kernels.permute`): clamp and masking are skipped. All
shapes come from the inputs' shapes: no host sync.
"""

from __future__ import annotations

import torch

__all__ = ["combine_rows", "gather_rows", "slot_row_dot"]


def _acc(*tensors: torch.Tensor) -> torch.dtype:
    """Accumulate in fp64 when any operand is fp64, else fp32 (as the kernels do)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _take_rows(
    src: torch.Tensor, rows: torch.Tensor, n_rows: int, dense: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(src[rows] with out-of-range rows clamped, the validity mask or None when dense)``."""
    if dense:
        return src.index_select(0, rows), None
    valid = rows < n_rows
    if n_rows == 0:  # nothing to read: every row is out of range
        return src.new_zeros(rows.numel(), src.shape[1]), valid
    return src.index_select(0, rows.clamp(max=n_rows - 1)), valid


def gather_rows(
    src: torch.Tensor,
    idx: torch.Tensor,
    div: int,
    n_valid: int,
    scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    dense: bool = False,
) -> torch.Tensor:
    """``out[r] = scale[idx[r]] * src[idx[r] // div]`` if ``idx[r] < n_valid`` else 0."""
    out_dtype = out_dtype or src.dtype
    if n_valid == 0:  # nothing to read (e.g. no tokens): every row is zero
        return src.new_zeros(idx.numel(), src.shape[1], dtype=out_dtype)
    valid = None if dense else idx < n_valid
    safe = idx if valid is None else idx.clamp(max=n_valid - 1)
    out = src.index_select(0, safe if div == 1 else safe // div)
    if scale is not None:
        acc = _acc(src, scale)
        out = out.to(acc) * scale.index_select(0, safe).to(acc).unsqueeze(1)
    out = out.to(out_dtype)
    if valid is not None:
        out.masked_fill_(~valid.unsqueeze(1), 0)
    return out


def combine_rows(
    y: torch.Tensor,
    scatter_idx: torch.Tensor,
    weights: torch.Tensor | None,
    num_tokens: int,
    top_k: int,
    out_dtype: torch.dtype | None = None,
    dense: bool = False,
) -> torch.Tensor:
    """``out[t] = sum_k w[t*K + k] * y[scatter_idx[t*K + k]]`` (w = 1 when None), fp32/fp64 sum."""
    out_dtype = out_dtype or y.dtype
    d = y.shape[1]
    slots, valid = _take_rows(y, scatter_idx, y.shape[0], dense)
    if valid is not None:
        slots.masked_fill_(~valid.unsqueeze(1), 0)
    acc = _acc(y) if weights is None else _acc(y, weights)
    slots_TKD = slots.view(num_tokens, top_k, d)
    if weights is None:
        return slots_TKD.sum(1, dtype=acc).to(out_dtype)
    w_T1K = weights.reshape(num_tokens, 1, top_k).to(acc)
    return torch.bmm(w_T1K, slots_TKD.to(acc)).view(num_tokens, d).to(out_dtype)


def slot_row_dot(
    g: torch.Tensor,
    y: torch.Tensor,
    scatter_idx: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype,
    dense: bool = False,
) -> torch.Tensor:
    """``out[s] = dot(g[s // K], y[scatter_idx[s]])`` in fp32 (fp64 if any is), as ``out_dtype``."""
    num_slots, d = scatter_idx.numel(), y.shape[1]
    num_tokens = num_slots // top_k if top_k else 0
    acc = _acc(g, y)
    slots, valid = _take_rows(y, scatter_idx, y.shape[0], dense)
    dots = torch.bmm(
        slots.view(num_tokens, top_k, d).to(acc), g.reshape(num_tokens, d, 1).to(acc)
    ).view(num_slots)
    if valid is not None:
        dots = torch.where(valid, dots, 0)  # NOTE: where, not a product: a clamped row may be NaN
    return dots.to(out_dtype)

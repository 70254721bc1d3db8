"""PyTorch-op versions of the row movers of :mod:`forge_kernels.permute._triton` (private).

:mod:`forge_kernels.permute` runs one set of autograd Functions on both backends: on CUDA they
call the Triton kernels, elsewhere these functions (same meaning, plus ``dense``; the kernels'
``gather_rows`` also scales rows, which only their ``combine_backward`` uses). The kernels'
``slot_row_dot`` has no counterpart here: :func:`combine_backward` computes those dot products
from a gather it needs anyway. No backward here uses ``index_put_(accumulate=True)`` (what plain
indexing's autograd would run).

- :func:`gather_rows`: ``out[r] = src[idx[r] // div]``, or 0 when ``idx[r] >= n_valid``.
- :func:`combine_rows`: ``out[t] = sum_k w[t*K + k] * y[scatter_idx[t*K + k]]`` (w = 1 when
  None), summed in fp32 (fp64 for fp64 operands); a slot with ``scatter_idx >= len(y)`` adds 0.

Two backward shortcuts of this path only (the kernels need neither; on CPU, every [T*K, D]
tensor a step materializes costs more than the arithmetic on it):

- :func:`combine_backward`: both gradients of ``combine`` from one gather of dOut into expert
  order (the dot products then read ``y`` in place instead of a gathered copy of it).
- :func:`token_sum`: ``permute``'s backward (each token's K rows summed) as an ``index_add_``
  into ``[T, D]`` instead of a gather into ``[T*K, D]`` (CPU, fp32/fp64).

Masking: an out-of-range index (a sentinel row, a dropped slot) reads a clamped row whose value
never reaches a result: gathered rows are zeroed in place (one pass over the output), dot
products are replaced by zeros with ``torch.where``, so NaN in a row nobody owns stays harmless.
``dense=True`` is the caller's promise that no index is out of range (a layout that is a
permutation of the slots: the lean path of :mod:`forge_kernels.permute`): clamp and masking are skipped. All
shapes come from the inputs' shapes: no host sync.
"""

from __future__ import annotations

import torch

__all__ = ["combine_backward", "combine_rows", "gather_rows", "token_sum"]


def _acc(*tensors: torch.Tensor) -> torch.dtype:
    """Accumulate in fp64 when any operand is fp64, else fp32 (as the kernels do)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def gather_rows(
    src: torch.Tensor, idx: torch.Tensor, div: int, n_valid: int, dense: bool = False
) -> torch.Tensor:
    """``out[r] = src[idx[r] // div]`` if ``idx[r] < n_valid`` else 0."""
    if n_valid == 0:  # nothing to read (e.g. no tokens): every row is zero
        return src.new_zeros(idx.numel(), src.shape[1])
    valid = None if dense else idx < n_valid
    safe = idx if valid is None else idx.clamp(max=n_valid - 1)
    out = src.index_select(0, safe if div == 1 else safe // div)
    if valid is not None:
        out.masked_fill_(~valid.unsqueeze(1), 0)
    return out


def combine_rows(
    y: torch.Tensor,
    scatter_idx: torch.Tensor,
    weights: torch.Tensor | None,
    num_tokens: int,
    top_k: int,
    dense: bool = False,
) -> torch.Tensor:
    """``out[t] = sum_k w[t*K + k] * y[scatter_idx[t*K + k]]`` (w = 1 when None), fp32/fp64 sum."""
    d = y.shape[1]
    slots = gather_rows(y, scatter_idx, 1, y.shape[0], dense=dense)
    slots_TKD = slots.view(num_tokens, top_k, d)
    if weights is None:
        return slots_TKD.sum(1, dtype=_acc(y)).to(y.dtype)
    acc = _acc(y, weights)
    w_T1K = weights.reshape(num_tokens, 1, top_k).to(acc)
    return torch.bmm(w_T1K, slots_TKD.to(acc)).view(num_tokens, d).to(y.dtype)


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

    ``g_perm[r] = g[gather_idx[r] // K]`` (0 for a row without a slot) is gathered once; then
    ``dW[s] = <g_perm[r], y[r]>`` at ``r = scatter_idx[s]`` (0 for a dropped slot) and
    ``dY[r] = w[gather_idx[r]] * g_perm[r]``: the same values as the kernels'
    ``combine_backward`` (``slot_row_dot`` and ``gather_rows`` with ``scale``), in fp32 (fp64 if
    any operand is), without a gathered copy of ``y``. ``dY`` has ``y``'s dtype, ``dW``
    ``weights``' dtype.
    """
    rows, num_slots, d = gather_idx.numel(), weights.numel(), y.shape[1]
    acc = _acc(g, y, weights)
    g_perm = gather_rows(g, gather_idx, top_k, num_slots, dense=dense)
    grad_w = None
    if need_w:
        dots = torch.bmm(y.contiguous().view(rows, 1, d).to(acc), g_perm.view(rows, d, 1).to(acc))
        # NOTE: the dropped slots' zeros are a fill (gather_rows), not a product: a row without a
        # slot may hold NaN (its g_perm row is 0, y's row is whatever the expert GEMM left there).
        grad_w = gather_rows(dots.view(rows, 1), scatter_idx, 1, rows, dense=dense)
        grad_w = grad_w.view(num_slots).to(weights.dtype)
    grad_y = None
    if need_y:
        safe = gather_idx if dense else gather_idx.clamp(max=max(num_slots - 1, 0))
        w_perm = weights.index_select(0, safe).to(acc).unsqueeze(1) if num_slots else 0.0
        # NOTE: in place when it can: g_perm is this function's own fresh tensor.
        grad_y = g_perm.mul_(w_perm) if g_perm.dtype == acc else g_perm.to(acc) * w_perm
        grad_y = grad_y.to(y.dtype)
    return grad_y, grad_w


def token_sum(
    src: torch.Tensor,
    gather_idx: torch.Tensor,
    num_tokens: int,
    top_k: int,
    num_slots: int,
    dense: bool = False,
) -> torch.Tensor | None:
    """``out[gather_idx[r] // K] += src[r]`` over the rows that have a slot
    (``gather_idx[r] < num_slots``): a ``[T, D]`` sum of each token's K expert rows; or None
    where this shortcut does not apply (the caller then gathers with :func:`combine_rows`).

    Applies on CPU to fp32/fp64 ``src``: CPU ``index_add_`` adds rows one after another in index
    order (deterministic) in ``src``'s dtype, which is why 16-bit dtypes (summed in fp32 by the
    gather) are left out. A token's rows are summed in expert order, not top-k order. Rows
    without a slot (not ``dense``) go to a scratch row past the end, dropped.
    """
    if src.device.type != "cpu" or src.dtype not in (torch.float32, torch.float64):
        return None
    tokens = gather_idx // top_k
    if dense:
        return src.new_zeros(num_tokens, src.shape[1]).index_add_(0, tokens, src)
    tokens = torch.where(gather_idx < num_slots, tokens, num_tokens)
    out = src.new_zeros(num_tokens + 1, src.shape[1]).index_add_(0, tokens, src)
    return out[:num_tokens]

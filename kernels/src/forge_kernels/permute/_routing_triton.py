"""Triton kernels of the routing layout behind :func:`forge_kernels.permute.routing_layout`
(private; :mod:`forge_kernels.permute._triton` re-exports the launcher).

Provides :func:`routing_layout_triton`: counts / padded offs / gather / scatter indices in four
launches: per-block histogram, per-expert scan over blocks, expert scan (+ padding), index
write. The rank of a slot inside its block comes from a ``[BLOCK_S, BLOCK_S]`` equality tile,
so the order within an expert is the stable slot order with no sort and no atomics. Also
:func:`on_input_device`, the launchers' wrapper that makes the input's GPU current.

Imported only by :mod:`forge_kernels.permute._triton`, so its kernels are decorated in the same
interpreter mode (``TRITON_INTERPRET``, read by triton at decoration).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
import triton
import triton.language as tl

from ..routing import routing_capacity

__all__ = ["on_input_device", "routing_layout_triton"]

# Slot tile of the routing kernels: the in-block rank uses a BLOCK_S x BLOCK_S compare tile.
# NOTE: 64 keeps it in registers at 4 warps (sm90 ptxas: 78 regs; 128 spilled at 255 regs).
_BLOCK_S = 64
_BLOCK_E = 128


_P = ParamSpec("_P")
_R = TypeVar("_R")


def on_input_device(launcher: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run a launcher with its first tensor's GPU current (triton launches on the current one)."""

    @functools.wraps(launcher)
    def wrapped(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        t = args[0]
        assert isinstance(t, torch.Tensor)
        ctx = torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
        with ctx:
            return launcher(*args, **kwargs)

    return wrapped


# --------------------------------------------------------------------------- routing layout
@triton.jit
def _block_rank(ids_ptr, offs_s, N, E, BLOCK_S: tl.constexpr):
    """Expert id, validity, and (#same-expert slots before, after) each slot in its block."""
    in_range = offs_s < N
    raw = tl.load(ids_ptr + offs_s, mask=in_range, other=-1)
    valid = in_range & (raw >= 0) & (raw < E)
    e = tl.where(valid, raw, 0).to(tl.int32)
    i = tl.arange(0, BLOCK_S)
    same = (e[:, None] == e[None, :]) & valid[:, None] & valid[None, :]
    before = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    after = tl.sum((same & (i[None, :] > i[:, None])).to(tl.int32), axis=1)
    return e, valid, before, after


@triton.jit
def _hist_kernel(ids_ptr, hist_ptr, N, E, BLOCK_S: tl.constexpr):
    # hist[b, e] = number of slots of block b routed to e (written once, by e's last slot).
    b = tl.program_id(0)
    offs_s = b * BLOCK_S + tl.arange(0, BLOCK_S)
    e, valid, before, after = _block_rank(ids_ptr, offs_s, N, E, BLOCK_S)
    tl.store(hist_ptr + b.to(tl.int64) * E + e, before + 1, mask=valid & (after == 0))


@triton.jit
def _block_scan_kernel(hist_ptr, counts_ptr, NB, E, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    # In place: hist[b, e] -> sum_{b' < b} hist[b', e]; counts[e] = sum_b hist[b, e].
    ecols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = ecols < E
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        brows = b0 + tl.arange(0, BLOCK_B)
        m = (brows < NB)[:, None] & emask[None, :]
        ptrs = hist_ptr + brows.to(tl.int64)[:, None] * E + ecols[None, :]
        h = tl.load(ptrs, mask=m, other=0)
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + carry[None, :], mask=m)
        carry += tl.sum(h, axis=0)
    tl.store(counts_ptr + ecols, carry, mask=emask)


@triton.jit
def _expert_scan_kernel(counts_ptr, offs_ptr, starts_ptr, E, align, BLOCK_E: tl.constexpr):
    # offs = cumsum(pad(counts)), starts = offs - pad(counts); a single program.
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    for e0 in range(0, E, BLOCK_E):
        ecols = e0 + tl.arange(0, BLOCK_E)
        m = ecols < E
        c = tl.load(counts_ptr + ecols, mask=m, other=0)
        p = (c + align - 1) // align * align
        incl = tl.cumsum(p, axis=0) + carry
        tl.store(offs_ptr + ecols, incl, mask=m)
        tl.store(starts_ptr + ecols, incl - p, mask=m)
        carry += tl.sum(p, axis=0)


@triton.jit
def _index_kernel(
    ids_ptr, prefix_ptr, starts_ptr, scatter_ptr, gather_ptr, N, E, capacity, BLOCK_S: tl.constexpr
):
    b = tl.program_id(0)
    offs_s = b * BLOCK_S + tl.arange(0, BLOCK_S)
    e, valid, before, after = _block_rank(ids_ptr, offs_s, N, E, BLOCK_S)
    pre = tl.load(prefix_ptr + b.to(tl.int64) * E + e, mask=valid, other=0)
    start = tl.load(starts_ptr + e, mask=valid, other=0)
    row = (start + pre + before).to(tl.int64)
    slot = offs_s.to(tl.int64)
    tl.store(scatter_ptr + slot, tl.where(valid, row, capacity), mask=offs_s < N)
    tl.store(gather_ptr + row, slot, mask=valid)


@on_input_device
def routing_layout_triton(
    expert_ids: torch.Tensor, num_experts: int, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts int32 [E], offs int32 [E], gather_idx int64 [capacity], scatter_idx int64 [T*K])."""
    dev = expert_ids.device
    ids = expert_ids.reshape(-1).contiguous()
    n, e = ids.numel(), num_experts
    capacity = routing_capacity(n, 1, e, align)
    nb = triton.cdiv(n, _BLOCK_S)
    counts = torch.empty(e, dtype=torch.int32, device=dev)
    offs = torch.empty(e, dtype=torch.int32, device=dev)
    starts = torch.empty(e, dtype=torch.int32, device=dev)
    scatter_idx = torch.empty(n, dtype=torch.int64, device=dev)
    gather_idx = torch.full((capacity,), n, dtype=torch.int64, device=dev)
    hist = torch.zeros((nb, e), dtype=torch.int32, device=dev)
    if n > 0:
        _hist_kernel[(nb,)](ids, hist, n, e, BLOCK_S=_BLOCK_S)
    _block_scan_kernel[(triton.cdiv(e, _BLOCK_E),)](
        hist, counts, nb, e, BLOCK_B=32, BLOCK_E=_BLOCK_E
    )
    _expert_scan_kernel[(1,)](counts, offs, starts, e, align, BLOCK_E=_BLOCK_E)
    if n > 0:
        _index_kernel[(nb,)](
            ids, hist, starts, scatter_idx, gather_idx, n, e, capacity, BLOCK_S=_BLOCK_S
        )
    return counts, offs, gather_idx, scatter_idx

"""Head-parallel context attention (``[cp] variant = "heads"``): an all-to-all over heads.

Each cp rank holds ``s = S / cp`` tokens of every sequence (two chunks,
:mod:`forge_cp.sequence`) with all of its heads. Before attention, one all-to-all trades tokens
for heads: rank ``j`` receives every rank's tokens of head group ``j`` (``H / cp`` query heads
and their key/value heads), puts the chunks back in the sequence's order and attends over the
whole sequence with an ordinary causal SDPA. A second all-to-all sends each rank its own tokens
of every head back. The softmax is the single-device one, so forward and backward are exact.

Why it saves memory: what attention keeps for backward (q, k, v, the output and its
log-sum-exp) covers the whole sequence but only ``1 / cp`` of the heads, so it shrinks with cp
like everything else a rank keeps; the all-gather variant (:mod:`forge_cp.attention`) keeps the
whole sequence's keys and values of every head on every rank. The price: the head count per
tp rank must divide by cp (or, for grouped-query keys and values, cp by their count: each is
then sent to ``cp / n_kv_heads`` ranks), and four all-to-alls per layer and pass instead of
one all-gather. Chosen over ring attention because it reuses SDPA's fused kernels unchanged
(no log-sum-exp merging across blocks, which public SDPA does not return) and its collectives
do not grow with cp.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checks import head_split_problem, kv_head_copies
from .kernel import CPKernel, KeyBounds

__all__ = ["HeadParallelAttention"]


class _Exchange(torch.autograd.Function):
    """``x [cp, ...]`` -> ``[cp, ...]`` with ``out[j]`` = rank ``j``'s ``x[rank]`` (an equal-split
    all-to-all over ``group``); its own inverse, so backward exchanges the gradient back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class HeadParallelAttention(CPKernel):
    """The attention kernel of the heads variant (``forge_core.contracts.set_attention_kernel``).

    ``kernel(q [B, H, s, D], k [B, Hkv, s, D], v, enable_gqa=...) -> [B, H, s, D]``: this
    rank's ``s = S / cp`` tokens (its two chunks) attending causally to the whole sequence.
    Runs eagerly under ``torch.compile`` (a graph break at the collectives)."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, bounds: KeyBounds
    ) -> torch.Tensor:
        return _attend(self, q, k, v, bounds)


def _to_heads(x: torch.Tensor, kernel: HeadParallelAttention, ordered: bool) -> torch.Tensor:
    """``[B, h, s, D]`` (this rank's tokens, all ``h`` heads) -> ``[B, h / cp, S, D]`` (every
    token of head group ``rank``): in the sequence's order when ``ordered``, else the ranks'
    tokens one after another (packed documents, masked in that order)."""
    cp = kernel.cp
    send = x.unflatten(1, (cp, x.shape[1] // cp)).movedim(1, 0)  # [cp, B, h/cp, s, D]
    got = _Exchange.apply(send, kernel.group)  # got[j]: rank j's tokens of my heads
    if not ordered:
        return got.movedim(0, 2).flatten(2, 3)
    halves = got.unflatten(3, (2, got.shape[3] // 2))  # [cp, B, h/cp, 2, c, D]
    chunks = [halves[j, :, :, 0] for j in range(cp)]
    chunks += [halves[j, :, :, 1] for j in reversed(range(cp))]
    return torch.cat(chunks, dim=2)


def _to_tokens(x: torch.Tensor, kernel: HeadParallelAttention, ordered: bool) -> torch.Tensor:
    """The inverse of :func:`_to_heads`: ``[B, h / cp, S, D]`` -> ``[B, h, s, D]``."""
    cp = kernel.cp
    if ordered:
        chunks = x.chunk(2 * cp, dim=2)
        pairs = [torch.cat((chunks[j], chunks[2 * cp - 1 - j]), dim=2) for j in range(cp)]
        send = torch.stack(pairs)
    else:
        send = x.unflatten(2, (cp, x.shape[2] // cp)).movedim(2, 0)
    got = _Exchange.apply(send, kernel.group)  # got[j]: my tokens of rank j's heads
    return got.movedim(0, 1).flatten(1, 2)


def _attend(
    kernel: HeadParallelAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: KeyBounds,
) -> torch.Tensor:
    cp, heads, kv_heads = kernel.cp, q.shape[1], k.shape[1]
    problem = head_split_problem(heads, kv_heads, cp)
    if problem is not None:
        raise ValueError(f"cp.variant='heads': {problem}; use cp.variant='allgather'")
    copies = kv_head_copies(kv_heads, cp)
    if copies > 1:  # fewer key/value heads than ranks: each goes to cp / kv_heads ranks
        k, v = (t.repeat_interleave(copies, dim=1) for t in (k, v))
    ordered = not bounds.masked
    q_all, k_all, v_all = (_to_heads(t, kernel, ordered) for t in (q, k, v))
    gqa = q_all.shape[1] != k_all.shape[1]
    if ordered:
        out = F.scaled_dot_product_attention(
            q_all, k_all, v_all, is_causal=True, enable_gqa=gqa, scale=bounds.scale
        )
    else:  # every token of the row, in the ranks' order: the mask rule takes it as it is
        mask = bounds.mask(q_all.shape[2], kernel.cp, slice(None), q_all)
        out = F.scaled_dot_product_attention(
            q_all, k_all, v_all, attn_mask=mask, enable_gqa=gqa, scale=bounds.scale
        )
    return _to_tokens(out, kernel, ordered)

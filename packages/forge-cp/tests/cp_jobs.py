"""Rank functions of the context-parallel layer tests (module level, so the rank pool can pickle
them); those that build through forge's ParallelPlan or compose forge_cp with another layer are in
tests/integration/cp/jobs.py."""

from __future__ import annotations

import torch


def attention_errors(cp: int, n_heads: int, n_kv_heads: int) -> list[float]:
    """Max differences, in float64, between the context-parallel kernel and SDPA over the whole
    sequence: the output and the gradients of q, k and v (this rank's part of each)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from forge_cp import ContextParallelAttention, shard_sequence

    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    shape = (2, n_heads, 8 * cp, 16)
    kv_shape = (2, n_kv_heads, 8 * cp, 16)
    q, k, v = (
        torch.randn(s, generator=g, dtype=torch.float64).requires_grad_()
        for s in (shape, kv_shape, kv_shape)
    )
    gqa = n_heads != n_kv_heads
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    grad = torch.randn(reference.shape, generator=g, dtype=torch.float64)
    reference.backward(grad)
    rank = dist.get_rank()
    mine = [shard_sequence(t.detach(), cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = ContextParallelAttention(dist.group.WORLD, rank, cp)(*mine, enable_gqa=gqa)
    out.backward(shard_sequence(grad, cp, rank, dim=2))
    pairs = [(out, reference)] + [(a.grad, b.grad) for a, b in zip(mine, (q, k, v), strict=True)]
    return [float((a - shard_sequence(b, cp, rank, dim=2)).abs().max().detach()) for a, b in pairs]

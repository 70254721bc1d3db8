"""Exact causal attention across context-parallel shards: all-gather of K and V.

Each rank holds two chunks of every sequence (:mod:`forge_cp.sequence`). Its queries need the
keys and values of every earlier token, which other ranks hold, so the ranks all-gather K and V
(one collective per attention layer, K and V together; with grouped-query attention only the
``n_kv_heads`` heads travel). Each of the rank's two query chunks then attends to the prefix of
the gathered sequence that ends with it, through ``F.scaled_dot_product_attention`` with a
lower-right causal mask. On CUDA that is ``torch.nn.attention.bias.causal_lower_right``: the
fused kernels apply it without building a mask. Elsewhere SDPA would build (and keep for
backward) a float mask per call, so the kernel builds one per chunk shape itself and every layer
shares it: ``4 x chunk x end`` bytes per distinct shape, whatever the depth and the batch. The
result is the same softmax over the same keys as the single-device model, so forward and
backward are exact.

Backward is autograd through SDPA and through :class:`_GatherKV`, whose backward sums each
rank's gradient for the gathered K and V over the ranks and keeps its own part (one
reduce-scatter). Both collectives run on gloo and NCCL.

Chosen over ring attention (K/V blocks passed around the ring, partial softmaxes merged with
their log-sum-exp) because it needs no log-sum-exp out of SDPA (only private, CUDA-specific
ops return it) and has one collective per layer instead of ``cp - 1`` steps. The price: each
rank keeps the gathered K and V of every layer for backward, ``2 x S x n_kv_heads x head_dim``
values per layer, which do not shrink with cp (everything else a rank saves does; see
benchmarks/cp.md). With GQA that is a small share.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

__all__ = ["ContextParallelAttention"]


class _GatherKV(torch.autograd.Function):
    """``x [1, ...]`` gathered over ``group`` into ``[cp, ...]`` (rank ``r``'s at index ``r``);
    backward: the gradient summed over the ranks, this rank's slice (reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((cp, *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        mine = grad.new_empty((1, *grad.shape[1:]))
        dist.reduce_scatter_tensor(mine, grad.contiguous(), group=ctx.group)
        return mine, None, None


class ContextParallelAttention:
    """The attention kernel :func:`forge_cp.apply_context_parallel` installs on each attention
    module (``forge_core.contracts.set_attention_kernel``).

    ``kernel(q [B, H, s, D], k [B, Hkv, s, D], v, enable_gqa=...) -> [B, H, s, D]``: this
    rank's ``s = S / cp`` tokens (its two chunks) attending causally to every earlier token of
    the whole sequence. Runs eagerly under ``torch.compile`` (a graph break at the collective).
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, cp: int) -> None:
        self.group, self.rank, self.cp = group, rank, cp
        self._masks: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}

    def mask(self, chunk: int, end: int, like: torch.Tensor) -> Any:
        """The lower-right causal mask of ``chunk`` queries over ``end`` keys for SDPA."""
        if like.device.type == "cuda":
            return causal_lower_right(chunk, end)
        key = (chunk, end, like.dtype, like.device)
        if key not in self._masks:  # additive, as SDPA's CPU kernels use it; shared by layers
            allowed = torch.ones(chunk, end, dtype=torch.bool, device=like.device)
            blocked = torch.zeros(chunk, end, dtype=like.dtype, device=like.device)
            blocked.masked_fill_(~allowed.tril(end - chunk), float("-inf"))
            self._masks[key] = blocked
        return self._masks[key]

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, enable_gqa: bool
    ) -> torch.Tensor:
        return _attend(self, q, k, v, enable_gqa)


@torch.compiler.disable
def _attend(
    kernel: ContextParallelAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    enable_gqa: bool,
) -> torch.Tensor:
    cp, rank = kernel.cp, kernel.rank
    chunk = q.shape[2] // 2
    gathered = _GatherKV.apply(torch.stack((k, v))[None], kernel.group, cp)
    # [cp, 2 (k, v), B, Hkv, 2 (front, back), chunk, D] -> the sequence in its natural order:
    # chunk j is rank j's front chunk for j < cp, else rank 2 cp - 1 - j's back chunk.
    halves = gathered.unflatten(4, (2, chunk))
    ordered = [halves[r, :, :, :, 0] for r in range(cp)]
    ordered += [halves[r, :, :, :, 1] for r in reversed(range(cp))]
    k_all, v_all = torch.cat(ordered, dim=3)
    outs = []
    for i, index in enumerate((rank, 2 * cp - 1 - rank)):
        end = (index + 1) * chunk  # the prefix of the sequence this chunk attends to
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, i * chunk : (i + 1) * chunk],
                k_all[:, :, :end],
                v_all[:, :, :end],
                attn_mask=kernel.mask(chunk, end, q),
                enable_gqa=enable_gqa,
            )
        )
    return torch.cat(outs, dim=2)

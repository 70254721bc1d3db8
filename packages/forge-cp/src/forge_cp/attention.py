"""Exact causal attention across context-parallel shards: all-gather of K and V.

Each rank holds two chunks of every sequence (:mod:`forge_cp.sequence`). Its queries need the
keys and values of every earlier token, which other ranks hold, so the ranks all-gather K and V
(one collective per attention layer, K and V together; with grouped-query attention only the
``n_kv_heads`` heads travel). Each of the rank's two query chunks then attends to the prefix of
the gathered sequence that ends with it, through ``F.scaled_dot_product_attention`` with a
lower-right causal mask. On CUDA that is ``torch.nn.attention.bias.causal_lower_right``: the
fused kernels apply it without building a mask. Elsewhere SDPA takes a float mask and keeps it
for backward, and a ``chunk x end`` mask per call would grow with the square of the sequence.
The kernel instead flips the chunk's queries: row ``i`` of the flipped chunk may see key ``j``
exactly when ``i + j < end``, so the mask is constant along anti-diagonals and is a strided view
(strides ``(1, 1)``) of one row of ``chunk + end - 1`` values; that row is all that is stored,
once per chunk shape and shared by every layer. The outputs are flipped back. The result is the
same softmax over the same keys as the single-device model, so forward and backward are exact
(to the rounding of sums taken in another order).

Backward is autograd through SDPA and through :class:`_GatherKV`, whose backward sums each
rank's gradient for the gathered K and V over the ranks and keeps its own part (one
reduce-scatter). Both collectives run on gloo and NCCL.

Chosen over ring attention (K/V blocks passed around the ring, partial softmaxes merged with
their log-sum-exp) because it needs no log-sum-exp out of SDPA (only private aten ops return
it) and has one collective per layer instead of ``cp - 1`` steps. The price: each
rank keeps the gathered K and V of every layer for backward, ``2 x S x n_kv_heads x head_dim``
values per layer, which do not shrink with cp (everything else a rank saves does; see
benchmarks/cp.md). With GQA that is a small share.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .kernel import CPKernel, KeyBounds

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


class ContextParallelAttention(CPKernel):
    """The attention kernel :func:`forge_cp.apply_context_parallel` installs on each attention
    module (``forge_core.contracts.set_attention_kernel``).

    ``kernel(q [B, H, s, D], k [B, Hkv, s, D], v, enable_gqa=...) -> [B, H, s, D]``: this
    rank's ``s = S / cp`` tokens (its two chunks) attending causally to every earlier token of
    the whole sequence. Runs eagerly under ``torch.compile`` (a graph break at the collective).
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, cp: int) -> None:
        super().__init__(group, rank, cp)
        self._masks: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}

    def flipped_mask(self, chunk: int, end: int, like: torch.Tensor) -> torch.Tensor:
        """The additive causal mask ``[chunk, end]`` of a chunk whose queries are flipped (the
        last ``chunk`` of ``end`` tokens, last query first): a ``(1, 1)``-strided view of one
        row of ``chunk + end - 1`` values (module docstring), made once per shape."""
        key = (chunk, end, like.dtype, like.device)
        if key not in self._masks:
            row = torch.zeros(chunk + end - 1, dtype=like.dtype, device=like.device)
            row[end:] = float("-inf")  # row i, key j: allowed when i + j < end
            self._masks[key] = row.as_strided((chunk, end), (1, 1))
        return self._masks[key]

    def attend_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        enable_gqa: bool,
        scale: float | None = None,
    ) -> torch.Tensor:
        """``q``'s chunk (the last ``q.shape[2]`` of ``k.shape[2]`` tokens) attending causally."""
        chunk, end = q.shape[2], k.shape[2]
        if q.device.type == "cuda":
            # NOTE: imported here: torch.nn.attention.bias imports triton's language module,
            # after which triton ignores a TRITON_INTERPRET=1 set later in the process
            # (forge-kernels' CPU tests set it), and a CPU run never needs it.
            from torch.nn.attention.bias import causal_lower_right

            bias = causal_lower_right(chunk, end)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, enable_gqa=enable_gqa, scale=scale
            )
        mask = self.flipped_mask(chunk, end, q)
        out = F.scaled_dot_product_attention(
            q.flip(2), k, v, attn_mask=mask, enable_gqa=enable_gqa, scale=scale
        )
        return out.flip(2)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, bounds: KeyBounds
    ) -> torch.Tensor:
        return _attend(self, q, k, v, enable_gqa, bounds)


def _attend(
    kernel: ContextParallelAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    enable_gqa: bool,
    bounds: KeyBounds,
) -> torch.Tensor:
    cp, rank = kernel.cp, kernel.rank
    gathered = _GatherKV.apply(torch.stack((k, v))[None], kernel.group, cp)
    if bounds.masked:
        # [cp, 2 (k, v), B, Hkv, s, D] -> the ranks' tokens one after another (the documents'
        # order), masked by the document rule: no reordering, any dealing of the tokens.
        local = q.shape[2]
        k_all, v_all = gathered.movedim(0, 3).flatten(3, 4)
        mask = bounds.mask(cp * local, cp, slice(rank * local, (rank + 1) * local), q)
        return F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=mask, enable_gqa=enable_gqa, scale=bounds.scale
        )
    chunk = q.shape[2] // 2
    # [cp, 2 (k, v), B, Hkv, 2 (front, back), chunk, D] -> the sequence in its natural order:
    # chunk j is rank j's front chunk for j < cp, else rank 2 cp - 1 - j's back chunk.
    halves = gathered.unflatten(4, (2, chunk))
    ordered = [halves[r, :, :, :, 0] for r in range(cp)]
    ordered += [halves[r, :, :, :, 1] for r in reversed(range(cp))]
    k_all, v_all = torch.cat(ordered, dim=3)
    outs = []
    for i, index in enumerate((rank, 2 * cp - 1 - rank)):
        end = (index + 1) * chunk  # the prefix of the sequence this chunk attends to
        mine = q[:, :, i * chunk : (i + 1) * chunk]
        keys, values = k_all[:, :, :end], v_all[:, :, :end]
        outs.append(kernel.attend_chunk(mine, keys, values, enable_gqa, bounds.scale))
    return torch.cat(outs, dim=2)

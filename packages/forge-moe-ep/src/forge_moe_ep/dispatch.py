"""Moving routed tokens to their experts and back: local, or expert-parallel over an ``ep`` group.

Provides :func:`dropless` and :func:`capacity_dispatch` (each runs the experts between dispatch
and combine and returns ``[T, D]``), :func:`capacity_per_sequence` and :func:`capacity_layout`.

Modes (``ModelConfig.moe_dispatch``):

- ``dropless``: every routed token is computed. Locally that needs no host sync (grouped GEMM
  offsets stay on the device). With EP the all-to-all needs the split sizes on the host: the
  per-expert counts are exchanged with a fixed-size all-to-all, their device-to-host copy is
  started at once (``forge_kernels.native.StagedSplits``), the shared expert and the token
  permute are launched while it flies, and the host waits once, right before the variable-size
  all-to-all. That wait is the only host sync of the layer, forward or backward (the backward
  reuses the split lists).
- ``capacity``: each sequence sends at most ``C = ceil(capacity_factor * S * K / E)`` tokens to
  each expert; earlier positions win, the rest are dropped (they get only the shared expert and
  the residual) and counted. Every buffer is sized from shapes, the all-to-alls have equal
  splits: no host sync at all. Because the capacity is per sequence, which tokens are dropped
  does not depend on how the batch is split across ranks: a single-device model drops the same.

Notable choices: the router weights never cross a collective (the combine happens on the
token's own rank), so the router stays in the autograd graph in every mode; experts that get no
rows get zero gradients from the grouped GEMM (never None); rows of a buffer that hold no token
are exact zeros and never reach the output.

The lean hot path: both modes lay the experts' rows out so that every row belongs to a group
(``offs[-1]`` equals the row count: dropless buffers hold exactly the routed rows, capacity
buffers are ``E x batch x capacity`` rows split evenly), so the experts never pay for zeroing
rows past ``offs[-1]`` (:data:`ExpertsFn`'s contract). Dropless layouts come from top-k ids,
always in range, so they are permutations of the slots and permute / combine run ``dense``
(no masking passes); the capacity mode keeps the masking its empty rows and dropped slots need.
A permutation of received rows (the EP reorder) is undone by gathering with its inverse, in the
forward and in the backward, never by an accumulating scatter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from forge_kernels.native import StagedSplits
from forge_kernels.permute import (
    RoutingLayout,
    combine,
    permute,
    rank_major_to_expert_major,
    routing_layout,
)

__all__ = [
    "ExpertsFn",
    "all_to_all",
    "capacity_dispatch",
    "capacity_layout",
    "capacity_per_sequence",
    "dropless",
]

_R = TypeVar("_R")

#: ``experts(x_rows [M, D], offs [E_local]) -> [M, D]``: the grouped SwiGLU over expert-major rows.
#: Every caller here passes ``offs[-1] == M`` (no row outside a group), so an implementation may
#: skip zeroing rows past ``offs[-1]`` (``forge_kernels.grouped_gemm(..., dense=True)``).
ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _Reorder(torch.autograd.Function):
    """``x[index]`` for a permutation ``index`` with known ``inverse``: the backward gathers with
    the inverse instead of running autograd's accumulating scatter (``index_put_``)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd: the backward sends gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_rows, out_splits, in_splits, group):
        ctx.group, ctx.in_rows = group, x.shape[0]
        ctx.out_splits, ctx.in_splits = out_splits, in_splits
        out = x.new_empty((out_rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_in = grad.new_empty((ctx.in_rows, *grad.shape[1:]))
        dist.all_to_all_single(
            grad_in, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group
        )
        return grad_in, None, None, None, None


def all_to_all(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of rows; equal splits when the lists are None."""
    out_rows = x.shape[0] if out_splits is None else sum(out_splits)
    return _AllToAll.apply(x, out_rows, out_splits, in_splits, group)


# --------------------------------------------------------------------------- dropless
def dropless(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    experts: ExpertsFn,
    num_experts: int,
    *,
    group: dist.ProcessGroup | None = None,
    staged: StagedSplits | None = None,
    overlap: Callable[[], _R] | None = None,
) -> tuple[torch.Tensor, _R | None]:
    """Exact dispatch: every routed token is computed. Returns ``(out [T, D], overlap())``.

    ``ids_TK`` must be in ``[0, num_experts)`` (a top-k router's output always is; not checked:
    the layout is used as a permutation of the slots). Without ``group`` the experts are all
    local (no collective, no host sync). With ``group`` (size R, ``num_experts / R`` experts per
    rank, rank r owning a contiguous range), ``staged`` is a ``StagedSplits(2 * R)`` used for
    the one host wait; ``overlap`` runs while it is pending.
    """
    layout = routing_layout(ids_TK, num_experts)
    top_k = ids_TK.shape[1]
    if group is None:
        extra = overlap() if overlap is not None else None
        y = experts(permute(x_TD, layout, top_k, dense=True), layout.offs)
        return combine(y, layout, weights_TK, dense=True), extra
    if staged is None:
        raise ValueError("dropless with an EP group needs staged=StagedSplits(2 * group size)")
    ranks = dist.get_world_size(group)
    local_experts = num_experts // ranks
    send_counts = layout.counts
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # fixed size: E ints
    send_counts_RE = send_counts.view(ranks, local_experts)
    recv_counts_RE = recv_counts.view(ranks, local_experts)
    splits = torch.cat([send_counts_RE.sum(1), recv_counts_RE.sum(1)])
    staged.start(splits)
    # NOTE: device work queued while the split sizes travel to the host.
    x_perm = permute(x_TD, layout, top_k, dense=True)
    extra = overlap() if overlap is not None else None
    host = staged.wait()  # the layer's one host sync
    in_splits, out_splits = host[:ranks], host[ranks:]
    received = sum(out_splits)
    x_recv = all_to_all(x_perm, group, out_splits, in_splits)
    # Rows arrive grouped by source rank, then local expert; the grouped GEMM wants expert-major.
    # The buffer holds exactly the received rows, so the reorder is a permutation (no sentinel).
    index, offs = rank_major_to_expert_major(recv_counts_RE, received)
    inverse = torch.empty_like(index).scatter_(
        0, index, torch.arange(received, device=index.device)
    )
    y_recv = _Reorder.apply(experts(_Reorder.apply(x_recv, index, inverse), offs), inverse, index)
    y_back = all_to_all(y_recv, group, in_splits, out_splits)
    return combine(y_back, layout, weights_TK, dense=True), extra


# --------------------------------------------------------------------------- capacity
def capacity_per_sequence(
    seq_len: int, top_k: int, num_experts: int, capacity_factor: float
) -> int:
    """Rows each sequence may send to each expert: ``ceil(capacity_factor * S * K / E)``, >= 1."""
    return max(1, math.ceil(capacity_factor * seq_len * top_k / num_experts))


def capacity_layout(
    ids_TK: torch.Tensor, num_experts: int, batch: int, capacity: int
) -> tuple[RoutingLayout, torch.Tensor]:
    """The capped layout: rows ``[E, batch, capacity]`` (expert, sequence, arrival), no host sync.

    Returns ``(layout, dropped)``: a :class:`~forge_kernels.permute.RoutingLayout` whose rows are
    the fixed buffer (``gather_idx`` sentinel ``T*K`` for empty rows, ``scatter_idx`` equal to
    the row count for dropped slots) and the number of dropped slots (a device scalar).
    """
    t, k = ids_TK.shape
    seq_len = t // batch if batch else 0
    groups = num_experts * batch
    # Group id (expert, sequence): expert-major so the buffer is ordered by owning rank.
    seq_T = torch.arange(t, device=ids_TK.device) // max(seq_len, 1)
    group_S = (ids_TK.long() * batch + seq_T.unsqueeze(1)).reshape(-1)
    inner = routing_layout(group_S.view(t, k), groups)
    counts_G = inner.counts.long()
    start_G = inner.offs.long() - counts_G
    rank_S = inner.scatter_idx - start_G[group_S]
    rows = groups * capacity
    scatter_idx = torch.where(rank_S < capacity, group_S * capacity + rank_S, rows)
    arrival = torch.arange(capacity, device=ids_TK.device)
    in_use_GC = arrival.unsqueeze(0) < counts_G.unsqueeze(1)
    position_GC = (start_G.unsqueeze(1) + arrival.unsqueeze(0)).clamp(max=t * k)
    slots = torch.cat([inner.gather_idx, inner.gather_idx.new_full((1,), t * k)])
    gather_idx = torch.where(in_use_GC, slots[position_GC], t * k).reshape(-1)
    kept_E = counts_G.clamp(max=capacity).view(num_experts, batch).sum(1)
    offs = torch.arange(1, num_experts + 1, device=ids_TK.device) * (batch * capacity)
    dropped = (counts_G - capacity).clamp(min=0).sum()
    layout = RoutingLayout(kept_E.int(), offs.int(), gather_idx, scatter_idx)
    return layout, dropped


def capacity_dispatch(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    experts: ExpertsFn,
    num_experts: int,
    *,
    batch: int,
    capacity: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Capacity-limited dispatch with no host sync. Returns ``(out [T, D], dropped slots)``.

    With ``group`` (R ranks) every rank sends ``E/R * batch * capacity`` rows to every rank:
    equal splits, so all ranks of the group must run the same ``[batch, seq_len]`` shape (as
    data-parallel training does).
    """
    if batch == 0:
        # No sequences (every rank of the group alike, as equal splits require): no exchange;
        # the experts run on zero rows so their gradients are zeros, not None.
        local = num_experts // (1 if group is None else dist.get_world_size(group))
        empty = experts(x_TD[:0], torch.zeros(local, dtype=torch.int32, device=x_TD.device))
        return empty.sum(0, keepdim=True).expand(0, -1), torch.zeros((), dtype=torch.int64)
    layout, dropped = capacity_layout(ids_TK, num_experts, batch, capacity)
    x_send = permute(x_TD, layout, ids_TK.shape[1])  # [E * batch * capacity, D]
    if group is None:
        return combine(experts(x_send, layout.offs), layout, weights_TK), dropped
    ranks = dist.get_world_size(group)
    local_experts, block, dim = num_experts // ranks, batch * capacity, x_TD.shape[1]
    x_recv = all_to_all(x_send, group)  # [ranks, local_experts, block] rows
    x_e = x_recv.view(ranks, local_experts, block, dim).transpose(0, 1).reshape(-1, dim)
    offs = torch.arange(1, local_experts + 1, device=x_TD.device, dtype=torch.int32) * (
        ranks * block
    )
    y_e = experts(x_e, offs)
    y_recv = y_e.view(local_experts, ranks, block, dim).transpose(0, 1).reshape(-1, dim)
    return combine(all_to_all(y_recv, group), layout, weights_TK), dropped

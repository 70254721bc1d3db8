"""Token layouts for the experts, and moving expert rows between the ranks of an ``ep`` group.

Provides the layouts the MoE layer builds on its own rank (:func:`capacity_per_sequence`,
:func:`capacity_layout`; the dropless layout is ``forge_kernels.permute.routing_layout``), the
row movers that expert parallelism runs around the experts (:func:`exchange_counts`,
:func:`dispatch_rows`, :func:`dispatch_equal_rows`, :func:`expert_counts`) and the
differentiable :func:`all_to_all`. The movers are pure functions of their arguments: the state
of a layer's expert parallelism (group, staging buffer, what a forward sent) lives in
``forge_moe_ep.parallel.ExpertParallel``, which calls them from module hooks.

What the experts see (:data:`ExpertsFn`): expert-major rows and either the groups' end offsets
(``offs``) or ``None`` for equal groups. The two dispatch modes (``ModelConfig.moe_dispatch``):

- ``dropless``: every routed token is computed; rows come from ``routing_layout`` (exactly the
  routed rows, variable groups). Locally that needs no host sync (grouped GEMM offsets stay on
  the device). Under EP the all-to-all needs the split sizes on the host: the per-expert counts
  are exchanged with a fixed-size all-to-all (:func:`exchange_counts`) as soon as the router has
  chosen, their device-to-host copy is started at once (``forge_kernels.native.StagedSplits``),
  the token permute and the shared expert are launched while it flies, and the host waits once,
  right before the variable-size all-to-all (:func:`dispatch_rows`). That wait is the only host
  sync of the layer, forward or backward (the backward reuses the split lists).
- ``capacity``: each sequence sends at most ``C = ceil(capacity_factor * S * K / E)`` tokens to
  each expert; earlier positions win, the rest are dropped (they get only the shared expert and
  the residual) and counted. The rows are ``E`` equal groups of ``batch x C`` (:func:`
  capacity_layout`), so every buffer is sized from shapes and the all-to-alls have equal splits
  (:func:`dispatch_equal_rows`): no host sync at all. Because the capacity is per sequence,
  which tokens are dropped does not depend on how the batch is split across ranks: a
  single-device model drops the same.

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

import torch
import torch.distributed as dist
from forge_kernels.permute import RoutingLayout, rank_major_to_expert_major, routing_layout

__all__ = [
    "ExpertsFn",
    "SendBack",
    "all_to_all",
    "capacity_layout",
    "capacity_per_sequence",
    "dispatch_equal_rows",
    "dispatch_rows",
    "exchange_counts",
    "expert_counts",
]

#: ``experts(x_rows [M, D], offs [E_local] | None) -> [M, D]``: the grouped SwiGLU over
#: expert-major rows. ``offs`` holds the groups' cumulative ends; every caller here passes
#: ``offs[-1] == M`` (no row outside a group), so an implementation may skip zeroing rows past
#: ``offs[-1]`` (``forge_kernels.grouped_gemm(..., dense=True)``). ``None`` means ``E_local``
#: equal groups of ``M / E_local`` rows: a fact known from shapes alone, which lets expert
#: parallelism move the rows with equal splits and no host sync (the capacity mode).
ExpertsFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]

#: Returns the experts' output rows of one forward to the ranks that sent them (the inverse of
#: a :func:`dispatch_rows` / :func:`dispatch_equal_rows` call; differentiable).
SendBack = Callable[[torch.Tensor], torch.Tensor]


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


# --------------------------------------------------------------------------- dropless, EP
def expert_counts(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed slots per expert, ``int64 [num_experts]``, on the device (no host sync).

    Equals ``routing_layout(ids_TK, num_experts).counts`` for ids in ``[0, num_experts)``;
    cheaper, for a caller that needs only the counts (the early split-size exchange).
    """
    flat = ids_TK.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids_TK.device)
    return counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))


def exchange_counts(
    send_counts_E: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-size all-to-all of per-expert row counts; no host sync.

    ``send_counts_E [E]``: rows this rank sends to each expert (experts split in contiguous
    ranges over the R ranks of ``group``). Returns ``(recv_counts_E, splits [2R])``:
    ``recv_counts_E.view(R, E / R)[r, e]`` is the number of rows rank r sends to local expert e,
    and ``splits`` holds the rows sent to each rank, then the rows received from each rank: the
    all-to-all split sizes, to be staged to the host (``StagedSplits(2 * R)``).
    """
    ranks = dist.get_world_size(group)
    recv_counts = torch.empty_like(send_counts_E)
    dist.all_to_all_single(recv_counts, send_counts_E, group=group)  # fixed size: E ints
    splits = torch.cat([send_counts_E.view(ranks, -1).sum(1), recv_counts.view(ranks, -1).sum(1)])
    return recv_counts, splits


def dispatch_rows(
    x_rows: torch.Tensor,
    group: dist.ProcessGroup,
    recv_counts_E: torch.Tensor,
    splits: list[int],
) -> tuple[torch.Tensor, torch.Tensor, SendBack]:
    """Send expert-major rows to the ranks owning their experts (variable splits).

    ``x_rows``: this rank's rows, expert-major over all ``E`` experts; ``recv_counts_E`` and
    ``splits`` (on the host, as ``StagedSplits.wait`` returns it) come from
    :func:`exchange_counts`. Returns ``(rows for the local experts, expert-major; their offs
    [E / R]; send_back)``: ``send_back(y)`` returns the experts' output rows to their senders in
    ``x_rows``' order.
    """
    ranks = dist.get_world_size(group)
    in_splits, out_splits = splits[:ranks], splits[ranks:]
    received = sum(out_splits)
    x_recv = all_to_all(x_rows, group, out_splits, in_splits)
    # Rows arrive grouped by source rank, then local expert; the grouped GEMM wants expert-major.
    # The buffer holds exactly the received rows, so the reorder is a permutation (no sentinel).
    index, offs = rank_major_to_expert_major(recv_counts_E.view(ranks, -1), received)
    inverse = torch.empty_like(index).scatter_(
        0, index, torch.arange(received, device=index.device)
    )

    def send_back(y_local: torch.Tensor) -> torch.Tensor:
        return all_to_all(_Reorder.apply(y_local, inverse, index), group, in_splits, out_splits)

    return _Reorder.apply(x_recv, index, inverse), offs, send_back


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


def dispatch_equal_rows(
    x_rows: torch.Tensor, group: dist.ProcessGroup, num_experts: int
) -> tuple[torch.Tensor, SendBack]:
    """Send ``num_experts`` equal groups of rows to the ranks owning them: no host sync.

    Every rank sends ``E/R * block`` rows to every rank (``block = rows / E``): equal splits, so
    all ranks of the group must pass the same number of rows (as data-parallel training with one
    ``[batch, seq_len]`` shape does). Returns ``(rows for the local experts, expert-major: E/R
    equal groups of R * block; send_back)``. Zero rows (no sequences, on every rank alike, as
    equal splits require) need no exchange.
    """
    if x_rows.shape[0] == 0:
        return x_rows, _unchanged
    if x_rows.shape[0] % num_experts:
        raise ValueError(
            f"dispatch_equal_rows: {x_rows.shape[0]} rows do not form {num_experts} equal groups"
        )
    ranks = dist.get_world_size(group)
    local_experts, dim = num_experts // ranks, x_rows.shape[1]
    block = x_rows.shape[0] // num_experts
    x_recv = all_to_all(x_rows, group)  # [ranks, local_experts, block] rows

    def send_back(y_local: torch.Tensor) -> torch.Tensor:
        y_recv = y_local.view(local_experts, ranks, block, dim).transpose(0, 1).reshape(-1, dim)
        return all_to_all(y_recv, group)

    x_local = x_recv.view(ranks, local_experts, block, dim).transpose(0, 1).reshape(-1, dim)
    return x_local, send_back


def _unchanged(y: torch.Tensor) -> torch.Tensor:
    return y

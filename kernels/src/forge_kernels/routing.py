"""The routing-layout contract shared by the Triton, native and PyTorch implementations.

A top-k routing ``expert_ids [T, K]`` (slots ``s = t*K + k``) becomes an expert-major, padded
row layout: ``counts`` int32 [E] (slots per expert), ``offs`` int32 [E] (cumulative ends of the
padded groups, the grouped GEMM's offs), ``gather_idx`` int64 [capacity] (the slot each row holds,
sentinel ``T*K`` for padding and unused rows) and ``scatter_idx`` int64 [T*K] (each slot's row;
``capacity`` for dropped ids). ``capacity`` is static: ``T*K`` if ``align == 1`` else
``T*K + E*(align-1)``. Slots keep their order within an expert. Ids outside ``[0, E)`` are
dropped (not counted). This module holds the one pure-PyTorch implementation: no host sync, no
atomics, compile-friendly; the Triton (:mod:`forge_kernels.permute`) and native
(:mod:`forge_kernels.native`) paths are tested against it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["RoutingLayout", "check_routing_args", "routing_capacity", "routing_layout_reference"]

_INT32_MAX = 2**31 - 1


class RoutingLayout(NamedTuple):
    """Outputs of :func:`routing_layout` (see the module docstring for the contract)."""

    counts: torch.Tensor  # int32 [E]
    offs: torch.Tensor  # int32 [E]
    gather_idx: torch.Tensor  # int64 [capacity]
    scatter_idx: torch.Tensor  # int64 [T*K]


def routing_capacity(num_tokens: int, top_k: int, num_experts: int, align: int = 1) -> int:
    """Static row count of the padded layout: ``T*K`` if ``align == 1`` else ``T*K + E*(align-1)``."""
    n = num_tokens * top_k
    return n if align == 1 else n + num_experts * (align - 1)


def check_routing_args(expert_ids: torch.Tensor, num_experts: int, align: int) -> None:
    # Same checks and messages as kernels/csrc/routing_layout.h.
    if expert_ids.dim() != 2:
        raise ValueError(f"routing_layout: expert_ids must be 2-D [T, K], got {expert_ids.dim()}-D")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"routing_layout: expert_ids must be int32 or int64, got {expert_ids.dtype}"
        )
    if num_experts < 1:
        raise ValueError(f"routing_layout: num_experts must be >= 1, got {num_experts}")
    if align < 1:
        raise ValueError(f"routing_layout: align must be >= 1, got {align}")
    if num_experts >= _INT32_MAX or align >= _INT32_MAX:
        raise ValueError("routing_layout: num_experts and align must fit in int32")
    capacity = routing_capacity(expert_ids.numel(), 1, num_experts, align)
    if capacity >= _INT32_MAX:
        raise ValueError(
            f"routing_layout: capacity T*K + E*(align-1) = {capacity} does not fit in int32"
        )


def routing_layout_reference(
    expert_ids: torch.Tensor, num_experts: int, align: int = 1
) -> RoutingLayout:
    """Pure-PyTorch :func:`routing_layout`: identical results, no host sync, compile-friendly.

    A stable sort of the slots by expert (invalid ids go to an extra last bucket), bucket starts
    by ``searchsorted`` (no atomics), then each slot's row = its padded group start + its rank.
    """
    check_routing_args(expert_ids, num_experts, align)
    device = expert_ids.device
    num_slots = expert_ids.numel()
    capacity = routing_capacity(num_slots, 1, num_experts, align)
    ids_S = expert_ids.reshape(-1).to(torch.int64)
    valid_S = (ids_S >= 0) & (ids_S < num_experts)
    bucket_S = torch.where(valid_S, ids_S, num_experts)
    sorted_bucket, order = torch.sort(bucket_S, stable=True)
    # first[b] = position of bucket b's first slot in sorted order, b in [0, E].
    first = torch.searchsorted(
        sorted_bucket, torch.arange(num_experts + 1, device=device, dtype=torch.int64)
    )
    counts_E = first[1:] - first[:-1]
    padded_E = (counts_E + (align - 1)) // align * align
    offs_E = padded_E.cumsum(0)
    group_start = torch.cat([offs_E - padded_E, offs_E.new_full((1,), capacity)])
    rank = torch.arange(num_slots, device=device, dtype=torch.int64) - first[sorted_bucket]
    rows_sorted = torch.where(
        sorted_bucket < num_experts, group_start[sorted_bucket] + rank, capacity
    )
    scatter_idx = torch.empty_like(rows_sorted).scatter_(0, order, rows_sorted)
    # One extra row collects the dropped slots and is cut off.
    gather_idx = torch.full((capacity + 1,), num_slots, dtype=torch.int64, device=device)
    gather_idx = gather_idx.scatter_(0, rows_sorted, order)[:capacity].clone()
    return RoutingLayout(counts_E.to(torch.int32), offs_E.to(torch.int32), gather_idx, scatter_idx)

"""Dealing packed documents over the cp ranks by their attention work."""

from __future__ import annotations

import pytest
import torch
from forge_cp import LoadBalancedShard
from forge_cp.sequence import balanced_order, shard_sequence


def _loads(order: torch.Tensor, work: torch.Tensor, cp: int) -> list[int]:
    return [int(part.sum()) for part in work[order].chunk(cp)]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_one_document_is_dealt_as_the_fixed_pairing(cp):
    length = 8 * cp
    order = balanced_order(torch.arange(1, length + 1), cp, 2)
    fixed = torch.cat([shard_sequence(torch.arange(length), cp, r, dim=0) for r in range(cp)])
    assert torch.equal(order, fixed)


def test_uneven_documents_are_balanced_better_than_the_fixed_pairing():
    cp, length = 4, 64
    positions = torch.cat([torch.arange(n) for n in (48, 4, 4, 8)])  # one long document first
    work = positions + 1
    fixed = torch.cat([shard_sequence(torch.arange(length), cp, r, dim=0) for r in range(cp)])
    dealt = LoadBalancedShard(cp, 0).for_documents(positions[None])[1]
    before, after = _loads(fixed, work, cp), _loads(dealt, work, cp)
    assert sum(before) == sum(after)
    assert max(before) / min(before) > 7  # the pairing: one rank 7 times another's work
    assert max(after) / min(after) < 1.1
    assert sorted(dealt.tolist()) == list(range(length))
    for part in dealt.chunk(cp):  # each rank keeps its tokens in the row's order
        assert torch.equal(part, part.sort().values)


def test_every_rank_deals_the_same_order_and_keeps_its_own_tokens():
    positions = torch.cat([torch.arange(n) for n in (10, 6, 16)])[None].expand(2, -1)
    x = torch.arange(32)[None].expand(2, -1)
    parts, orders = [], []
    for rank in range(2):
        shard, order = LoadBalancedShard(2, rank).for_documents(positions)
        parts.append(shard(x))
        orders.append(order)
    assert torch.equal(orders[0], orders[1])
    assert torch.equal(torch.cat(parts, dim=1)[0], orders[0])


def test_a_length_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 4"):
        LoadBalancedShard(2, 0).for_documents(torch.zeros(1, 30, dtype=torch.long))

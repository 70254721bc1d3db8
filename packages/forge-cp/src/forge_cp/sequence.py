"""The load-balanced layout of a sequence over ``cp`` ranks.

A sequence of ``S`` tokens is cut into ``2 cp`` equal chunks; rank ``r`` keeps chunk ``r`` and
chunk ``2 cp - 1 - r``, in that order. Under causal attention a token attends to every token
before it, so the work of a chunk grows with its index; pairing an early chunk with a late one
gives every rank the same work (``2 cp + 1`` chunk-by-chunk blocks each), where plain
contiguous slices would leave the last rank ``2 cp - 1`` times the first one's.

Inputs, targets and positions all go through :func:`shard_sequence` with the same layout, so a
rank's targets stay aligned with its inputs and RoPE sees each token's global position.

Packed documents change the work: a token attends to the earlier tokens of its own document only,
so its work is its position in the document plus one, and the fixed pairing no longer balances
(one long document at the end of a row of short ones loads the ranks holding its chunks).
:func:`balanced_order` then deals blocks of the row to the ranks by their measured work, largest
first, each to the least-loaded rank with room left; every rank still gets the same number of
tokens, so the collectives keep equal shapes. For a single document (work ``1 .. S``) and two
blocks per rank it deals exactly the fixed pairing above.
"""

from __future__ import annotations

import torch

__all__ = [
    "balanced_order",
    "check_shardable",
    "chunk_order",
    "gather_sequence",
    "shard_sequence",
    "sequence_positions",
]


def chunk_order(cp: int) -> list[int]:
    """Chunk indices (of ``2 cp``) in the order the ranks hold them: rank ``r``'s two chunks
    are entries ``2r`` and ``2r + 1``."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def check_shardable(length: int, cp: int) -> None:
    """Refuse, in one line, a sequence length the ``cp`` ranks cannot split into ``2 cp`` chunks."""
    if length % (2 * cp):
        raise ValueError(
            f"sequence length {length} is not divisible by 2 x cp = {2 * cp}: each of the {cp} "
            "context-parallel ranks holds two equal chunks"
        )


def shard_sequence(x: torch.Tensor, cp: int, rank: int, *, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` along ``dim`` (length divisible by ``2 cp``)."""
    length = x.shape[dim]
    check_shardable(length, cp)
    chunk = length // (2 * cp)
    front, back = rank, 2 * cp - 1 - rank
    return torch.cat((x.narrow(dim, front * chunk, chunk), x.narrow(dim, back * chunk, chunk)), dim)


def sequence_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions ``[seq_len / cp]`` of the tokens rank ``rank`` holds."""
    return shard_sequence(torch.arange(seq_len), cp, rank, dim=0)


def gather_sequence(parts: list[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]``: rank ``r``'s), in order."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        front, back = part.chunk(2, dim)
        chunks[r], chunks[2 * cp - 1 - r] = front, back
    return torch.cat([c for c in chunks if c is not None], dim)


def balanced_order(work: torch.Tensor, cp: int, blocks_per_rank: int = 2) -> torch.Tensor:
    """The tokens of a row dealt to ``cp`` ranks by their ``work [S]``: int64 ``[S]``, rank
    ``r``'s tokens at ``[r S / cp, (r + 1) S / cp)`` (each rank's in the row's order).

    The row is cut into ``cp x blocks_per_rank`` equal blocks; the blocks, heaviest first, go
    each to the least-loaded rank that has room (ties: the lower block, the lower rank), so every
    rank gets ``blocks_per_rank`` blocks. Deterministic: every cp rank computes the same order
    from the same work.
    """
    length, blocks = work.shape[0], cp * blocks_per_rank
    if length % blocks:
        raise ValueError(
            f"sequence length {length} is not divisible by {blocks} blocks ({blocks_per_rank} "
            f"per context-parallel rank, {cp} ranks)"
        )
    size = length // blocks
    block_work = work.reshape(blocks, size).sum(1).tolist()
    load, owned = [0] * cp, [[] for _ in range(cp)]  # type: list[int], list[list[int]]
    for block in sorted(range(blocks), key=lambda b: (-block_work[b], b)):
        rank = min((r for r in range(cp) if len(owned[r]) < blocks_per_rank), key=lambda r: load[r])
        owned[rank].append(block)
        load[rank] += block_work[block]
    starts = [b * size for r in range(cp) for b in sorted(owned[r])]
    return (torch.tensor(starts)[:, None] + torch.arange(size)).flatten()

"""The load-balanced layout of a sequence over ``cp`` ranks.

A sequence of ``S`` tokens is cut into ``2 cp`` equal chunks; rank ``r`` keeps chunk ``r`` and
chunk ``2 cp - 1 - r``, in that order. Under causal attention a token attends to every token
before it, so the work of a chunk grows with its index; pairing an early chunk with a late one
gives every rank the same work (``2 cp + 1`` chunk-by-chunk blocks each), where plain
contiguous slices would leave the last rank ``2 cp - 1`` times the first one's.

Inputs, targets and positions all go through :func:`shard_sequence` with the same layout, so a
rank's targets stay aligned with its inputs and RoPE sees each token's global position.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_order", "gather_sequence", "shard_sequence", "sequence_positions"]


def chunk_order(cp: int) -> list[int]:
    """Chunk indices (of ``2 cp``) in the order the ranks hold them: rank ``r``'s two chunks
    are entries ``2r`` and ``2r + 1``."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def shard_sequence(x: torch.Tensor, cp: int, rank: int, *, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` along ``dim`` (length divisible by ``2 cp``)."""
    length = x.shape[dim]
    if length % (2 * cp):
        raise ValueError(
            f"sequence length {length} is not divisible by 2 x cp = {2 * cp}: each of the {cp} "
            "context-parallel ranks holds two equal chunks"
        )
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

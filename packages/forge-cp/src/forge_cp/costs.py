"""What context parallelism adds to a training step, for ``forge plan``: the keys and values each
attention all-gathers (and reduce-scatters back in backward), and what that keeps alive.

forge-cp's attention gathers the whole sequence's keys and values of the rank's heads, so that
part of the activations does not shrink with ``cp``; the rest of a block does (``seq_len / cp``
tokens per rank).
"""

from __future__ import annotations

from forge_core.costs import CollectiveTally

__all__ = ["cp_attention_extra_bytes", "cp_collectives", "cp_kept_once_bytes"]


def cp_attention_extra_bytes(
    *, b: int, seq_len: int, cp: int, dim: int, kv_dim: int, tp: int, itemsize: int
) -> int:
    """What one attention keeps under CP beyond a rank's own ``seq_len / cp`` tokens: the
    gathered keys and values of the rest of the sequence, ``2 b (seq_len - s) kv_dim/t e``, and
    the output of its second SDPA call (one per chunk; ``wo`` keeps their concatenation),
    ``b s d/t e``."""
    if cp == 1:
        return 0
    s = seq_len // cp
    return 2 * b * (seq_len - s) * (kv_dim // tp) * itemsize + b * s * (dim // tp) * itemsize


def cp_kept_once_bytes(*, seq_len: int, cp: int, head_dim: int, itemsize: int, device: str) -> int:
    """Kept once per rank (not per block) under CP: in float32 the RoPE rows of the rank's
    positions ``2 s head_dim 4``; on ``device="cpu"`` the two mask rows the kernel shares by
    every layer, ``e ((2 cp + 3) c - 2)`` with ``c = seq_len / 2 cp`` (CUDA's kernels need
    none)."""
    if cp == 1:
        return 0
    s, chunk = seq_len // cp, seq_len // (2 * cp)
    rope = 0 if itemsize != 4 else 2 * s * head_dim * 4
    # the masks: one row of chunk + end - 1 values per chunk (end: (r + 1) c, (2 cp - r) c)
    return rope + (itemsize * ((2 * cp + 3) * chunk - 2) if device == "cpu" else 0)


def cp_collectives(
    tally: CollectiveTally,
    *,
    b: int,
    seq_len: int,
    kv_dim: int,
    tp: int,
    itemsize: int,
    block_passes: int,
    ac: int,
) -> None:
    """Each attention pass gathers the keys and values of the whole sequence (its local heads)
    on the ``cp`` axis, again when AC full recomputes it (``ac`` = 1), and reduce-scatters their
    gradients in backward."""
    kv = 2 * b * seq_len * kv_dim // tp * itemsize
    tally.add("forward all_gather", "cp", kv, block_passes * (1 + ac), "CP: keys and values")
    tally.add("backward reduce_scatter", "cp", kv, block_passes, "CP: their gradients")

"""What context parallelism adds to a training step, for ``forge plan``: the keys and values each
attention all-gathers (and reduce-scatters back in backward), or the heads variant's
all-to-alls, and what that keeps alive.

The all-gather variant keeps the whole sequence's keys and values of the rank's heads, so that
part of the activations does not shrink with ``cp``; the rest of a block does (``seq_len / cp``
tokens per rank). The heads variant keeps the whole sequence of ``1 / cp`` of the heads: the
same bytes as the rank's own tokens of every head, plus what it copies.
"""

from __future__ import annotations

from forge_core.costs import CollectiveTally

from .checks import kv_head_copies

__all__ = [
    "cp_attention_extra_bytes",
    "cp_collectives",
    "cp_kept_once_bytes",
    "document_mask_bytes",
]


def _kv_repeat(kv_dim: int, tp: int, head_dim: int, cp: int) -> int:
    """:func:`forge_cp.checks.kv_head_copies` of the key/value heads per tp rank."""
    return kv_head_copies(max(1, kv_dim // tp // head_dim), cp)


def cp_attention_extra_bytes(
    *,
    b: int,
    seq_len: int,
    cp: int,
    dim: int,
    kv_dim: int,
    tp: int,
    itemsize: int,
    variant: str = "allgather",
    head_dim: int = 1,
) -> int:
    """What one attention keeps under CP beyond a rank's own ``seq_len / cp`` tokens.

    ``allgather``: the gathered keys and values of the rest of the sequence,
    ``2 b (seq_len - s) kv_dim/t e``, and the output of its second SDPA call (one per chunk;
    ``wo`` keeps their concatenation), ``b s d/t e``. ``heads``: SDPA keeps the whole sequence
    of ``1 / cp`` of the heads (as many bytes as the rank's own tokens of every head), ``wo``
    its own copy of the output sent back, ``b s d/t e``, and with fewer key/value heads per tp
    rank than cp each goes to ``cp / n_kv`` ranks: ``(cp / n_kv - 1) 2 b s kv_dim/t e`` more."""
    if cp == 1:
        return 0
    s = seq_len // cp
    out = b * s * (dim // tp) * itemsize
    if variant == "heads":
        repeat = _kv_repeat(kv_dim, tp, head_dim, cp)
        return out + (repeat - 1) * 2 * b * s * (kv_dim // tp) * itemsize
    return 2 * b * (seq_len - s) * (kv_dim // tp) * itemsize + out


def cp_kept_once_bytes(
    *,
    seq_len: int,
    cp: int,
    head_dim: int,
    itemsize: int,
    device: str,
    variant: str = "allgather",
) -> int:
    """Kept once per rank (not per block) under CP: in float32 the RoPE rows of the rank's
    positions ``2 s head_dim 4``; with the all-gather variant on ``device="cpu"`` the two mask
    rows the kernel shares by every layer, ``e ((2 cp + 3) c - 2)`` with ``c = seq_len / 2 cp``
    (CUDA's kernels need none, nor does the heads variant's causal SDPA)."""
    if cp == 1:
        return 0
    s, chunk = seq_len // cp, seq_len // (2 * cp)
    rope = 0 if itemsize != 4 else 2 * s * head_dim * 4
    masks = device == "cpu" and variant == "allgather"
    # the masks: one row of chunk + end - 1 values per chunk (end: (r + 1) c, (2 cp - r) c)
    return rope + (itemsize * ((2 * cp + 3) * chunk - 2) if masks else 0)


def document_mask_bytes(
    *, b: int, seq_len: int, cp: int, itemsize: int, variant: str = "allgather"
) -> int:
    """The one additive mask packed documents keep per micro-batch of ``b`` rows (shared by
    every layer, alive while its documents are: under any AC mode): ``b q seq_len e`` with
    ``q`` the queries a rank masks, the whole row on one device or under the heads variant,
    its own ``seq_len / cp`` tokens under the all-gather variant."""
    queries = seq_len if cp == 1 or variant == "heads" else seq_len // cp
    return b * queries * seq_len * itemsize


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
    variant: str = "allgather",
    dim: int = 0,
    head_dim: int = 1,
    cp: int = 2,
) -> None:
    """``allgather``: each attention pass gathers the keys and values of the whole sequence
    (its local heads) on the ``cp`` axis, again when AC full recomputes it (``ac`` = 1), and
    reduce-scatters their gradients in backward. ``heads``: each pass sends q, k, v (of the
    rank's ``seq_len / cp`` tokens) to the ranks of their heads and the output back, four
    all-to-alls, and as many for the gradients in backward."""
    if variant == "heads":
        s = seq_len // cp
        kv = 2 * b * s * (kv_dim // tp) * itemsize * _kv_repeat(kv_dim, tp, head_dim, cp)
        qo = 2 * b * s * (dim // tp) * itemsize
        passes = block_passes * (1 + ac)
        tally.add("forward all_to_all", "cp", qo // 2, 2 * passes, "CP heads: q and the output")
        tally.add("forward all_to_all", "cp", kv // 2, 2 * passes, "CP heads: k and v")
        tally.add("backward all_to_all", "cp", qo // 2, 2 * block_passes, "CP heads: q, out grads")
        tally.add("backward all_to_all", "cp", kv // 2, 2 * block_passes, "CP heads: k, v grads")
        return
    kv = 2 * b * seq_len * kv_dim // tp * itemsize
    tally.add("forward all_gather", "cp", kv, block_passes * (1 + ac), "CP: keys and values")
    tally.add("backward reduce_scatter", "cp", kv, block_passes, "CP: their gradients")

"""Tensor and sequence parallelism's collectives in a training step, counted for ``forge plan``.

The counts follow the plan as it was applied (:class:`~forge_tp_plans.AppliedPlan`: sequence
and loss parallelism on or off), per decoder block pass and per pass of the head.
"""

from __future__ import annotations

from forge_core.costs import CollectiveTally

from .apply import AppliedPlan

__all__ = ["tp_collectives"]


def tp_collectives(
    tally: CollectiveTally,
    applied: AppliedPlan,
    *,
    dim: int,
    vocab_size: int,
    tie_embeddings: bool,
    block_passes: int,
    replicated_passes: int,
    head_passes: int,
    ac: int,
    tokens: int,
    itemsize: int,
) -> None:
    """TP's and SP's activation collectives and the head's, on the ``tp`` axis.

    ``block_passes``: decoder block forwards per step (blocks x passes), of which
    ``replicated_passes`` run a block whose FFN slot is replicated on tp (an MoE: no TP inside);
    ``head_passes``: forwards of the final norm and head (0 on a pipeline rank without the
    last stage); ``ac``: 1 when AC full recomputes each block's forward (its attention's
    collectives again, not the FFN's output reduction); ``tokens``: one pass's tokens on this
    rank (batch x local sequence); ``itemsize``: bytes per activation element.
    """
    act, blocks, head = tokens * dim * itemsize, block_passes, head_passes
    dense = blocks - replicated_passes
    if applied.sequence_parallel:  # per block: gather in, reduce-scatter out (MoE: slice)
        rows = [
            ("forward all_gather", 2 * blocks * (1 + ac) + head, "SP: attention/FFN/head input"),
            ("forward reduce_scatter", blocks * (1 + ac) + dense, "SP: wo/w2 output"),
            ("backward reduce_scatter", blocks + dense + head, "SP: grads of gathered inputs"),
            ("backward all_gather", 2 * blocks + head, "SP: grads of split outputs/block 0"),
        ]
        tally.add(
            "backward all_reduce", "tp", dim * itemsize, 2 * blocks + head, "SP: norm weight grads"
        )
    else:  # each column-parallel Linear's input gradient is reduced on its own
        fwd = blocks * (1 + ac) + dense + head * tie_embeddings  # + the tied embedding
        rows = [
            ("forward all_reduce", fwd, "TP: row-parallel outputs"),
            ("backward all_reduce", 3 * blocks + 2 * dense + head, "TP: column-parallel inputs"),
        ]
    for op, n, what in rows:
        tally.add(op, "tp", act, n, what)
    if applied.loss_parallel:
        tally.add("forward all_reduce", "tp", 4 * tokens, 3 * head, "loss parallel: max/sum/target")
    else:
        tally.add("forward all_gather", "tp", tokens * vocab_size * itemsize, head, "TP: logits")

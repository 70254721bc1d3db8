"""forge-tp-plans' cost terms: TP's and SP's collectives per block pass and head pass."""

from __future__ import annotations

from forge_core.costs import CollectiveTally
from forge_tp_plans import AppliedPlan
from forge_tp_plans.costs import tp_collectives


def _rows(sp: bool, lp: bool) -> dict[tuple[str, str, str], int]:
    applied = AppliedPlan("registered", 2, sp, lp, {}, (), ())
    tally = CollectiveTally({"tp": 2})
    tp_collectives(
        tally,
        applied,
        dim=64,
        vocab_size=256,
        tie_embeddings=False,
        block_passes=4,
        replicated_passes=2,
        head_passes=2,
        ac=0,
        tokens=32,
        itemsize=4,
    )
    return {(c.phase, c.kind, c.what): c.count for c in tally.table()}


def test_basic_tp_reduces_each_row_parallel_output_and_gathers_the_logits():
    rows = _rows(sp=False, lp=False)
    assert rows[("forward", "all_reduce", "TP: row-parallel outputs")] == 4 + 2
    assert rows[("backward", "all_reduce", "TP: column-parallel inputs")] == 12 + 4 + 2
    assert rows[("forward", "all_gather", "TP: logits")] == 2


def test_sequence_and_loss_parallel_replace_them():
    rows = _rows(sp=True, lp=True)
    assert rows[("forward", "all_gather", "SP: attention/FFN/head input")] == 2 * 4 + 2
    assert rows[("forward", "reduce_scatter", "SP: wo/w2 output")] == 4 + 2
    assert rows[("forward", "all_reduce", "loss parallel: max/sum/target")] == 6
    assert ("forward", "all_reduce", "TP: row-parallel outputs") not in rows

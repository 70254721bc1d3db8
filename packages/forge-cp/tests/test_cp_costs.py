"""forge-cp's cost terms: what CP adds to an attention's saved tensors and its collectives."""

from __future__ import annotations

from forge_core.costs import CollectiveTally
from forge_cp.costs import cp_attention_extra_bytes, cp_collectives, cp_kept_once_bytes


def test_nothing_without_cp():
    kw = dict(b=2, seq_len=64, dim=32, kv_dim=16, tp=1, itemsize=4)
    assert cp_attention_extra_bytes(cp=1, **kw) == 0
    assert cp_kept_once_bytes(seq_len=64, cp=1, head_dim=8, itemsize=4, device="cpu") == 0


def test_the_gathered_keys_and_values_do_not_shrink_with_cp():
    kw = dict(b=2, seq_len=64, dim=32, kv_dim=16, tp=2, itemsize=2)
    # a rank's own 64/cp tokens are counted by the block; CP adds the rest of k and v, and the
    # second SDPA call's output
    assert cp_attention_extra_bytes(cp=2, **kw) == 2 * 2 * 32 * 8 * 2 + 2 * 32 * 16 * 2
    assert cp_attention_extra_bytes(cp=4, **kw) == 2 * 2 * 48 * 8 * 2 + 2 * 16 * 16 * 2
    # on CPU the shared mask rows: (2 cp + 3) c - 2 values, c = seq_len / 2 cp
    assert cp_kept_once_bytes(seq_len=64, cp=2, head_dim=8, itemsize=2, device="cpu") == 2 * 110
    assert cp_kept_once_bytes(seq_len=64, cp=2, head_dim=8, itemsize=2, device="cuda") == 0


def test_each_attention_pass_gathers_and_reduce_scatters_on_cp():
    tally = CollectiveTally({"cp": 2})
    cp_collectives(tally, b=2, seq_len=64, kv_dim=16, tp=2, itemsize=2, block_passes=4, ac=1)
    kv = 2 * 2 * 64 * 16 // 2 * 2
    assert [(c.phase, c.kind, c.bytes, c.count) for c in tally.table()] == [
        ("forward", "all_gather", kv, 8),
        ("backward", "reduce_scatter", kv, 4),
    ]

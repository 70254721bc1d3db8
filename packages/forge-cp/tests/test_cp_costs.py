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


def test_the_heads_variant_keeps_a_shrinking_share_and_moves_four_tensors():
    """heads: beyond the rank's own tokens only wo's copy of the output (and, with fewer
    key/value heads per tp rank than cp, their repeats); no CPU masks; four all-to-alls per
    attention pass and four for the gradients."""
    kw = dict(b=2, seq_len=64, dim=32, kv_dim=16, tp=1, itemsize=2, head_dim=8)
    out2, out4 = 2 * 32 * 32 * 2, 2 * 16 * 32 * 2  # b s d e, s = 64 / cp
    assert cp_attention_extra_bytes(cp=2, variant="heads", **kw) == out2  # 2 kv heads split
    repeat = 2 * 2 * 16 * 16 * 2  # cp=4 over 2 kv heads: each sent twice, one more copy
    assert cp_attention_extra_bytes(cp=4, variant="heads", **kw) == out4 + repeat
    once = dict(seq_len=64, cp=2, head_dim=8, device="cpu", variant="heads")
    assert cp_kept_once_bytes(itemsize=2, **once) == 0
    assert cp_kept_once_bytes(itemsize=4, **once) == 2 * 32 * 8 * 4  # fp32 RoPE rows
    tally = CollectiveTally({"cp": 2})
    cp_collectives(
        tally, b=2, seq_len=64, kv_dim=16, tp=1, itemsize=2, block_passes=4, ac=0,
        variant="heads", dim=32, head_dim=8, cp=2,
    )  # fmt: skip
    q, kv = 2 * 32 * 32 * 2, 2 * 32 * 16 * 2  # per rank: its 32 tokens of every head
    assert sorted((c.phase, c.kind, c.bytes, c.count) for c in tally.table()) == [
        ("backward", "all_to_all", kv, 8),
        ("backward", "all_to_all", q, 8),
        ("forward", "all_to_all", kv, 8),
        ("forward", "all_to_all", q, 8),
    ]

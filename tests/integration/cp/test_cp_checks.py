"""forge with context parallelism: every bad cp config refused before launch (forge.checks),
the degrees it suggests, ParallelPlan's refusals on the ranks in the config's words, and the
plan's activation memory per rank (forge.plan). forge-cp's own pieces: packages/forge-cp/tests/test_cp_units.py."""

from __future__ import annotations

import pytest
from forge.checks import config_problems
from forge.config import load_config
from forge.plan import estimate_activations, plan_layout
from forge_core import ForgeConfigError
from forge_cp import cp_problems

from tests.integration.cp.jobs import capacity_refusal, cp_on_pipeline_stages, too_long_refusal


def _problems(world: int, *sets: str) -> list[str]:
    return config_problems(load_config(None, ("parallelism.tp=1", *sets)), world)


def test_forge_refuses_bad_cp_configs_before_launch():
    assert _problems(2, "parallelism.cp=2", "training.seq_len=64") == []
    (seq,) = _problems(4, "parallelism.cp=4", "training.seq_len=36")
    assert "training.seq_len=36" in seq and "set training.seq_len=32 or 40" in seq
    (none,) = _problems(2, "parallelism.cp=2", "parallelism.data='none'", "training.seq_len=64")
    assert "data='none' with cp=2" in none and "use data='fsdp2'" in none
    vlm = _problems(2, "parallelism.cp=2", "model.preset='debug_vlm'", "training.seq_len=64")
    assert any("vision-language" in p for p in vlm), vlm
    pp = _problems(4, "parallelism.cp=2", "parallelism.pp=2", "training.seq_len=64")
    assert any("inside pipeline" in p for p in pp), pp


def test_cp_degree_suggestions_fit_the_world_size_and_the_other_degrees():
    # 24 ranks, tp=2: cp may be 2, 3, 4, 6 or 12; 60 tokens split in 2 cp chunks for cp in
    # {2, 3, 5, 6, 10, 15}: only 2, 3 and 6 are offered (5, 10, 15 do not fit the ranks)
    sets = ("parallelism.tp=2", "parallelism.cp=4", "training.seq_len=60", "model.max_seq_len=64")
    sets += ("training.global_batch_size=6",)
    (seq,) = config_problems(load_config(None, sets), 24)
    assert seq.endswith("set training.seq_len=56 or 64, or parallelism.cp to one of [2, 3, 6]")
    # 4 ranks, cp=4, 36 tokens: of 2, 3, 6, 9 only 2 fits (before: all four were offered)
    (seq,) = _problems(4, "parallelism.cp=4", "training.seq_len=36")
    assert seq.endswith("or parallelism.cp to one of [2]"), seq
    # the pure check: without the fitting degrees every split is offered, with them only those
    assert cp_problems(4, 36)[0].endswith("one of [2, 3, 6, 9, 18]")
    assert cp_problems(4, 36, fitting_cp=[2, 4])[0].endswith("or parallelism.cp to one of [2]")
    assert cp_problems(4, 36, fitting_cp=[4])[0].endswith("set training.seq_len=32 or 40")


def test_capacity_dispatch_under_cp_is_refused_before_launch_and_by_the_plan(run_on_ranks):
    line = (
        "moe.moe_dispatch='capacity' with parallelism.cp=2: the capacity is counted per "
        "sequence and a context-parallel rank holds only slices of each sequence, so it would "
        "drop other tokens than one device does; set moe.moe_dispatch='dropless' (or "
        "parallelism.cp=1)"
    )
    sets = ("parallelism.cp=2", "model.preset=debug_moe", "training.seq_len=64")
    assert _problems(2, *sets, "moe.moe_dispatch=capacity") == [line]
    assert _problems(2, *sets) == []  # dropless: exact under cp (test_cp_parity)
    # ParallelPlan -> apply_expert_parallel, the same words
    assert run_on_ranks(2, capacity_refusal) == [[line, line], [line, line]]


def test_a_cp_sequence_beyond_max_seq_len_is_one_line_not_an_index_error(run_on_ranks):
    said = (
        "ForgeConfigError: sequence length 48 exceeds model.max_seq_len=32 (the length of the "
        "rotary tables); feed sequences of at most 32 tokens (training.seq_len) or raise "
        "model.max_seq_len"
    )
    assert run_on_ranks(2, too_long_refusal) == [said, said]  # before: IndexError in RoPE


def test_cp_on_pipeline_stages_is_refused_by_the_api_in_the_configs_words(run_on_ranks):
    (line,) = [
        p
        for p in _problems(4, "parallelism.cp=2", "parallelism.pp=2", "training.seq_len=64")
        if "pipeline" in p
    ]
    assert line == (
        "parallelism.cp=2 with parallelism.pp=2: context parallelism inside pipeline stages is "
        "not supported yet; set cp=1 or pp=1"
    )
    for said in run_on_ranks(4, cp_on_pipeline_stages):
        assert said == {"plan": line, "stage": line}


def test_the_plans_activation_memory_per_rank_falls_about_1_over_cp():
    # One sequence of 8k tokens, GQA (the gathered k/v are the part that does not shrink).
    sets = ("parallelism.tp=1", "training.global_batch_size=1", "training.seq_len=8192")
    sets += ("model.max_seq_len=8192", "model.n_heads=8", "model.n_kv_heads=2")
    act = {
        cp: estimate_activations(load_config(None, (*sets, f"parallelism.cp={cp}")), cp).none
        for cp in (1, 2, 4)
    }
    assert 0.5 < act[2] / act[1] < 0.6 and 0.25 < act[4] / act[1] < 0.35, act
    text = plan_layout(load_config(None, (*sets, "parallelism.cp=4")), 4).text()
    assert "1 x 2048 tokens per micro-batch per rank" in text and "seq 8192 / cp 4" in text
    assert "CP: keys and values" in text and "stages: cp -> fsdp2" in text
    # the heads variant: what a rank keeps falls as 1/cp (8 heads, 2 key/value heads: at cp=4
    # each key/value head goes to two ranks, one extra copy of a rank's own k and v per block)
    heads = {
        cp: estimate_activations(
            load_config(None, (*sets, f"parallelism.cp={cp}", "cp.variant=heads")), cp
        ).none
        for cp in (2, 4)
    }
    assert heads[2] < act[2] and heads[4] < act[4], (heads, act)
    # (the rest over 1/cp: wo's own copy of the output sent back, and at cp=4 the repeats)
    assert 0.5 < heads[2] / act[1] < 0.54 and 0.25 < heads[4] / act[1] < 0.28, (heads, act)
    text = plan_layout(load_config(None, (*sets, "parallelism.cp=4", "cp.variant=heads")), 4)
    assert "CP heads: q and the output" in text.text() and "CP: keys" not in text.text()


def test_the_heads_variant_is_refused_where_the_heads_do_not_split_over_cp():
    """debug: 4 heads, 2 key/value heads. tp=2 x cp=4 leaves 2 heads per tp rank for 4 cp
    ranks; 6 key/value heads over cp=4 neither divide nor are divided; 'ring' is not built."""
    heads = "cp.variant='heads'"
    assert _problems(4, "parallelism.cp=4", heads) == []  # 1 head each; kv heads repeated
    (split,) = _problems(8, "parallelism.tp=2", "parallelism.cp=4", heads)
    assert split.startswith("cp.variant='heads' with parallelism.tp=2: 2 attention heads per tp")
    assert split.endswith("use cp.variant='allgather'")
    (kv,) = _problems(
        4, "parallelism.cp=4", heads, "model.n_heads=12", "model.n_kv_heads=6", "model.dim=96"
    )
    assert "6 key/value heads per tp rank and parallelism.cp=4: neither divides" in kv
    assert _problems(8, "parallelism.tp=2", "parallelism.cp=4") == []  # allgather: any heads
    for word, message in (
        ("ring", "cp.variant='ring' is not built in forge: use 'heads'"),
        ("head", "did you mean 'heads'"),
    ):
        with pytest.raises(ForgeConfigError, match=message):
            load_config(None, (f"cp.variant='{word}'",))

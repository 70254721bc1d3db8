"""Pipeline parallelism equals the single-device model: loss AND gradient norm, fp32, 10 steps.

Every schedule torch provides, composed with TP, FSDP2, expert parallelism and AC; the MoE
auxiliary loss made on a stage before the last; what each rank holds after the split.
"""

from __future__ import annotations

import pytest
from test_pp_units import OLD_TORCH

from tests.integration.pp.jobs import pipeline_parity, rank_model_facts, vlm_pipeline_parity

PP2 = {"pp": 2, "data": "none"}

#: forge-pp refuses the V-placed schedules on torch < 2.15 (their stage set-up fails on gloo
#: there); packages/forge-pp/tests/test_pp_units.py checks that refusal on those releases.
V_NEEDS_NEW_TORCH = pytest.mark.skipif(
    OLD_TORCH, reason="V schedules are refused on torch < 2.15 (forge_pp.checks)"
)


@pytest.mark.parametrize(
    "pp",
    [
        {"schedule": "GPipe"},
        {"schedule": "1F1B", "microbatches": 4},
        {"schedule": "Interleaved1F1B", "stages_per_rank": 2},
        {"schedule": "InterleavedZeroBubble", "stages_per_rank": 2},
        pytest.param({"schedule": "ZBVZeroBubble"}, marks=V_NEEDS_NEW_TORCH),
        pytest.param({"schedule": "DualPipeV"}, marks=V_NEEDS_NEW_TORCH),
    ],
    ids=lambda pp: pp["schedule"],
)
def test_each_schedule_matches_one_device(run_on_ranks, pp):
    for result in run_on_ranks(2, pipeline_parity, PP2, pp=pp):
        result.assert_ok()


@pytest.mark.parametrize(
    ("world", "layout", "kwargs"),
    [
        (4, {"pp": 2, "tp": 2, "data": "none"}, {}),
        (4, {"pp": 2, "dp_shard": 2}, {}),
        (4, {"pp": 2, "dp_shard": 2, "ep": 2}, {"moe": True}),
        (2, PP2, {"ac_mode": "full"}),
        (4, {"pp": 2, "dp_shard": 2}, {"pp": {"schedule": "Interleaved1F1B"}, "ac_mode": "full"}),
    ],
    ids=["pp2xtp2", "pp2xfsdp2", "pp2xep2-moe", "pp2-ac-full", "pp2xfsdp2-interleaved-ac"],
)
def test_pipeline_composes_with_the_other_stages(run_on_ranks, world, layout, kwargs):
    for result in run_on_ranks(world, pipeline_parity, layout, **kwargs):
        result.assert_ok()


def test_an_auxiliary_loss_on_an_early_stage_reaches_its_router(run_on_ranks):
    """MoE balancing loss on every block (both stages): its gradient rides on the stage output.

    The schedule's 4 micro-batches are compared with the single-device model accumulating the
    same 4 micro-batches (the balancing loss is a mean over micro-batches, not over the batch).
    """
    results = run_on_ranks(
        2,
        pipeline_parity,
        PP2,
        pp={"schedule": "1F1B", "microbatches": 4},
        moe=True,
        model={"moe_aux_loss_coef": 0.1, "moe_every": 1},
        reference_grad_accum=4,
        steps=4,
    )
    for result in results:
        result.assert_ok()


def test_a_rank_holds_its_blocks_under_their_unsplit_names(run_on_ranks):
    """4 blocks, pp=2, 1F1B: rank 0 has the embedding and blocks 0-1, rank 1 blocks 2-3 and the
    head; names are the unsplit model's, together exactly its state dict; calling a rank model
    is refused with the way to train it."""
    first, last = run_on_ranks(2, rank_model_facts, PP2, {"schedule": "1F1B"})
    assert first["blocks"] == ["0", "1"] and last["blocks"] == ["2", "3"]
    assert "tok_embeddings.weight" in first["names"] and "output.weight" in last["names"]
    assert "output.weight" not in first["names"] and "tok_embeddings.weight" not in last["names"]
    assert not set(first["names"]) & set(last["names"])
    every = {f"layers.{i}.attention.wq.weight" for i in range(4)}
    assert every <= set(first["names"]) | set(last["names"])
    for facts in (first, last):
        assert facts["stages"][0] == "pp"
        assert "forward_backward" in facts["call"] and facts["call"].startswith("ForgeConfigError")
        assert not facts["meta"]


@V_NEEDS_NEW_TORCH
def test_a_v_schedule_puts_the_first_and_last_stage_on_rank_0(run_on_ranks):
    first, last = run_on_ranks(2, rank_model_facts, PP2, {"schedule": "ZBVZeroBubble"})
    assert first["blocks"] == ["0", "3"] and last["blocks"] == ["1", "2"]
    assert "tok_embeddings.weight" in first["names"] and "output.weight" in first["names"]


@pytest.mark.parametrize(
    ("world", "layout", "plan"),
    [(2, PP2, {}), (4, {"pp": 2, "dp_shard": 2}, {"ac_mode": "full"})],
    ids=["pp2", "pp2xfsdp2-ac-full"],
)
def test_a_vision_language_model_pipelines_its_decoder(run_on_ranks, world, layout, plan):
    """Encoder and adapter run on the first stage with the decoder's first blocks."""
    for result in run_on_ranks(world, vlm_pipeline_parity, layout, pp={"schedule": "1F1B"}, **plan):
        result.assert_ok()

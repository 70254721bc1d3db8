"""forge_pp's pure parts: the split, stage placement, the settings and their checks, the bubble."""

from __future__ import annotations

import pytest
import torch
from forge_core import ForgeConfigError
from forge_pp import (
    SCHEDULES,
    PPConfig,
    balanced_blocks,
    bubble_fraction,
    pp_problems,
    schedule_problems,
    stage_indices,
)

#: torch releases whose V-placed schedules forge-pp refuses (see forge_pp.checks).
OLD_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 15)


def _weights(ranges: list[range], n_stages: int) -> list[int]:
    return [len(r) + (s == 0) + (s == n_stages - 1) for s, r in enumerate(ranges)]


@pytest.mark.parametrize(("blocks", "stages"), [(2, 2), (4, 4), (8, 2), (8, 4), (7, 3), (32, 8)])
def test_balanced_blocks_cover_every_block_once_and_balance_the_weight(blocks, stages):
    ranges = balanced_blocks(blocks, stages)
    assert [i for r in ranges for i in r] == list(range(blocks))
    assert all(len(r) >= 1 for r in ranges)
    weights = _weights(ranges, stages)
    assert max(weights) == max(-(-(blocks + 2) // stages), 2 if stages > 1 else 3)


def test_balanced_blocks_count_the_embedding_and_head_as_a_block_each():
    assert balanced_blocks(8, 4) == [range(0, 2), range(2, 5), range(5, 7), range(7, 8)]
    assert balanced_blocks(6, 2) == [range(0, 3), range(3, 6)]


def test_split_points_place_the_stage_starts():
    assert balanced_blocks(8, 3, (2, 5)) == [range(0, 2), range(2, 5), range(5, 8)]
    with pytest.raises(ForgeConfigError, match="increasing"):
        balanced_blocks(8, 3, (5, 2))
    with pytest.raises(ForgeConfigError, match="every stage needs a block"):
        balanced_blocks(2, 3)


def test_stage_placement_loop_and_v():
    assert stage_indices(0, 2, 2, "loop") == [0, 2] and stage_indices(1, 2, 2, "loop") == [1, 3]
    assert stage_indices(0, 4, 2, "v") == [0, 7] and stage_indices(3, 4, 2, "v") == [3, 4]
    assert stage_indices(1, 4, 1, "loop") == [1]


def test_schedule_names_are_case_insensitive_and_misspellings_are_named():
    assert PPConfig(schedule="interleaved1f1b").schedule == "Interleaved1F1B"
    with pytest.raises(ForgeConfigError, match=r"pp.schedule='1F1BB'.*did you mean '1F1B'"):
        PPConfig(schedule="1F1BB")
    assert PPConfig(schedule="ZBVZeroBubble").local_stages() == 2
    assert PPConfig().num_microbatches(4) == 4


def test_the_installed_torch_has_every_schedule_forge_names():
    assert schedule_problems(PPConfig()) == []
    assert set(SCHEDULES) >= {"GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"}
    for name, info in SCHEDULES.items():
        problems = schedule_problems(PPConfig(schedule=name))
        if info.placement == "v" and OLD_TORCH:
            (msg,) = problems  # refused by name, with what to use instead
            assert "needs torch >= 2.15" in msg and "Interleaved1F1B" in msg, msg
        else:
            assert problems == [], name


def _problems(cfg: PPConfig, **kw) -> list[str]:
    args = {"pp": 2, "n_layers": 4, "batch_per_rank": 8} | kw
    return pp_problems(cfg, **args)


def test_every_bad_pipeline_setting_is_named_with_its_fix():
    assert _problems(PPConfig()) == []
    assert _problems(PPConfig(), pp=1, n_layers=1) == []  # no pipeline: nothing to check
    (msg,) = _problems(PPConfig(), pp=8, batch_per_rank=8)
    assert "8 stages, but the model has 4 blocks" in msg
    (msg,) = _problems(PPConfig(schedule="1F1B", microbatches=1))
    assert "at least one micro-batch per pipeline rank; set pp.microbatches >= 2" in msg
    (msg,) = _problems(PPConfig(microbatches=3))
    assert "pp.microbatches=3 does not divide the 8 samples" in msg and "[1, 2, 4, 8]" in msg
    (msg,) = _problems(PPConfig(schedule="Interleaved1F1B", stages_per_rank=1))
    assert "set stages_per_rank >= 2" in msg
    (msg,) = _problems(PPConfig(schedule="GPipe", stages_per_rank=2))
    assert "set stages_per_rank=1" in msg
    (msg,) = _problems(
        PPConfig(schedule="DualPipeV", stages_per_rank=3), n_layers=8, batch_per_rank=6
    )
    assert "exactly two stages per rank" in msg
    (msg,) = _problems(PPConfig(schedule="DualPipeV", microbatches=2))
    assert "at least one micro-batch per stage; set pp.microbatches >= 4" in msg
    (msg,) = _problems(
        PPConfig(schedule="Interleaved1F1B", microbatches=9), pp=4, n_layers=8, batch_per_rank=9
    )
    assert "not a multiple of 2" in msg and "use a multiple of 4, or fewer than 8" in msg
    assert (
        _problems(
            PPConfig(schedule="Interleaved1F1B", microbatches=6), pp=4, n_layers=8, batch_per_rank=6
        )
        == []
    )
    (msg,) = _problems(PPConfig(split_points=(3, 1)))
    assert "pp.split_points=[3, 1] must be 1 increasing block indices" in msg
    (msg,) = _problems(PPConfig(), grad_accum=2)
    assert "training.grad_accum=2" in msg and "pp.microbatches" in msg
    (msg,) = _problems(PPConfig(), tie_embeddings=True)
    assert "model.tie_embeddings=true" in msg


def test_bubble_fractions():
    assert bubble_fraction("1F1B", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("GPipe", 1, 8) == 0.0
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, 2) < bubble_fraction("Interleaved1F1B", 4, 8, 2)
    with pytest.raises(KeyError):
        bubble_fraction("Nope", 2, 2)


def test_hugging_face_configs_forge_pp_does_not_cut_are_named_with_the_fix():
    from forge_pp import hf_pp_problems

    llama = {"model_type": "llama", "tie_word_embeddings": False}
    assert hf_pp_problems(llama, 2) == [] and hf_pp_problems({"model_type": "gpt2"}, 1) == []
    (family,) = hf_pp_problems({"model_type": "gemma3_text"}, 2, model="Gemma3ForCausalLM")
    assert family.startswith("Hugging Face 'gemma3_text' model (Gemma3ForCausalLM) at")
    assert family.endswith("set parallelism.pp=1")
    qwen3 = {"model_type": "qwen3", "sliding_window": 8, "use_sliding_window": True}
    assert hf_pp_problems({**qwen3, "layer_types": ["full_attention"] * 2}, 2) == []
    refused = [
        {**llama, "tie_word_embeddings": True},
        {**qwen3, "layer_types": ["full_attention", "sliding_attention"]},
        {"model_type": "qwen3_moe", "sliding_window": 8},
        {"model_type": "qwen3_moe", "output_router_logits": True},
    ]
    for config in refused:
        (said,) = hf_pp_problems(config, 2)
        assert "parallelism.pp=2" in said and "\n" not in said, said

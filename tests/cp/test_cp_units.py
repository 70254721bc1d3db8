"""forge-cp's pieces: the load-balanced layout, the attention kernel against SDPA in float64,
the stage order, and every refusal (pure checks before launch, and on the model)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from forge.checks import config_problems
from forge.config import load_config
from forge.plan import estimate_activations, plan_layout
from forge_core import ForgeConfigError, ModelConfig, ParallelismConfig, Transformer
from forge_cp import (
    apply_context_parallel,
    chunk_order,
    cp_problems,
    gather_sequence,
    sequence_positions,
    shard_sequence,
)

from tests.cp.jobs import (
    attention_errors,
    capacity_refusal,
    cp_on_pipeline_stages,
    order_and_refusals,
    too_long_refusal,
)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_each_rank_keeps_an_early_and_a_late_chunk_and_gathering_restores_the_order(cp):
    x = torch.arange(2 * 12 * cp).reshape(2, 12 * cp)
    parts = [shard_sequence(x, cp, r) for r in range(cp)]
    assert torch.equal(gather_sequence(parts), x)
    assert chunk_order(cp) == [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]
    chunk = 6
    for r, part in enumerate(parts):
        want = [
            *range(r * chunk, (r + 1) * chunk),
            *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk),
        ]
        assert sequence_positions(12 * cp, cp, r).tolist() == want
        assert torch.equal(part, x[:, want])
        # causal work: the (query, key) pairs with key <= query are the same on every rank
        assert sum(p + 1 for p in want) == sum(p + 1 for p in sequence_positions(12 * cp, cp, 0))


def test_a_sequence_that_does_not_split_in_2_cp_chunks_is_refused():
    with pytest.raises(ValueError, match=r"sequence length 10 is not divisible by 2 x cp = 4"):
        shard_sequence(torch.zeros(1, 10), 2, 0)


@pytest.mark.parametrize(("world", "heads"), [(2, (4, 4)), (2, (4, 2)), (4, (4, 1))])
def test_attention_across_shards_equals_sdpa_forward_and_backward(run_on_ranks, world, heads):
    for errors in run_on_ranks(world, attention_errors, world, *heads):
        assert max(errors) < 1e-12, errors  # output, dq, dk, dv


def test_cp_keeps_its_place_in_the_order_and_refuses_what_it_cannot_run(run_on_ranks):
    said = run_on_ranks(2, order_and_refusals)[0]
    assert "cannot apply 'cp' after ['ac']" in said["after_ac"]
    assert "TP -> CP -> EP" in said["after_ac"]
    assert "stage 'cp' was already applied" in said["twice"]
    assert "cannot apply 'tp' after ['cp']" in said["tp_after"]
    assert "Sequential has no attention module forge-cp can run" in said["no_attention"]
    assert "set parallelism.cp=1" in said["no_attention"]
    assert said["hugging_face"].startswith("LlamaForCausalLM has no attention module forge-cp")


def test_a_mesh_without_cp_is_refused():
    with torch.device("meta"):
        model = Transformer(ModelConfig.preset("debug"))
    with pytest.raises(ForgeConfigError, match=r"needs a mesh with a cp axis of size > 1"):
        apply_context_parallel(model, None)  # type: ignore[arg-type]


def test_pure_checks_name_the_field_and_the_choices():
    (seq,) = cp_problems(4, 100)
    assert "training.seq_len=100 is not divisible by 2 x parallelism.cp = 8" in seq
    assert "set training.seq_len=96 or 104" in seq and "parallelism.cp to one of [2, 5," in seq
    assert (
        "pp=2" in cp_problems(2, 64, pp=2)[0] and "set cp=1 or pp=1" in cp_problems(2, 64, pp=2)[0]
    )
    assert "vision-language" in cp_problems(2, 64, model_kind="vlm")[0]
    assert "parallelism.domain" in cp_problems(2, 64, model_kind="field")[0]
    assert cp_problems(1, 7) == [] and cp_problems(2, 64) == []


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
        "model.moe_dispatch='capacity' with parallelism.cp=2: the capacity is counted per "
        "sequence and a context-parallel rank holds only slices of each sequence, so it would "
        "drop other tokens than one device does; set model.moe_dispatch='dropless' (or "
        "parallelism.cp=1)"
    )
    sets = ("parallelism.cp=2", "model.preset=debug_moe", "training.seq_len=64")
    assert _problems(2, *sets, "model.moe_dispatch=capacity") == [line]
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


def test_expert_parallelism_is_carved_out_of_dp_shard_times_cp():
    par = ParallelismConfig(cp=2, ep=2).resolve(2, num_experts=4)
    assert (par.dp_shard, par.cp, par.ep) == (1, 2, 2)
    with pytest.raises(ForgeConfigError, match=r"ep=4 must divide dp_shard=1 x cp=2.*\[1, 2\]"):
        ParallelismConfig(cp=2, ep=4).resolve(2, num_experts=4)


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


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_check runs it)"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_lower_right_causal_bias_equals_the_explicit_mask(dtype):
    # On CUDA the kernel hands SDPA torch's lower-right causal bias (no mask built); elsewhere a
    # strided mask over flipped queries. Both must be the explicit lower-right causal attention,
    # for a front (square) and a back chunk.
    from forge_cp import ContextParallelAttention

    kernel = ContextParallelAttention(None, 0, 2)  # type: ignore[arg-type]  # no collective here
    g = torch.Generator(device="cuda").manual_seed(0)
    chunk = 64
    for end in (chunk, 4 * chunk):
        q = torch.randn(2, 4, chunk, 32, device="cuda", dtype=dtype, generator=g)
        k, v = (torch.randn(2, 2, end, 32, device="cuda", dtype=dtype, generator=g) for _ in "kv")
        fused = kernel.attend_chunk(q, k, v, enable_gqa=True)
        allowed = torch.ones(chunk, end, dtype=torch.bool, device="cuda").tril(end - chunk)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(fused, want, rtol=tol, atol=tol)

"""forge-cp's pieces: the load-balanced layout, the attention kernel against SDPA in float64,
and its refusals (its pure checks, and a mesh without cp); the stage order and the refusals on
models it cannot run (composed with forge-fsdp-wrap's AC) are in
tests/integration/cp/test_cp_order_with_fsdp_wrap.py; forge's checks before launch, ParallelPlan's
refusals and the plan's activation estimate under cp are in
tests/integration/cp/test_cp_checks.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cp_jobs import attention_errors
from forge_core import ForgeConfigError, ModelConfig, ParallelismConfig, Transformer
from forge_cp import (
    apply_context_parallel,
    chunk_order,
    cp_problems,
    gather_sequence,
    sequence_positions,
    shard_sequence,
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


def test_expert_parallelism_is_carved_out_of_dp_shard_times_cp():
    par = ParallelismConfig(cp=2, ep=2).resolve(2, num_experts=4)
    assert (par.dp_shard, par.cp, par.ep) == (1, 2, 2)
    with pytest.raises(ForgeConfigError, match=r"ep=4 must divide dp_shard=1 x cp=2.*\[1, 2\]"):
        ParallelismConfig(cp=2, ep=4).resolve(2, num_experts=4)


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

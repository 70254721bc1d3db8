"""Hugging Face MoE families (tiny configs, random weights) through forge's ParallelPlan: training
parity under EP=2 x FSDP2 and dp2(ep2) x tp2 against the unconverted Hugging Face model on one
device. The conversion itself (forge_moe_ep.hf: equal logits, the way back to a Hugging Face
checkpoint): packages/forge-moe-ep/tests/test_hf_moe.py."""

from __future__ import annotations

import copy

import pytest
import torch
from forge.build import ParallelPlan
from forge_core.testing import run_parity
from forge_mesh import build_device_mesh
from forge_moe_ep.hf import HFMoE
from forge_tp_plans import applied_tp_plan
from test_hf_moe import FAMILIES, VOCAB, build_hf_moe

from tests.parity_jobs import HFLogits

#: What this module's rank functions import inside the function: the rank workers' forkserver
#: imports it once (forge_core.testing.pytest_ranks).
RANK_PRELOAD = ["transformers"]


def _hf_moe_training_parity(layout: dict) -> list[tuple[str, object, tuple]]:
    """Each family: the unconverted model on one device vs forge's ParallelPlan on ``layout``
    (conversion, TP of the attention when tp > 1, EP, FSDP2), 3 AdamW steps."""
    out = []
    for name in FAMILIES:
        reference = build_hf_moe(name)
        parallel = copy.deepcopy(reference)
        mesh = build_device_mesh(layout, "cpu", num_experts=8)
        ParallelPlan(mesh, param_dtype=torch.float32).parallelize(parallel)
        moes = [m for m in parallel.modules() if isinstance(m, HFMoE)]
        assert moes and all(m.experts.w1.to_local().shape[0] < m.num_experts for m in moes)
        applied = applied_tp_plan(parallel)
        result = run_parity(
            HFLogits(reference),
            HFLogits(parallel),
            mesh=mesh,
            steps=3,
            batch_size=4,
            seq_len=12,
            vocab_size=VOCAB,
        )
        left_whole = () if applied is None else applied.left_whole
        plan_names_experts = any(".experts" in p for p in reference._tp_plan or {})
        out.append((name, result, (plan_names_experts, left_whole)))
    return out


# NOTE: marker zoo: the Hugging Face lane (with tests/zoo), not the README suite (its time).
@pytest.mark.zoo
def test_hf_moe_families_train_equal_under_ep2_x_fsdp2(run_on_ranks):
    for rank_results in run_on_ranks(2, _hf_moe_training_parity, {"dp_shard": 2, "ep": 2}):
        for name, result, _ in rank_results:
            assert result.passed, f"{name}\n{result.table()}"


@pytest.mark.zoo
def test_hf_moe_families_train_equal_under_dp2_ep2_x_tp2(run_on_ranks):
    layout = {"dp_shard": 2, "ep": 2, "tp": 2}
    for rank_results in run_on_ranks(4, _hf_moe_training_parity, layout):
        for name, result, (plan_names_experts, left_whole) in rank_results:
            assert result.passed, f"{name}\n{result.table()}"
            # The HF plan's expert entries (where it has them: not GPT-OSS's, nor some of
            # transformers 5.17's) reached the converted blocks and were left whole.
            assert plan_names_experts == any(".experts" in n for n in left_whole), left_whole


def _gpt_oss_attention_split() -> dict[str, object]:
    """GPT-OSS's attention after forge's plan at tp=2 without data parallelism (2 ranks)."""
    from torch.distributed.tensor import DTensor

    model = build_hf_moe("gpt_oss")
    heads = model.config.num_attention_heads
    mesh = build_device_mesh({"tp": 2, "data": "none"}, "cpu")
    ParallelPlan(mesh, param_dtype=torch.float32).parallelize(model)
    attention = model.model.layers[0].self_attn
    sinks, q = attention.sinks, attention.q_proj.weight
    return {
        "heads": heads,
        "sinks": (type(sinks).__name__, tuple(sinks.to_local().shape), str(sinks.placements)),
        "q_rows": q.to_local().shape[0] if isinstance(q, DTensor) else None,
        "q_rows_whole": q.shape[0],
    }


@pytest.mark.zoo
def test_gpt_oss_attention_and_its_sinks_split_over_tp(run_on_ranks):
    # transformers' plan for GPT-OSS splits only lm_head: forge's fix splits the attention by
    # heads and the sinks (one per query head) with them (training parity: the test above, whose
    # families include GPT-OSS at dp2(ep2) x tp2)
    for out in run_on_ranks(2, _gpt_oss_attention_split):
        assert out["sinks"] == ("DTensor", (out["heads"] // 2,), "(Shard(dim=0),)"), out
        assert out["q_rows"] == out["q_rows_whole"] // 2, out

"""Expert tensor parallelism on a Hugging Face MoE model: Qwen3-MoE (tiny, random weights from
forge's seeded init, fp32) at tp=2 with its own ``_tp_plan`` and its MoE blocks converted to
forge's, each tp rank holding half of every expert, equals the same model on one device (loss
and gradient norm over 10 steps): without and with FSDP2, and with the experts split over ep
too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from forge.build import ParallelPlan
from forge_core.testing import compare_runs, train_steps
from forge_core.testing.hf import TINY_HF_DECODER
from forge_core.training import synthetic_tokens
from forge_mesh import build_device_mesh
from torch.distributed.tensor import DTensor

from tests.integration.pp.hf_jobs import EXPERTS, meta_hf

#: What this module's rank functions import inside the function (the rank workers' forkserver
#: imports it once).
RANK_PRELOAD = ["transformers"]

pytestmark = pytest.mark.zoo


def _parity(layouts: list[dict[str, Any]]) -> list[tuple[bool, str, tuple[int, ...]]]:
    tokens = synthetic_tokens(0, 10, 8, 16, TINY_HF_DECODER["vocab_size"])
    reference = ParallelPlan(None, param_dtype=torch.float32).parallelize(
        meta_hf("qwen3_moe"), device="cpu", seed=0
    )
    expected = train_steps(reference, tokens)
    out = []
    for layout in layouts:
        mesh = build_device_mesh(layout, "cpu", num_experts=EXPERTS)
        plan = ParallelPlan(mesh, param_dtype=torch.float32, expert_tp=True)
        model: Any = plan.parallelize(meta_hf("qwen3_moe"), device="cpu", seed=0)
        result = compare_runs(expected, train_steps(model, tokens, mesh=mesh))
        w2 = model.model.layers[0].mlp.experts.w2
        local = w2.to_local() if isinstance(w2, DTensor) else w2
        out.append((result.passed, result.table(), tuple(local.shape)))
    return out


@pytest.mark.parametrize(
    ("world", "layout", "experts_here"),
    [
        (2, {"tp": 2, "data": "none"}, EXPERTS),
        (4, {"dp_shard": 2, "tp": 2}, EXPERTS // 2),
        (4, {"dp_shard": 2, "ep": 2, "tp": 2}, EXPERTS // 2),
    ],
    ids=["tp2", "dp_shard2-tp2", "dp_shard2-ep2-tp2"],
)
def test_qwen3_moe_experts_split_over_tp_match_one_device(
    run_on_ranks, world, layout, experts_here
):
    for ((passed, table, shape),) in run_on_ranks(world, _parity, [layout]):
        assert passed, table
        assert shape[:2] == (experts_here, 8), shape  # [E (/ FSDP2 or ep), hidden 16 / tp, dim]

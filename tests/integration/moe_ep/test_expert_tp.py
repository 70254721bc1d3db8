"""Expert tensor parallelism (``ParallelPlan(expert_tp=True)``): each expert's hidden units split
over tp equals the single-device MoE model (fp32, loss + grad norm over 10 steps), each tp rank
holding half of every expert, with and without expert parallelism; what does not fit is refused
in one line before launch."""

from __future__ import annotations

import pytest
import torch
from forge.build import ParallelPlan, build_parallel_model
from forge_core.testing import run_parity
from forge_mesh import build_device_mesh
from forge_moe_ep import moe_transformer
from forge_moe_ep.config import MoEModelConfig
from torch.distributed.tensor import DTensor


def _expert_tp_model(layout: dict, **fields: object) -> tuple[object, torch.nn.Module]:
    cfg = MoEModelConfig.preset("debug_moe", **fields)
    mesh = build_device_mesh(layout, "cpu", num_experts=cfg.num_experts)
    plan = ParallelPlan(mesh, param_dtype=torch.float32, expert_tp=True)
    with torch.device("meta"):
        model = moe_transformer(cfg)
    return mesh, plan.parallelize(model, device="cpu", seed=0)


def _parity(layouts: list[tuple[dict, dict]]) -> list[tuple[bool, str, tuple[int, ...]]]:
    """Each ``(layout, model fields)``: (passed, table, this rank's local w1 shape)."""
    out = []
    for layout, fields in layouts:
        mesh, parallel = _expert_tp_model(layout, **fields)
        cfg = MoEModelConfig.preset("debug_moe", **fields)
        reference = build_parallel_model(cfg, "cpu", None, param_dtype=torch.float32)
        result = run_parity(reference, parallel, mesh=mesh, steps=10, batch_size=8, seq_len=16)
        w1 = parallel.get_submodule("layers.0.feed_forward.experts").w1
        local = w1.to_local() if isinstance(w1, DTensor) else w1
        out.append((result.passed, result.table(), tuple(local.shape)))
    return out


def test_experts_split_over_tp_match_one_device(run_on_ranks):
    """tp=2 (with sequence parallelism, forge's default) and tp=2 under the capacity dispatch:
    every rank holds experts of hidden 64 / 2."""
    layouts = [
        ({"tp": 2, "data": "none"}, {}),
        ({"tp": 2, "data": "none"}, {"moe_dispatch": "capacity"}),
    ]
    for rank in run_on_ranks(2, _parity, layouts):
        for passed, table, shape in rank:
            assert passed, table
            assert shape == (8, 64, 32), shape  # [E, dim, hidden / tp]


def test_experts_split_over_tp_with_fsdp2_match_one_device(run_on_ranks):
    for rank in run_on_ranks(4, _parity, [({"dp_shard": 2, "tp": 2}, {})]):
        for passed, table, shape in rank:
            assert passed, table
            assert shape == (4, 64, 32), shape  # experts over dp_shard (FSDP2), hidden over tp


def test_experts_split_over_ep_and_tp_match_one_device(run_on_ranks):
    """dp_shard=2 (ep=2 carved out of it) x tp=2: each rank holds 4 of the 8 experts, half of
    each one's hidden units (the (ep, tp) mesh), FSDP2 over what is left (nothing here)."""
    for rank in run_on_ranks(4, _parity, [({"dp_shard": 2, "ep": 2, "tp": 2}, {})]):
        for passed, table, shape in rank:
            assert passed, table
            assert shape == (4, 64, 32), shape


def _config_problems(*sets: str, world_size: int = 4) -> list[str]:
    from forge.checks import config_problems
    from forge.config import load_config

    base = ["model.preset=debug_moe", "parallelism.expert_tp=true", "parallelism.tp=2"]
    return config_problems(load_config(None, [*base, *sets]), world_size)


def test_expert_tp_is_checked_before_launch():
    assert _config_problems("parallelism.ep=1") == []
    assert _config_problems("parallelism.ep=2") == []
    (odd,) = _config_problems("parallelism.ep=1", "moe.moe_ffn_dim=63")
    assert "hidden size 63 is not divisible by tp=2" in odd, odd
    (with_cp,) = _config_problems("parallelism.ep=2", "parallelism.cp=2", world_size=8)
    assert with_cp.startswith("parallelism.expert_tp with ep=2 and cp=2"), with_cp
    assert "\n" not in with_cp


def _train(run_on_ranks, out, parallelism: dict, resume) -> dict[int, tuple[float, float]]:
    from forge.train import run_train

    cfg = {
        "model": {"preset": "debug_moe"},
        "parallelism": parallelism,
        "training": {"global_batch_size": 8, "seq_len": 16, "steps": 3, "out_dir": str(out)},
        "checkpoint": {"every": 1, "keep": 5, "save_at_end": False, "resume": str(resume)},
    }
    summary = run_on_ranks(4, run_train, cfg, "cpu")[0]
    return {s.step: (s.loss, s.grad_norm) for s in summary.steps}


@pytest.mark.heavy  # NOTE: two 4-rank forge train runs; kept out of the README suite's 10 minutes
def test_a_checkpoint_of_experts_split_over_ep_and_tp_resumes_whole(run_on_ranks, tmp_path):
    """forge train at dp_shard=2 x ep=2 x tp=2 with expert_tp: its step-1 checkpoint resumes at
    dp_shard=4 with whole experts (tp=1) and continues the uninterrupted run."""
    split = {"dp_shard": 2, "ep": 2, "tp": 2, "expert_tp": True}
    full = _train(run_on_ranks, tmp_path / "split", split, "none")
    ckpt = tmp_path / "split" / "checkpoints" / "step-00000001"
    resumed = _train(run_on_ranks, tmp_path / "whole", {"dp_shard": 4, "tp": 1}, ckpt)
    assert sorted(resumed) == [2, 3], resumed
    for step, (loss, gnorm) in resumed.items():
        assert abs(loss - full[step][0]) <= 1e-4 * full[step][0], (step, loss, full[step])
        assert abs(gnorm - full[step][1]) <= 1e-4 * full[step][1], (step, gnorm, full[step])

"""Expert tensor parallelism (``ParallelPlan(expert_tp=True)``): each expert's hidden units split
over tp equals the single-device MoE model (fp32, loss + grad norm over 10 steps), each tp rank
holding half of every expert; a checkpoint of it reads back on one device; what is not built yet
is refused in one line."""

from __future__ import annotations

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


def _refused(layout: dict, fields: dict) -> str:
    from forge_core.errors import ForgeConfigError

    try:
        _expert_tp_model(layout, **fields)
    except ForgeConfigError as err:
        return str(err)
    return ""


def test_what_expert_tp_does_not_do_yet_is_refused_in_one_line(run_on_ranks):
    said = run_on_ranks(4, _refused, {"dp_shard": 2, "ep": 2, "tp": 2}, {})
    assert all(s == said[0] for s in said)
    assert said[0].startswith("parallelism.expert_tp with ep=2"), said[0]
    assert "\n" not in said[0]


def _config_problems(*sets: str) -> list[str]:
    from forge.checks import config_problems
    from forge.config import load_config

    base = ["model.preset=debug_moe", "parallelism.expert_tp=true", "parallelism.tp=2"]
    return config_problems(load_config(None, [*base, *sets]), 4)


def test_expert_tp_is_checked_before_launch():
    assert _config_problems("parallelism.ep=1") == []
    (with_ep,) = _config_problems("parallelism.ep=2")
    assert with_ep.startswith("parallelism.expert_tp with ep=2"), with_ep
    (odd,) = _config_problems("parallelism.ep=1", "moe.moe_ffn_dim=63")
    assert "hidden size 63 is not divisible by tp=2" in odd, odd

"""forge_core's parity harness (packages/forge-core/tests/test_harness.py) on a model that forge's
ParallelPlan built: parity holds after an evaluation forward left an FSDP2 unit gathered."""

from __future__ import annotations

import torch


def _parity_after_an_evaluation_forward() -> bool:
    from forge.build import ParallelPlan, build_parallel_model
    from forge_core import ModelConfig, Transformer
    from forge_core.testing import run_parity
    from forge_mesh import build_device_mesh

    cfg = ModelConfig.preset("debug")
    mesh = build_device_mesh({"dp_shard": 2}, "cpu")
    with torch.device("meta"):
        model = Transformer(cfg)
    parallel = ParallelPlan(mesh, param_dtype=torch.float32).parallelize(
        model, device="cpu", seed=0
    )
    with torch.no_grad():  # leaves the last FSDP2 block gathered (no reshard after forward)
        parallel(torch.zeros(2, 8, dtype=torch.long))
    reference = build_parallel_model(cfg, "cpu", None, param_dtype=torch.float32)
    return run_parity(reference, parallel, mesh=mesh, steps=2, batch_size=4, seq_len=8).passed


def test_parity_holds_when_an_evaluation_forward_left_a_unit_gathered(run_on_ranks):
    # Without train_steps' reshard the optimizer would hold the gathered copies of the last
    # block's parameters and step them instead of the shards (grad norm off by a few %).
    assert run_on_ranks(2, _parity_after_an_evaluation_forward) == [True, True]

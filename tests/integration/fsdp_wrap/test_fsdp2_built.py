"""FSDP2 / DDP wrapping of models built by forge's build_parallel_model: sharded init, units,
no-sync accumulation, unshard, bf16 autocast, replicate-only (forge_fsdp_wrap alone:
packages/forge-fsdp-wrap/tests/test_fsdp2.py)."""

from __future__ import annotations

import pytest
import torch
from forge.build import build_parallel_model
from forge_core import ForgeConfigError, ModelConfig, applied_stages
from forge_core.testing import run_parity
from forge_core.training import set_gradient_sync
from forge_fsdp_wrap import unshard_fsdp2_model
from forge_mesh import build_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

CFG = ModelConfig.preset("debug")


def _sharded_init_is_bitwise_equal(layout: dict) -> bool:
    mesh = build_device_mesh(layout, "cpu")
    sharded = build_parallel_model(CFG, "cpu", mesh, param_dtype=torch.float32, seed=3)
    full = build_parallel_model(CFG, "cpu", None, param_dtype=torch.float32, seed=3)
    pairs = zip(sharded.named_parameters(), full.named_parameters(), strict=True)
    return all(
        isinstance(a, DTensor) and torch.equal(a.full_tensor(), b) for (_, a), (_, b) in pairs
    )


@pytest.mark.parametrize("layout", [{}, {"dp_replicate": 2}])
def test_sharded_init_is_bitwise_equal_to_the_full_model(run_on_ranks, layout):
    assert all(run_on_ranks(4, _sharded_init_is_bitwise_equal, layout))


def _units_and_last_block() -> dict:
    mesh = build_device_mesh({}, "cpu")
    model = build_parallel_model(CFG, "cpu", mesh, param_dtype=torch.float32)
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    model(torch.randint(0, CFG.vocab_size, (2, 8)))
    # After forward: resharded blocks hold DTensor shards again, the last block keeps full params.
    return {
        "units": units,
        "first_block_resharded": isinstance(model.layers["0"].attention.wq.weight, DTensor),
        "last_block_resharded": isinstance(model.layers["1"].attention.wq.weight, DTensor),
        "stages": applied_stages(model),
    }


def test_each_block_is_a_unit_and_the_last_block_stays_gathered(run_on_ranks):
    out = run_on_ranks(4, _units_and_last_block)[0]
    assert out["units"] == ["", "layers.0", "layers.1"]
    assert out["first_block_resharded"] and not out["last_block_resharded"]
    assert out["stages"] == ["fsdp2"]


def _grads_after_micro_batches() -> tuple[bool, bool]:
    mesh = build_device_mesh({}, "cpu")
    model = build_parallel_model(CFG, "cpu", mesh, param_dtype=torch.float32)
    tokens = torch.randint(0, CFG.vocab_size, (2, 9))
    set_gradient_sync(model, False)
    model(tokens[:, :-1]).sum().backward()
    none_before_sync = all(p.grad is None for p in model.parameters())
    set_gradient_sync(model, True)
    model(tokens[:, :-1]).sum().backward()
    all_after_sync = all(isinstance(p.grad, DTensor) for p in model.parameters())
    return none_before_sync, all_after_sync


def test_no_gradient_sync_until_the_last_micro_batch(run_on_ranks):
    assert all(r == (True, True) for r in run_on_ranks(4, _grads_after_micro_batches))


def _unshard_roundtrip() -> dict:
    mesh = build_device_mesh({}, "cpu")
    model = build_parallel_model(CFG, "cpu", mesh, param_dtype=torch.float32)
    w = lambda: model.output.weight  # noqa: E731
    out = {"before": isinstance(w(), DTensor)}
    with unshard_fsdp2_model(model):
        out["inside_shape"] = tuple(w().shape)
        out["inside_plain"] = not isinstance(w(), DTensor)
    out["after"] = isinstance(w(), DTensor)
    try:
        with unshard_fsdp2_model(model):
            raise RuntimeError("user error")
    except RuntimeError:
        pass
    out["after_error"] = isinstance(w(), DTensor)
    return out


def test_unshard_context_gathers_full_params_and_reshards_even_on_error(run_on_ranks):
    out = run_on_ranks(4, _unshard_roundtrip)[0]
    assert out == {
        "before": True,
        "inside_shape": (CFG.vocab_size, CFG.dim),
        "inside_plain": True,
        "after": True,
        "after_error": True,
    }


def _ddp_bf16_autocast_parity():
    cfg = CFG
    mesh = build_device_mesh({"data": "ddp"}, "cpu")
    parallel = build_parallel_model(cfg, "cpu", mesh, data="ddp", param_dtype=torch.bfloat16)
    reference = build_parallel_model(cfg, "cpu", None, param_dtype=torch.float32)
    dtypes = {p.dtype for p in parallel.parameters()}
    logits_dtype = parallel(torch.zeros(1, 4, dtype=torch.long)).dtype
    return (
        run_parity(reference, parallel, mesh=mesh, steps=3, dtype=torch.bfloat16),
        dtypes,
        logits_dtype,
    )


def test_ddp_with_bf16_autocast_keeps_fp32_params_and_matches_within_bf16_tolerance(run_on_ranks):
    result, dtypes, logits_dtype = run_on_ranks(4, _ddp_bf16_autocast_parity)[0]
    assert dtypes == {torch.float32} and logits_dtype == torch.bfloat16
    result.assert_ok()
    assert max(result.loss_errors) > 1e-6  # bf16 compute really happened


def test_single_device_default_build_computes_in_bf16_with_fp32_params():
    model = build_parallel_model(CFG, "cpu", None)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model(torch.zeros(1, 4, dtype=torch.long)).dtype == torch.bfloat16
    with pytest.raises(ForgeConfigError, match="autocast is already enabled"):
        from forge_fsdp_wrap import enable_autocast

        enable_autocast(model, torch.bfloat16)


def _replicate_only_bytes() -> tuple[tuple, float]:
    mesh = build_device_mesh({"dp_replicate": 4}, "cpu")
    model = build_parallel_model(CFG, "cpu", mesh, param_dtype=torch.float32)
    local = sum(p.to_local().numel() for p in model.parameters())
    return mesh.mesh_dim_names, local / CFG.num_params()


def test_dp_replicate_alone_replicates_instead_of_sharding(run_on_ranks):
    names, fraction = run_on_ranks(4, _replicate_only_bytes)[0]
    assert names == ("dp_replicate", "dp_shard") and fraction == 1.0

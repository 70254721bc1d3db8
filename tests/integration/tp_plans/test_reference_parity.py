"""The reference Transformer under TP / SP / loss-parallel / FSDP2xTP / HSDPxTP / AC / compile
matches the single-device model in loss and gradient norm over 10 fp32 steps."""

from __future__ import annotations

import pytest
import torch
from forge.build import build_parallel_model
from forge_core import ModelConfig
from forge_core.testing import ParityResult, run_parity
from forge_mesh import build_device_mesh
from forge_tp_plans import applied_tp_plan
from torch.distributed.tensor import DTensor

from tests.integration.parity_jobs import compiled_parity

KV4 = {"n_kv_heads": 4}  # debug has 2 kv heads; tp=4 needs 4


def _parity(
    layout: dict,
    preset: str = "debug",
    model_overrides: dict | None = None,
    steps: int = 10,
    **plan: object,
) -> tuple[ParityResult, dict]:
    cfg = ModelConfig.preset(preset, **(model_overrides or {}))
    mesh = build_device_mesh(layout, "cpu")
    parallel = build_parallel_model(cfg, "cpu", mesh, param_dtype=torch.float32, **plan)
    reference = build_parallel_model(cfg, "cpu", None, param_dtype=torch.float32)
    applied = applied_tp_plan(parallel)
    info = {"sp": applied.sequence_parallel, "styles": applied.styles, "source": applied.source}
    return run_parity(reference, parallel, mesh=mesh, steps=steps, batch_size=8, seq_len=16), info


def _check(results: list) -> dict:
    for result, _ in results:
        result.assert_ok()
    assert results[0][0].reference[-1].loss < results[0][0].reference[0].loss
    return results[0][1]


def test_tp2_with_sequence_parallel_matches_single_device(run_on_ranks):
    info = _check(run_on_ranks(2, _parity, {"tp": 2, "data": "none"}))
    assert info["sp"] and info["source"] == "registered"
    assert info["styles"]["layers.0.attention_norm"] == "SequenceParallel"


def test_tp2_without_sequence_parallel_matches_single_device(run_on_ranks):
    info = _check(run_on_ranks(2, _parity, {"tp": 2, "data": "none"}, sequence_parallel=False))
    assert not info["sp"] and "layers.0.attention_norm" not in info["styles"]


def test_tp4_matches_single_device(run_on_ranks):
    _check(run_on_ranks(4, _parity, {"tp": 4, "data": "none"}, model_overrides=KV4))


def test_tp2_loss_parallel_matches_single_device(run_on_ranks):
    info = _check(run_on_ranks(2, _parity, {"tp": 2, "data": "none"}, loss_parallel=True))
    assert info["styles"]["output"] == "ColwiseParallel(in S(1) -> out S(-1))"


def test_fsdp2_x_tp_2x2_matches_single_device(run_on_ranks):
    _check(run_on_ranks(4, _parity, {"tp": 2}))


# NOTE: the heavy lane (marker heavy, run by .ci/run in both venvs): among the suite's slowest.
@pytest.mark.heavy
def test_hsdp_x_tp_2x2x2_matches_single_device(run_on_ranks):
    _check(run_on_ranks(8, _parity, {"dp_replicate": 2, "tp": 2}, steps=4))


def test_tp_with_tied_embeddings_turns_sp_off_and_matches(run_on_ranks):
    info = _check(run_on_ranks(4, _parity, {"tp": 2}, preset="debug_tied"))
    assert not info["sp"]
    assert info["styles"]["tok_embeddings"].startswith("RowwiseParallel")


def test_tp_with_tied_embeddings_and_explicit_sp_matches(run_on_ranks):
    info = _check(run_on_ranks(4, _parity, {"tp": 2}, preset="debug_tied", sequence_parallel=True))
    assert info["sp"]


# NOTE: full and selective AC in the heavy lane (the README suite's 10 minutes); op AC, the one
# that caches matmuls across the TP collectives, stays in the suite
@pytest.mark.parametrize(
    "ac_mode",
    [
        pytest.param("full", marks=pytest.mark.heavy),
        pytest.param("selective", marks=pytest.mark.heavy),
        "op",
    ],
)
def test_fsdp2_x_tp_with_ac_matches_single_device(run_on_ranks, ac_mode):
    _check(run_on_ranks(4, _parity, {"tp": 2}, ac_mode=ac_mode))


# NOTE: the heavy lane (marker heavy, run by .ci/run in both venvs): among the suite's slowest.
@pytest.mark.heavy
def test_fsdp2_x_tp_with_ac_and_compile_aot_eager_matches_single_device(run_on_ranks):
    """torch.compile with the aot_eager backend (inductor on 2 CPU cores would dominate the suite)."""
    for result in run_on_ranks(4, compiled_parity, {"tp": 2}):
        result.assert_ok()


def _init_bitwise(layout: dict) -> bool:
    cfg = ModelConfig.preset("debug")
    mesh = build_device_mesh(layout, "cpu")
    sharded = build_parallel_model(cfg, "cpu", mesh, param_dtype=torch.float32, seed=5)
    full = build_parallel_model(cfg, "cpu", None, param_dtype=torch.float32, seed=5)
    pairs = zip(sharded.named_parameters(), full.named_parameters(), strict=True)
    return all(
        torch.equal(a.full_tensor() if isinstance(a, DTensor) else a, b) for (_, a), (_, b) in pairs
    )


@pytest.mark.parametrize("layout", [{"tp": 2, "data": "none"}, {"tp": 2}])
def test_tp_and_fsdp_x_tp_init_is_bitwise_equal_to_the_full_model(run_on_ranks, layout):
    assert all(run_on_ranks(4 if "data" not in layout else 2, _init_bitwise, layout))

"""FSDP2, HSDP, DDP, AC, CPU offload, gradient accumulation, tied embeddings: each equals the
single-device model in loss and gradient norm over 10 fp32 steps on 4 CPU ranks."""

from __future__ import annotations

import pytest
import torch
from forge.build import build_parallel_model
from forge_core import ModelConfig
from forge_core.testing import ParityResult, run_parity
from forge_mesh import build_device_mesh

from tests.integration.parity_jobs import compiled_parity


def _parity(
    layout: dict, preset: str = "debug", grad_accum: int = 1, **plan: object
) -> ParityResult:
    cfg = ModelConfig.preset(preset)
    mesh = build_device_mesh(layout, "cpu")
    parallel = build_parallel_model(cfg, "cpu", mesh, param_dtype=torch.float32, **plan)
    reference = build_parallel_model(cfg, "cpu", None, param_dtype=torch.float32)
    return run_parity(
        reference, parallel, mesh=mesh, steps=10, batch_size=8, seq_len=16, grad_accum=grad_accum
    )


def _assert_all_ranks_pass(results: list[ParityResult]) -> None:
    for r in results:
        r.assert_ok()
    assert results[0].reference[-1].loss < results[0].reference[0].loss  # the model is learning


def test_fsdp2_dp_shard_4_matches_single_device_loss_and_grad_norm(run_on_ranks):
    _assert_all_ranks_pass(run_on_ranks(4, _parity, {"dp_shard": 4}))


def test_hsdp_2x2_matches_single_device_loss_and_grad_norm(run_on_ranks):
    _assert_all_ranks_pass(run_on_ranks(4, _parity, {"dp_replicate": 2, "dp_shard": 2}))


def test_ddp_4_matches_single_device_loss_and_grad_norm(run_on_ranks):
    _assert_all_ranks_pass(run_on_ranks(4, _parity, {"data": "ddp"}, data="ddp"))


@pytest.mark.parametrize("ac_mode", ["full", "selective", "op"])
def test_fsdp2_with_ac_matches_single_device_loss_and_grad_norm(run_on_ranks, ac_mode):
    _assert_all_ranks_pass(run_on_ranks(4, _parity, {}, ac_mode=ac_mode))


def test_fsdp2_cpu_offload_matches_single_device_loss_and_grad_norm(run_on_ranks):
    _assert_all_ranks_pass(run_on_ranks(4, _parity, {}, cpu_offload=True))


def test_fsdp2_gradient_accumulation_matches_single_device_loss_and_grad_norm(run_on_ranks):
    _assert_all_ranks_pass(run_on_ranks(4, _parity, {}, grad_accum=2))


def test_fsdp2_tied_embeddings_match_single_device_loss_and_grad_norm(run_on_ranks):
    _assert_all_ranks_pass(run_on_ranks(4, _parity, {}, preset="debug_tied"))


def test_fsdp2_reshard_to_a_smaller_group_matches_single_device(run_on_ranks):
    _assert_all_ranks_pass(run_on_ranks(4, _parity, {}, reshard_after_forward=2))


def test_hsdp_ddp_ac_and_accumulation_combined(run_on_ranks):
    _assert_all_ranks_pass(
        run_on_ranks(4, _parity, {"dp_replicate": 2}, ac_mode="op", grad_accum=2)
    )


def test_fsdp2_with_ac_and_compile_matches_single_device(run_on_ranks):
    for r in run_on_ranks(2, compiled_parity, {}):
        r.assert_ok()

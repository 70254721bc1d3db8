"""forge-tp-plans' Hugging Face model tests composed with forge-fsdp-wrap: under FSDP2 x TP the
logits and every gradient match the unsharded model, and training matches it in loss and gradient
norm (TP=2 alone: packages/forge-tp-plans/tests/test_hf_models.py, whose models and check these reuse)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from forge_core.testing import run_parity
from forge_fsdp_wrap import apply_fsdp2, default_mp_policy
from forge_mesh import build_device_mesh
from forge_tp_plans import apply_tensor_parallel
from test_hf_models import COMMON, _build
from test_hf_models import _hf_logits_and_grads as _tp_logits_and_grads
from torch.distributed.device_mesh import DeviceMesh

from tests.parity_jobs import HFLogits

#: What this module's rank functions import inside the function: the rank workers' forkserver
#: imports it once (forge_core.testing.pytest_ranks).
RANK_PRELOAD = ["transformers"]

# NOTE: the Hugging Face lane (marker zoo, with tests/zoo), not the README suite (its time).
pytestmark = pytest.mark.zoo


def _fsdp2(model: nn.Module, mesh: DeviceMesh) -> None:
    apply_fsdp2(model, mesh, default_mp_policy(torch.float32))


def _hf_logits_and_grads(name: str, layout: dict) -> dict:
    """packages/forge-tp-plans/tests/test_hf_models.py's check, with FSDP2 applied after TP."""
    return _tp_logits_and_grads(name, layout, shard=_fsdp2)


# NOTE: DeepSeek-V2 (MLA, MoE) under FSDP2 x TP x EP:
# tests/integration/moe_ep/test_hf_moe_training.py.
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma", "qwen3", "gemma3_text"])
def test_hf_model_fsdp2_x_tp_logits_and_grads_match(run_on_ranks, name):
    out = run_on_ranks(4, _hf_logits_and_grads, name, {"tp": 2})[0]
    assert out["source"] == "huggingface"


def _hf_training_parity(name: str):
    reference = _build(name)
    parallel = copy.deepcopy(reference)
    mesh = build_device_mesh({"tp": 2}, "cpu")
    apply_tensor_parallel(parallel, mesh)
    apply_fsdp2(parallel, mesh, default_mp_policy(torch.float32))
    return run_parity(
        HFLogits(reference), HFLogits(parallel), mesh=mesh, steps=5, vocab_size=COMMON["vocab_size"]
    )


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_hf_model_fsdp2_x_tp_training_matches_loss_and_grad_norm(run_on_ranks, name):
    for result in run_on_ranks(4, _hf_training_parity, name):
        result.assert_ok()

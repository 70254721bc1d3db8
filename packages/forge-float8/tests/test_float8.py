"""Float8 (torchao) on CPU: forge_float8's refusal of a model with no convertible Linear and the
CPU kernels switch; its conversion composed with TP, its report and refusals on forge-moe-ep's
model and its place after AC: tests/integration/float8/test_float8_with_other_layers.py (training
within 2% of bf16 under FSDP2, TP and EP, through forge's build_parallel_model:
tests/integration/float8/test_float8_training.py)."""

from __future__ import annotations

import pytest
import torch.nn as nn
from float8_markers import needs_torchao
from forge_core import ForgeConfigError
from forge_float8 import apply_float8

pytestmark = needs_torchao


def test_cpu_fp8_kernels_turn_onednn_off_and_return_the_previous_setting():
    import torch
    from forge_float8 import use_torch_cpu_fp8_kernels

    before = torch.backends.mkldnn.enabled
    try:
        torch.backends.mkldnn.enabled = True
        assert use_torch_cpu_fp8_kernels() is True
        assert torch.backends.mkldnn.enabled is False
        assert use_torch_cpu_fp8_kernels() is False
    finally:
        torch.backends.mkldnn.enabled = before


def test_model_without_a_convertible_linear_gets_a_clear_message():
    with pytest.raises(ForgeConfigError, match=r"no Linear can be converted \(odd: in_features=20"):
        apply_float8(_only_odd())
    with pytest.raises(ForgeConfigError, match=r"the model has no nn.Linear"):
        apply_float8(nn.Sequential(nn.ReLU()))


def _only_odd() -> nn.Module:
    m = nn.Module()
    m.odd = nn.Linear(20, 8)
    return m

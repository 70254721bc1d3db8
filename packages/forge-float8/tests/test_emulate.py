"""Which device decides Float8 emulation. Found on the first GPU run (H200, 2026-11-27): a CPU
model converted on a GPU machine asked CUDA for its capability, which initialized CUDA in the
process, and every rank process forked from it afterwards failed ("Cannot re-initialize CUDA in
forked subprocess"). Here CUDA is faked: any question to it fails the test."""

from __future__ import annotations

import pytest
import torch
from float8_markers import needs_torchao
from torch import nn

pytestmark = needs_torchao


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


@pytest.fixture
def gpu_machine(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """A machine that says it has a pre-fp8 GPU (sm_80); records every capability question."""
    asked: list[object] = []

    def capability(device: object = None) -> tuple[int, int]:
        asked.append(device)
        return (8, 0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    return asked


def _emulated(model: nn.Module) -> set[bool]:
    return {m.config.emulate for m in model.modules() if hasattr(m, "config")}


def test_a_cpu_model_on_a_gpu_machine_never_asks_cuda(gpu_machine):
    from forge_float8 import apply_float8

    model = apply_float8(_model(), enable_fsdp_float8_all_gather=False)
    assert gpu_machine == [] and _emulated(model) == {False}


def test_a_meta_model_bound_for_cpu_never_asks_cuda(gpu_machine):
    from forge_float8 import apply_float8

    with torch.device("meta"):
        model = _model()
    apply_float8(model, enable_fsdp_float8_all_gather=False, device="cpu")
    assert gpu_machine == [] and _emulated(model) == {False}


def test_a_meta_model_bound_for_an_old_gpu_is_emulated_with_a_warning(gpu_machine):
    from forge_float8 import apply_float8

    with torch.device("meta"):
        model = _model()
    with pytest.warns(UserWarning, match="sm_80 has no fp8 GEMMs"):
        apply_float8(model, enable_fsdp_float8_all_gather=False, device="cuda:0")
    assert gpu_machine == [torch.device("cuda:0")] and _emulated(model) == {True}


def test_rowwise_on_a_cpu_without_its_fp8_gemm_is_emulated_with_a_warning(monkeypatch):
    """torch 2.11's CPU _scaled_mm takes per-tensor scales only (found on the GPU machine's
    torch, 2026-11-27: an INTERNAL ASSERT in every rowwise step); such a torch emulates."""
    import forge_float8.convert as convert
    from forge_float8 import apply_float8, cpu_scaled_mm_supports

    assert cpu_scaled_mm_supports("tensorwise")
    monkeypatch.setattr(convert, "cpu_scaled_mm_supports", lambda recipe: recipe == "tensorwise")
    with pytest.warns(UserWarning, match="no CPU fp8 GEMM with rowwise scales"):
        model = apply_float8(_model(), recipe="rowwise", enable_fsdp_float8_all_gather=False)
    assert _emulated(model) == {True}
    out = model(torch.randn(4, 32))  # the emulated GEMM runs where the CPU kernel would not
    assert out.shape == (4, 32) and torch.isfinite(out).all()
    tensorwise = apply_float8(_model(), enable_fsdp_float8_all_gather=False)
    assert _emulated(tensorwise) == {False}

"""FSDP2 / DDP wrapping by forge_fsdp_wrap: the stage order, errors, models with Hugging Face-style
blocks, AC's saved memory (on models built by forge's build_parallel_model: sharded init, units,
no-sync accumulation, unshard, bf16 autocast: tests/integration/fsdp_wrap/test_fsdp2_built.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from forge_core import ForgeConfigError, ModelConfig, Transformer, applied_stages
from forge_core.testing import run_parity
from forge_fsdp_wrap import apply_ac, apply_ddp, apply_fsdp2, default_mp_policy
from forge_mesh import build_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

CFG = ModelConfig.preset("debug")
FP32 = default_mp_policy(torch.float32)


def _meta() -> Transformer:
    with torch.device("meta"):
        return Transformer(CFG)


def _fsdp2_then_ac() -> str:
    model = _meta()
    apply_fsdp2(model, build_device_mesh({}, "cpu"), FP32)
    try:
        apply_ac(model, "full")
    except ForgeConfigError as e:
        return str(e)
    return "no error"


def test_fsdp2_then_ac_wrong_order_raises(run_on_ranks):
    msg = run_on_ranks(4, _fsdp2_then_ac)[0]
    assert (
        "cannot apply 'ac' after ['fsdp2']" in msg
        and "TP -> CP -> EP -> Float8 -> domain -> AC -> compile -> FSDP2" in msg
    )


def _fully_shard_by_hand_then_ac() -> str:
    model = _meta()
    fully_shard(model, mesh=build_device_mesh({}, "cpu"))
    try:
        apply_ac(model, "op")
    except ForgeConfigError as e:
        return str(e)
    return "no error"


def test_fsdp_applied_without_forge_is_detected(run_on_ranks):
    assert "cannot apply 'ac' after ['fsdp2']" in run_on_ranks(2, _fully_shard_by_hand_then_ac)[0]


def _wrap_errors() -> list[str]:
    errors = []
    tp_mesh = build_device_mesh({"tp": 4, "data": "none"}, "cpu")
    dp_mesh = build_device_mesh({}, "cpu")
    hsdp_mesh = build_device_mesh({"dp_replicate": 2}, "cpu")
    for call in (
        lambda: apply_fsdp2(_meta(), tp_mesh),
        lambda: apply_fsdp2(_meta(), dp_mesh, reshard_after_forward=3),
        lambda: apply_ddp(_meta(), dp_mesh),
        lambda: apply_ddp(Transformer(CFG), hsdp_mesh),
    ):
        try:
            call()
            errors.append("no error")
        except ForgeConfigError as e:
            errors.append(str(e))
    return errors


def test_wrapping_errors_are_clear(run_on_ranks):
    errors = run_on_ranks(4, _wrap_errors)[0]
    assert "apply_fsdp2 needs a data-parallel axis, but the mesh has ['tp']" in errors[0]
    assert (
        "reshard_after_forward=3: use True, False, or an int that divides the shard group size 4"
        in errors[1]
    )
    assert "apply_ddp needs materialized parameters" in errors[2]
    assert "apply_ddp needs one data-parallel axis" in errors[3]


class _HFStyleLM(nn.Module):
    """Blocks under ``model.layers`` as Hugging Face models keep them; no init_weights."""

    def __init__(self, vocab: int = 64, dim: int = 32, n_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
            for _ in range(n_layers)
        )
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.model.layers:
            h = h + layer(h)
        return self.lm_head(h)


def _hf_style_parity(data: str):
    torch.manual_seed(0)
    reference = _HFStyleLM()
    parallel = _HFStyleLM()
    parallel.load_state_dict(reference.state_dict())
    layout = {"data": data}
    mesh = build_device_mesh(layout, "cpu")
    if data == "fsdp2":
        apply_ac(parallel, "full")
        apply_fsdp2(parallel, mesh, FP32)
        units = [n for n, m in parallel.named_modules() if isinstance(m, FSDPModule)]
    else:
        parallel = apply_ddp(parallel, mesh)
        units = []
    result = run_parity(reference, parallel, mesh=mesh, steps=5, vocab_size=64)
    return result, units


@pytest.mark.parametrize("data", ["fsdp2", "ddp"])
def test_models_with_hf_style_blocks_match_single_device(run_on_ranks, data):
    result, units = run_on_ranks(4, _hf_style_parity, data)[0]
    result.assert_ok()
    if data == "fsdp2":
        assert units == ["", "model.layers.0", "model.layers.1", "model.layers.2"]


def test_ac_modes_save_less_activation_memory():
    """Bytes saved for backward during one forward: full < selective < none, and op < none."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, ffn_dim=256, max_seq_len=64)
    tokens = torch.randint(0, cfg.vocab_size, (4, 64))
    saved, grads = {}, {}
    for mode in ("none", "full", "selective", "op"):
        model = Transformer(cfg)
        model.init_weights(0)
        apply_ac(model, mode)
        total = [0]

        def pack(t: torch.Tensor, total: list[int] = total) -> torch.Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        saved[mode] = total[0]
        grads[mode] = [p.grad for p in model.parameters()]
    assert saved["full"] < saved["selective"] < saved["none"]
    assert saved["op"] < saved["none"]
    for mode in ("full", "selective", "op"):  # recompute gives the same gradients
        for a, b in zip(grads[mode], grads["none"], strict=True):
            torch.testing.assert_close(a, b)


def test_ac_none_is_a_no_op_that_leaves_room_for_a_real_mode():
    model = _meta()
    apply_ac(model, "none")
    apply_ac(model, "full")
    assert applied_stages(model) == ["ac"]


def test_compile_after_sharding_by_scope():
    from forge_core import ForgeConfigError
    from forge_core.torch_compat import is_compiled
    from forge_fsdp_wrap import compile_after_sharding

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ForgeConfigError, match="compile_scope='blocks'.*has not run"):
        compile_after_sharding(model, scope="blocks")
    assert compile_after_sharding(model, scope="model", backend="eager") is model
    assert is_compiled(model)
    assert compile_after_sharding(model, scope="model", backend="eager") is model  # not twice

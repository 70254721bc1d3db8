"""FSDP2 / DDP wrapping: sharded init, units, no-sync accumulation, unshard, errors, other models."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from forge.build import build_parallel_model
from forge_core import ForgeConfigError, ModelConfig, Transformer, applied_stages
from forge_core.testing import run_parity
from forge_core.training import set_gradient_sync
from forge_fsdp_wrap import apply_ac, apply_ddp, apply_fsdp2, default_mp_policy, unshard_fsdp2_model
from forge_mesh import build_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

CFG = ModelConfig.preset("debug")
FP32 = default_mp_policy(torch.float32)


def _meta() -> Transformer:
    with torch.device("meta"):
        return Transformer(CFG)


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


def test_ac_none_is_a_no_op_that_leaves_room_for_a_real_mode():
    model = _meta()
    apply_ac(model, "none")
    apply_ac(model, "full")
    assert applied_stages(model) == ["ac"]


def _replicate_only_bytes() -> tuple[tuple, float]:
    mesh = build_device_mesh({"dp_replicate": 4}, "cpu")
    model = build_parallel_model(CFG, "cpu", mesh, param_dtype=torch.float32)
    local = sum(p.to_local().numel() for p in model.parameters())
    return mesh.mesh_dim_names, local / CFG.num_params()


def test_dp_replicate_alone_replicates_instead_of_sharding(run_on_ranks):
    names, fraction = run_on_ranks(4, _replicate_only_bytes)[0]
    assert names == ("dp_replicate", "dp_shard") and fraction == 1.0

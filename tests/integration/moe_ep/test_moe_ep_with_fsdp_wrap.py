"""forge-moe-ep's tests composed with forge-fsdp-wrap: apply_expert_parallel refuses to run after
apply_fsdp2 (with its other refusals), and the MoE's load-balancing bias update is the same under
apply_ac's activation checkpointing as without it (forge_moe_ep alone:
packages/forge-moe-ep/tests/test_ep_layer.py and packages/forge-moe-ep/tests/test_moe.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from forge_core import ForgeConfigError
from forge_core.contracts import attach_optimizer_hooks
from forge_fsdp_wrap import apply_ac, apply_fsdp2
from forge_mesh import build_device_mesh
from forge_moe_ep import MoE, apply_expert_parallel, moe_transformer
from forge_moe_ep.config import MoEModelConfig


def _refusals() -> list[str]:
    messages = []
    cfg = MoEModelConfig.preset("debug_moe")
    mesh = build_device_mesh({"dp_shard": 2, "ep": 2}, "cpu", num_experts=8)
    with torch.device("meta"):
        model = moe_transformer(cfg)
    apply_fsdp2(model, mesh)
    for fn in (
        lambda: apply_expert_parallel(model, mesh),  # after FSDP2: wrong order
        lambda: apply_expert_parallel(torch.nn.Linear(2, 2), mesh),  # no MoE
        lambda: apply_expert_parallel(
            moe_transformer(MoEModelConfig.preset("debug_moe", num_experts=3, top_k=1)), mesh
        ),
    ):
        with pytest.raises(ForgeConfigError) as err:
            fn()
        messages.append(str(err.value))
    return messages


def test_apply_expert_parallel_refuses_wrong_order_no_moe_and_indivisible_experts(run_on_ranks):
    order, no_moe, indivisible = run_on_ranks(2, _refusals)[0]
    assert "cannot apply 'ep' after ['fsdp2']" in order
    assert "expert parallelism (parallelism.ep=2) on a model with no forge_moe_ep.MoE" in no_moe
    assert "ep=2 does not divide moe.num_experts=3" in indivisible


def _biases_after_one_step(grad_accum: int, ac: bool) -> list[torch.Tensor]:
    cfg = MoEModelConfig.preset("debug_moe", moe_bias_update_rate=1e-2)
    model = moe_transformer(cfg)
    model.init_weights(0)
    if ac:
        apply_ac(model, "full")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = attach_optimizer_hooks(model, opt)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    counted = []
    for micro in tokens.chunk(grad_accum):
        logits = model(micro[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten()).backward()
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    counted = [float(m.router.tokens_per_expert.sum()) for m in moes]
    opt.step()
    handle.remove()
    assert counted == [4 * 16 * cfg.top_k] * len(moes)  # every routed slot once, no AC recount
    return [m.router.expert_bias.clone() for m in moes]


def test_bias_update_is_the_same_with_gradient_accumulation_and_activation_checkpointing():
    base = _biases_after_one_step(grad_accum=1, ac=False)
    assert any(torch.count_nonzero(b) for b in base)
    for grad_accum, ac in ((2, False), (1, True), (4, True)):
        for a, b in zip(base, _biases_after_one_step(grad_accum, ac), strict=True):
            assert torch.equal(a, b)

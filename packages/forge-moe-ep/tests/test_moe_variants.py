"""The router and expert variants the Hugging Face families need, against plain formulas:
choice on the logits, groups left out at zero, a clamped renormalisation, sqrt-softplus scores,
hash-routed ids; experts that are not gated, soft-capped SwiGLU; and the config's refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from forge_core.errors import ForgeConfigError
from forge_moe_ep.config import MoEConfig, MoEModelConfig
from forge_moe_ep.experts import GroupedExperts, expert_activation
from forge_moe_ep.moe import MoE
from forge_moe_ep.router import Router


def _router(**kwargs: object) -> Router:
    torch.manual_seed(0)
    router = Router(8, 8, 2, str(kwargs.pop("score", "sigmoid")), **kwargs)  # type: ignore[arg-type]
    with torch.no_grad():
        router.gate.weight.normal_()
    return router


def test_choice_on_the_logits_picks_by_logit_plus_bias_and_weighs_by_score():
    router = _router(choice="logits", renormalize=False)
    router.expert_bias.copy_(torch.linspace(-2, 2, 8))
    x = torch.randn(16, 8)
    weights, ids, scores = router(x)
    logits = x @ router.gate.weight.T
    expected = torch.topk(logits + router.expert_bias, 2).indices
    assert torch.equal(ids.sort(-1).values, expected.sort(-1).values)
    torch.testing.assert_close(weights, logits.sigmoid().gather(-1, ids))
    by_scores = torch.topk(logits.sigmoid() + router.expert_bias, 2).indices
    assert not torch.equal(ids.sort(-1).values, by_scores.sort(-1).values)  # the variant bites


def test_groups_left_out_at_zero_lose_to_nothing_but_beat_negative_choices():
    """Group 0 is kept (its best expert); its other experts' biased scores are negative, so
    under ``zero`` the left-out group's experts (at 0.0) are chosen next, never under
    ``exclude``."""
    bias = torch.tensor([0.5, -3.0, -3.0, -3.0, -5.0, -5.0, -5.0, -5.0])
    chosen = {}
    for mask in ("exclude", "zero"):
        router = _router(groups=2, topk_groups=1, group_mask=mask)
        router.expert_bias.copy_(bias)
        chosen[mask] = router(torch.randn(32, 8))[1]
    assert (chosen["exclude"] < 4).all()
    assert (chosen["zero"] >= 4).any(dim=-1).all()


def test_renormalising_clamps_the_sum_and_sqrtsoftplus_scores():
    router = _router(score="sqrtsoftplus", renormalize=True, renormalize_min=10.0)
    x = torch.randn(8, 8)
    weights, ids, scores = router(x)
    torch.testing.assert_close(scores, F.softplus(x @ router.gate.weight.T).sqrt())
    # every sum of two sqrt-softplus scores of these logits is below 10: divided by 10
    torch.testing.assert_close(weights, scores.gather(-1, ids) / 10.0)


def test_hash_ids_are_weighted_not_chosen():
    router = _router(renormalize=True)
    ids = torch.tensor([[3, 5]] * 4)
    weights, got, scores = router(torch.randn(4, 8), ids)
    assert torch.equal(got, ids)
    chosen = scores.gather(-1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))


def _rows_and_offs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(12, 6), torch.tensor([3, 3, 9, 12], dtype=torch.int32)


def _per_expert(x: torch.Tensor, offs: torch.Tensor, fn) -> torch.Tensor:  # type: ignore[no-untyped-def]
    starts = [0, *offs.tolist()[:-1]]
    return torch.cat(
        [fn(e, x[a:b]) for e, (a, b) in enumerate(zip(starts, offs.tolist(), strict=True))]
    )


def test_experts_that_are_not_gated_compute_act_x_w1_w2():
    experts = GroupedExperts(4, 6, 5, act="relu2", gated=False)
    assert experts.w3 is None and "w3" not in dict(experts.named_parameters())
    torch.nn.init.normal_(experts.w1)
    torch.nn.init.normal_(experts.w2)
    x, offs = _rows_and_offs()
    expected = _per_expert(x, offs, lambda e, r: F.relu(r @ experts.w1[e]).square() @ experts.w2[e])
    torch.testing.assert_close(experts(x, offs), expected)


def test_softcapped_swiglu_caps_the_gate_factor_and_up_but_not_the_sigmoid():
    gate, up = torch.randn(5, 7) * 3, torch.randn(5, 7) * 3
    out = expert_activation(gate, up, "softcapped_swiglu", limit=0.5, up_limit=0.2)
    expected = 0.5 * torch.tanh(gate / 0.5) * torch.sigmoid(gate) * 0.2 * torch.tanh(up / 0.2)
    torch.testing.assert_close(out, expected)


def test_a_moe_with_latent_projections_runs_its_experts_at_their_width():
    config = MoEModelConfig(
        dim=8, n_layers=1, n_heads=1, vocab_size=1, ffn_dim=16, moe_every=1, num_experts=4
    )
    from forge_moe_ep.experts import grouped_experts

    moe = MoE(config)
    moe.experts = grouped_experts(config, 3)
    for p in moe.parameters():
        torch.nn.init.normal_(p)
    moe.expert_in, moe.expert_out = torch.nn.Linear(8, 3), torch.nn.Linear(3, 8)
    x = torch.randn(2, 5, 8)
    weights, ids, _ = moe.router(x.reshape(-1, 8))
    latent = moe.expert_in(x.reshape(-1, 8))
    expected = torch.zeros_like(latent)
    for k in range(2):
        for t in range(10):
            e = int(ids[t, k])
            h = F.silu(latent[t] @ moe.experts.w1[e]) * (latent[t] @ moe.experts.w3[e])
            expected[t] += weights[t, k] * (h @ moe.experts.w2[e])
    torch.testing.assert_close(moe(x), moe.expert_out(expected).view(2, 5, 8))


@pytest.mark.parametrize("act", ["clamped_swiglu", "clamped_silu", "softcapped_swiglu"])
def test_experts_that_are_not_gated_refuse_activations_of_the_up_half(act):
    with pytest.raises(ForgeConfigError, match=rf"moe.expert_act='{act}' reads the experts' up"):
        MoEConfig(num_experts=4, expert_act=act, expert_gated=False)


def test_variant_fields_are_checked_by_name():
    with pytest.raises(ForgeConfigError, match="moe.router_choice='logit' is invalid"):
        MoEConfig(num_experts=4, router_choice="logit")
    with pytest.raises(ForgeConfigError, match="moe.router_group_mask"):
        MoEConfig(num_experts=4, router_group_mask="none")
    with pytest.raises(ForgeConfigError, match="moe.expert_act_up_limit"):
        MoEConfig(num_experts=4, expert_act_up_limit=0.0)

"""The MoE layer on one process: against a per-token loop, gradients, empty experts, capacity
drops, load balancing (bias update, aux loss), autocast, config errors, host syncs (the bias
update under forge-fsdp-wrap's AC: tests/integration/moe_ep/test_moe_ep_with_fsdp_wrap.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from forge_core import ForgeConfigError, Transformer, no_host_sync
from forge_core.contracts import pop_aux_losses
from forge_core.testing.sync_guard import HostSyncError
from forge_moe_ep import (
    MoE,
    capacity_per_sequence,
    check_expert_parallel,
    moe_metrics,
    moe_transformer,
)
from forge_moe_ep.config import MoEModelConfig
from forge_moe_ep.dispatch import capacity_layout

D = 64


def make_moe(**fields: object) -> MoE:
    moe = MoE(MoEModelConfig.preset("debug_moe", **fields), layer_id=0)
    moe.init_weights(0)
    return moe


def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def loop_reference(moe: MoE, x_BSD: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """Per token, per chosen expert: weight * SwiGLU_e(x), plus the shared expert."""
    x = x_BSD.reshape(-1, D)
    weights, ids, _ = moe.router(x)
    ex = moe.experts
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(D)
        for j in range(moe.top_k):
            if kept is not None and not kept[t, j]:
                continue
            e = int(ids[t, j])
            acc = acc + weights[t, j] * swiglu(x[t], ex.w1[e], ex.w2[e], ex.w3[e])
        rows.append(acc)
    out = torch.stack(rows)
    if moe.shared_expert is not None:
        out = out + moe.shared_expert(x)
    return out.view_as(x_BSD)


def kept_by_capacity(ids: torch.Tensor, batch: int, capacity: int) -> torch.Tensor:
    """Loop rule: per (sequence, expert), the first ``capacity`` slots in slot order stay."""
    t, k = ids.shape
    seq_len = t // batch
    used: dict[tuple[int, int], int] = {}
    kept = torch.zeros(t, k, dtype=torch.bool)
    for tok in range(t):
        for j in range(k):
            key = (tok // seq_len, int(ids[tok, j]))
            if used.get(key, 0) < capacity:
                kept[tok, j] = True
                used[key] = used.get(key, 0) + 1
    return kept


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [0, 1])
def test_dropless_moe_matches_per_token_loop_and_its_gradients(router, shared):
    moe = make_moe(router=router, num_shared_experts=shared)
    x = torch.randn(2, 8, D, requires_grad=True)
    out = moe(x)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = loop_reference(moe, ref_x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *moe.parameters()], grad)
    want = torch.autograd.grad(ref, [ref_x, *moe.parameters()], grad)
    for (name, _), g, w in zip([("x", x), *moe.named_parameters()], got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=name)


def test_capacity_mode_drops_later_positions_per_sequence_like_the_loop_rule():
    moe = make_moe(moe_dispatch="capacity", capacity_factor=0.5).eval()  # eval: no counting
    x = torch.randn(3, 8, D)
    capacity = capacity_per_sequence(8, moe.top_k, moe.num_experts, 0.5)
    assert capacity == 1  # ceil(0.5 * 8 * 2 / 8)
    _, ids, _ = moe.router(x.reshape(-1, D))
    kept = kept_by_capacity(ids, 3, capacity)
    assert not kept.all()  # the setting really drops
    torch.testing.assert_close(moe(x), loop_reference(moe, x, kept), rtol=1e-5, atol=1e-6)
    moe.train()
    moe(x)
    assert moe_metrics(moe)["tokens_dropped"] == int((~kept).sum())


def test_capacity_drops_do_not_depend_on_how_the_batch_is_split():
    # Per-sequence capacity: the data-parallel split of a batch cannot change what is dropped.
    moe = make_moe(moe_dispatch="capacity", capacity_factor=0.5)
    x = torch.randn(4, 8, D)
    whole = moe(x)
    dropped_whole = moe_metrics(moe)["tokens_dropped"]
    halves = torch.cat([moe(x[:2]), moe(x[2:])])
    assert moe_metrics(moe)["tokens_dropped"] == 2 * dropped_whole > 0
    # Same rows dropped; values equal up to GEMM blocking (different row counts per call).
    torch.testing.assert_close(whole, halves, rtol=1e-5, atol=1e-7)


def test_capacity_layout_rows_are_expert_then_sequence_and_zero_where_empty():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 0]])  # 2 sequences of 2 tokens, E=3
    layout, dropped = capacity_layout(ids, 3, batch=2, capacity=1)
    # rows: (e0,s0) (e0,s1) (e1,s0) (e1,s1) (e2,s0) (e2,s1); slot = token*2 + k
    assert layout.gather_idx.tolist() == [0, 4, 1, 5, 3, 6]
    assert layout.offs.tolist() == [2, 4, 6] and layout.counts.tolist() == [2, 2, 2]
    assert int(dropped) == 2  # token 1 -> e0 (second in seq 0) and token 3 -> e0 (seq 1)
    assert layout.scatter_idx[2].item() == 6 and layout.scatter_idx[7].item() == 6
    empty, _ = capacity_layout(torch.tensor([[1, 1]]), 3, batch=1, capacity=2)
    assert empty.gather_idx.tolist() == [2, 2, 0, 1, 2, 2]  # 2 = T*K: an empty row


def test_a_token_whose_slots_are_all_dropped_gets_exactly_the_shared_expert():
    moe = make_moe(moe_dispatch="capacity", capacity_factor=0.1, top_k=1, num_shared_experts=1)
    with torch.no_grad():
        moe.router.expert_bias[3] = 100.0  # every token chooses expert 3
    x = torch.randn(1, 8, D)
    out = moe(x)[0]
    shared = moe.shared_expert(x)[0]
    # capacity 1: only position 0 reaches expert 3; the other 7 get no routed rows at all, so no
    # uninitialized or padding row can leak into their output.
    assert torch.equal(out[1:], shared[1:])
    assert not torch.equal(out[0], shared[0])


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_experts_without_tokens_get_zero_gradients_not_none(dispatch):
    moe = make_moe(moe_dispatch=dispatch, capacity_factor=4.0)
    with torch.no_grad():
        moe.router.expert_bias[:2] = 100.0  # top-2 always picks experts 0 and 1
    moe(torch.randn(2, 8, D)).square().sum().backward()
    for name in ("w1", "w2", "w3"):
        grad = getattr(moe.experts, name).grad
        assert grad is not None and grad.shape == getattr(moe.experts, name).shape
        assert torch.count_nonzero(grad[2:]) == 0 and torch.count_nonzero(grad[:2]) > 0


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_empty_batches_run_and_give_zero_expert_gradients(dispatch):
    moe = make_moe(moe_dispatch=dispatch)
    for shape in ((0, 16, D), (2, 0, D)):
        moe.zero_grad(set_to_none=True)
        x = torch.randn(*shape, requires_grad=True)
        out = moe(x)
        assert out.shape == shape
        out.sum().backward()
        assert moe.experts.w1.grad is not None and torch.count_nonzero(moe.experts.w1.grad) == 0


def test_router_runs_in_float32_under_bf16_autocast():
    moe = make_moe()
    x = torch.randn(2, 8, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights, ids, scores = moe.router(x.reshape(-1, D))
        out = moe(x)
    assert weights.dtype == scores.dtype == torch.float32 and ids.dtype == torch.int64
    assert out.dtype == torch.bfloat16  # experts computed in the autocast dtype
    torch.testing.assert_close(out.float(), moe(x), rtol=5e-2, atol=5e-2)


def test_bias_update_is_mean_centred_sign_of_count_deficit_and_resets_counts():
    moe = make_moe(moe_bias_update_rate=0.1)
    moe.train()
    with torch.no_grad():
        moe.router.tokens_per_expert.copy_(torch.tensor([5.0, 1, 1, 1, 0, 0, 0, 0]))
    moe.forge_after_optimizer_step()
    delta = 0.1 * torch.sign(torch.tensor(1.0) - torch.tensor([5.0, 1, 1, 1, 0, 0, 0, 0]))
    torch.testing.assert_close(moe.router.expert_bias, delta - delta.mean())
    assert abs(float(moe.router.expert_bias.sum())) < 1e-6
    assert torch.count_nonzero(moe.router.tokens_per_expert) == 0


def test_load_hooks_see_the_counts_before_the_bias_update_and_can_be_removed():
    moe = make_moe(moe_bias_update_rate=0.1)
    seen = []

    def only_expert_0_counts(counts: torch.Tensor) -> None:
        seen.append(counts.clone())
        counts.copy_(torch.tensor([5.0, 0, 0, 0, 0, 0, 0, 0]))

    handle = moe.register_load_hook(only_expert_0_counts)
    with torch.no_grad():
        moe.router.tokens_per_expert.fill_(1.0)
    moe.forge_after_optimizer_step()
    assert len(seen) == 1 and torch.equal(seen[0], torch.ones(8))
    delta = 0.1 * torch.sign(torch.tensor(5 / 8) - torch.tensor([5.0, 0, 0, 0, 0, 0, 0, 0]))
    torch.testing.assert_close(moe.router.expert_bias, delta - delta.mean())
    handle.remove()
    moe.forge_after_optimizer_step()
    assert len(seen) == 1


def test_aux_loss_is_switch_style_and_reaches_the_router():
    moe = make_moe(moe_aux_loss_coef=0.01)
    moe.train()
    x = torch.randn(2, 8, D)
    moe(x)
    aux = pop_aux_losses(moe)
    assert pop_aux_losses(moe) is None  # handed over once
    _, ids, scores = moe.router(x.reshape(-1, D))
    fraction = torch.bincount(ids.flatten(), minlength=8).float() / ids.numel()
    expected = 0.01 * 8 * (fraction * scores.mean(0)).sum()
    torch.testing.assert_close(aux, expected)
    (gate_grad,) = torch.autograd.grad(aux, [moe.router.gate.weight])
    assert torch.count_nonzero(gate_grad) > 0
    moe.eval()
    moe(x)
    assert pop_aux_losses(moe) is None  # no aux loss outside training


def test_moe_forward_and_backward_have_no_host_sync_on_one_rank():
    for dispatch in ("dropless", "capacity"):
        moe = make_moe(moe_dispatch=dispatch)
        moe.train()
        x = torch.randn(2, 8, D, requires_grad=True)
        with no_host_sync("cpu"):
            moe(x).square().sum().backward()


def test_no_host_sync_catches_a_planted_item_in_the_moe_forward(monkeypatch):
    moe = make_moe(moe_dispatch="capacity")
    forward = moe.router.forward

    def leaky(x):
        weights, ids, scores = forward(x)
        _ = ids.max().item()  # e.g. "how many experts are used?" read on the host
        return weights, ids, scores

    monkeypatch.setattr(moe.router, "forward", leaky)
    with pytest.raises(HostSyncError, match="_local_scalar_dense"), no_host_sync("cpu"):
        moe(torch.randn(1, 8, D))


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"moe_bias_update_rate": float("inf")}, r"^moe\.moe_bias_update_rate=inf must be a"),
        ({"moe_bias_update_rate": 1e300}, r"^moe\.moe_bias_update_rate=1e\+300 .* \[0, 1\]"),
        ({"moe_aux_loss_coef": float("nan")}, r"^moe\.moe_aux_loss_coef=nan .* \[0, 1\]"),
        ({"capacity_factor": float("inf")}, r"^moe\.capacity_factor=inf must be a finite"),
        (
            {"moe_dispatch": "capacity", "capacity_factor": 1e300},
            r"^moe\.capacity_factor=1e\+300 .* in \(0, 8\]",
        ),
        (
            {"moe_dispatch": "capacity", "capacity_factor": 9.0},
            r"^moe\.capacity_factor=9\.0 .* in \(0, 8\]",
        ),
        ({"router_scale": float("inf")}, r"^moe\.router_scale=inf must be a finite number"),
        ({"expert_act_limit": float("nan")}, r"^moe\.expert_act_limit=nan must be a finite"),
        ({"num_experts": 2**40}, r"^moe\.num_experts=1099511627776 is too large"),
        (
            {"num_experts": 2**22, "moe_ffn_dim": 2**20},
            r"^model has \d\.\d+e\+1\d parameters \(.*num_experts=4194304, moe_ffn_dim=1048576",
        ),
    ],
)
def test_moe_numbers_are_finite_and_in_range(fields, pattern):
    """inf or 1e300 as the bias update rate once made every router bias NaN at the first step;
    a capacity beyond num_experts only allocates rows no token can use."""
    with pytest.raises(ForgeConfigError, match=pattern) as err:
        MoEModelConfig.preset("debug_moe", **fields)
    assert "\n" not in str(err.value)
    # refused on a dense config too: a wrong number is wrong before a block uses it
    if "moe_bias_update_rate" in fields:
        with pytest.raises(ForgeConfigError, match=r"moe_bias_update_rate"):
            MoEModelConfig.preset("debug", **fields)


def test_model_config_refuses_bad_moe_fields_with_the_fix():
    cases = [
        ({"num_experts": 0}, r"num_experts=0; set num_experts >= 1"),
        ({"top_k": 9}, r"moe\.top_k=9 must be in \[1, num_experts=8\]"),
        ({"router": "softmx"}, r"moe\.router='softmx'.*did you mean 'softmax'"),
        ({"moe_dispatch": "capcity"}, r"did you mean 'capacity'"),
        ({"capacity_factor": 0.0}, r"capacity_factor=0.0 must be a finite number > 0"),
        (
            {"moe_bias_update_rate": -1.0},
            r"moe_bias_update_rate=-1.0 must be a finite number in \[0, 1\]",
        ),
    ]
    for fields, pattern in cases:
        with pytest.raises(ForgeConfigError, match=pattern):
            MoEModelConfig.preset("debug_moe", **fields)
    # a misspelt router or dispatch mode is refused on a dense config too (moe_every=0)
    with pytest.raises(ForgeConfigError, match=r"moe\.router='topk' is invalid"):
        MoEModelConfig.preset("debug", router="topk")


def test_transformer_with_moe_blocks_needs_an_ffn_factory():
    with pytest.raises(ForgeConfigError, match=r"forge_moe_ep\.moe_transformer"):
        Transformer(MoEModelConfig.preset("debug_moe"))


@pytest.mark.parametrize("moe_every", [1, 2])
def test_num_params_counts_moe_blocks(moe_every):
    cfg = MoEModelConfig.preset("debug_moe", n_layers=4, moe_every=moe_every)
    model = moe_transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    kinds = [type(b.feed_forward).__name__ for b in model.layers.values()]
    assert kinds == (["MoE"] * 4 if moe_every == 1 else ["FeedForward", "MoE"] * 2)


def test_init_on_meta_then_materialize_equals_direct_init():
    cfg = MoEModelConfig.preset("debug_moe")
    with torch.device("meta"):
        meta = moe_transformer(cfg)
    meta.to_empty(device="cpu")
    meta.init_weights(3)
    direct = moe_transformer(cfg)
    direct.init_weights(3)
    for (name, a), b in zip(meta.state_dict().items(), direct.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # Different blocks get different experts (the init is seeded by the full name).
    assert not torch.equal(
        direct.layers["0"].feed_forward.experts.w1, direct.layers["1"].feed_forward.experts.w1
    )


def test_expert_parallel_degree_must_divide_the_experts():
    check_expert_parallel(8, 4)
    with pytest.raises(
        ForgeConfigError, match=r"ep=3 does not divide moe\.num_experts=8.*\[1, 2, 4, 8\]"
    ):
        check_expert_parallel(8, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_local_moe_on_cuda_bf16_has_no_host_sync_and_matches_fp32(dispatch):
    moe = make_moe(moe_dispatch=dispatch, capacity_factor=4.0).cuda().train()
    x = torch.randn(4, 64, D, device="cuda")
    reference = moe(x)
    for p in moe.parameters():  # bf16 weights; the router's buffers stay fp32
        p.data = p.data.bfloat16()
    xb = x.bfloat16().requires_grad_(True)
    moe(xb).float().square().sum().backward()  # warm-up: Triton autotuning synchronizes
    moe.zero_grad(set_to_none=True)
    with no_host_sync("cuda"):
        out = moe(xb)
        out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and moe.experts.w1.grad is not None
    torch.testing.assert_close(out.float(), reference, rtol=5e-2, atol=2e-2)

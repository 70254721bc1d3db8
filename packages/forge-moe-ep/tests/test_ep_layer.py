"""Expert parallelism mechanics on CPU ranks: host syncs, empty experts (its refusals, after
forge-fsdp-wrap's FSDP2 among them: tests/integration/moe_ep/test_moe_ep_with_fsdp_wrap.py; the
FSDP2 units of models built by forge: tests/integration/moe_ep/test_ep_layer_built.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from forge_core import no_host_sync
from forge_core.testing.sync_guard import HostSyncError
from forge_kernels.permute import routing_layout
from forge_mesh import build_device_mesh
from forge_moe_ep import MoE, apply_expert_parallel, moe_transformer
from forge_moe_ep.config import MoEModelConfig
from torch.distributed.tensor import DTensor

D = 64


def _moe_pair(dispatch: str, ep: int, **fields: object) -> tuple[MoE, MoE]:
    """The same MoE layer whole (reference) and expert-parallel over ``ep`` ranks."""
    fields = {"capacity_factor": 1.0, **fields}
    cfg = MoEModelConfig.preset("debug_moe", moe_dispatch=dispatch, **fields)
    world = dist.get_world_size()
    mesh = build_device_mesh({"dp_shard": world, "ep": ep}, "cpu", num_experts=cfg.num_experts)
    reference = moe_transformer(cfg)
    reference.init_weights(0)
    parallel = moe_transformer(cfg)
    parallel.init_weights(0)
    apply_expert_parallel(parallel, mesh)
    return reference.layers["0"].feed_forward, parallel.layers["0"].feed_forward


def _ep_layer_under_guard(dispatch: str) -> str:
    _, moe = _moe_pair(dispatch, ep=2)
    moe.train()
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(dist.get_rank()))
    x.requires_grad_(True)
    try:
        with no_host_sync("cpu"):
            moe(x).square().sum().backward()
    except HostSyncError as e:
        # NOTE: the peers of a rank that raised mid-forward would block in the next all-to-all;
        # in dropless mode every rank raises at the same point (before any row exchange).
        return f"raised: {e}"
    assert moe.experts.w1.grad is not None
    return "clean"


def test_ep_capacity_forward_and_backward_have_no_host_sync(run_on_ranks):
    assert run_on_ranks(2, _ep_layer_under_guard, "capacity") == ["clean", "clean"]


def test_ep_dropless_has_exactly_its_documented_host_wait(run_on_ranks):
    # Dropless EP must learn the all-to-all split sizes on the host: the guard sees that read.
    for text in run_on_ranks(2, _ep_layer_under_guard, "dropless"):
        assert text.startswith("raised:") and "tolist" in text


def _all_tokens_to_rank_0_experts(dispatch: str) -> list[float]:
    reference, moe = _moe_pair(dispatch, ep=2, capacity_factor=8.0)
    for m in (reference, moe):
        with torch.no_grad():
            m.router.expert_bias[:2] = 100.0  # experts 0, 1 live on ep rank 0
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = moe(x)
    out.square().sum().backward()
    expected = reference(x)
    errors = [float((out - expected).abs().max())]
    w1 = moe.experts.w1
    assert isinstance(w1, DTensor) and w1.grad is not None
    local = w1.grad.to_local()
    if dist.get_rank() == 1:  # experts 4..7: no token anywhere, zero gradients (not None)
        assert torch.count_nonzero(local) == 0
    else:
        assert torch.count_nonzero(local[:2]) > 0
    return errors


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_a_rank_whose_experts_get_no_tokens_works_and_gets_zero_gradients(run_on_ranks, dispatch):
    for errors in run_on_ranks(2, _all_tokens_to_rank_0_experts, dispatch):
        assert max(errors) < 1e-6


def _router_alone_and_experts_alone() -> list[float]:
    reference, moe = _moe_pair("dropless", ep=2)
    x = torch.randn(2, 8, D, generator=torch.Generator().manual_seed(dist.get_rank()))
    # The router called on its own (not by its MoE) starts no exchange (rank 0 only: a
    # collective there would leave rank 1 behind and the next forward would hang).
    if dist.get_rank() == 0:
        moe.router(x.reshape(-1, D))
    # The experts called directly with expert-major rows still dispatch (the counts are then
    # exchanged at the experts), like the layer's own call.
    _, ids, _ = moe.router(x.reshape(-1, D))
    layout = routing_layout(ids, moe.num_experts)
    rows = x.reshape(-1, D).index_select(0, layout.gather_idx // moe.top_k)
    direct = moe.experts(rows, layout.offs)
    whole = reference.experts(rows, layout.offs)
    return [float((moe(x) - reference(x)).abs().max()), float((direct - whole).abs().max())]


def test_router_alone_starts_nothing_and_experts_alone_still_dispatch(run_on_ranks):
    for errors in run_on_ranks(2, _router_alone_and_experts_alone):
        assert max(errors) < 1e-6


def _dropless_event_order() -> list[str]:
    _, moe = _moe_pair("dropless", ep=2)
    events: list[str] = []
    all_to_all_single = dist.all_to_all_single

    def logged(out, x, *args, **kwargs):
        events.append(f"all_to_all {tuple(x.shape)}")
        return all_to_all_single(out, x, *args, **kwargs)

    assert moe.shared_expert is not None
    moe.shared_expert.register_forward_pre_hook(lambda *_: events.append("shared expert"))
    dist.all_to_all_single = logged
    try:
        moe(torch.randn(2, 8, D))
    finally:
        dist.all_to_all_single = all_to_all_single
    return events


def test_dropless_ep_exchanges_split_sizes_before_the_shared_expert_runs(run_on_ranks):
    # The split sizes' copy to the host is in flight while the shared expert is launched; the
    # token all-to-alls (dispatch, return) follow it.
    for events in run_on_ranks(2, _dropless_event_order):
        assert events[:2] == ["all_to_all (8,)", "shared expert"]
        assert len(events) == 4 and all(e.startswith("all_to_all (") for e in events[2:])

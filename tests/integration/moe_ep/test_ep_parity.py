"""Expert parallelism on 4 CPU ranks equals the single-device MoE model (fp32, loss + grad norm).

Every layout trains the debug_moe model (8 experts, top-2, a shared expert, an MoE in every
block) for 10 AdamW steps with aux-loss-free balancing on, so the expert biases move and change
the routing; parity therefore also covers the balancing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from forge.build import build_parallel_model
from forge_core.testing import ParityResult, run_parity
from forge_mesh import build_device_mesh
from forge_moe_ep import MoE, moe_metrics
from forge_moe_ep.config import MoEModelConfig


def _models(layout: dict, **model_fields: object):
    cfg = MoEModelConfig.preset("debug_moe", **model_fields)
    mesh = build_device_mesh(layout, "cpu", num_experts=cfg.num_experts)
    parallel = build_parallel_model(cfg, "cpu", mesh, param_dtype=torch.float32)
    reference = build_parallel_model(cfg, "cpu", None, param_dtype=torch.float32)
    return mesh, parallel, reference


def _parity(
    layout: dict, grad_accum: int = 1, steps: int = 10, **model_fields: object
) -> tuple[ParityResult, dict[str, int], list[list[float]], list[list[float]]]:
    mesh, parallel, reference = _models(layout, **model_fields)
    result = run_parity(
        reference, parallel, mesh=mesh, steps=steps, batch_size=8, seq_len=16, grad_accum=grad_accum
    )

    def biases(model: torch.nn.Module) -> list[list[float]]:
        return [m.router.expert_bias.tolist() for m in model.modules() if isinstance(m, MoE)]

    return result, moe_metrics(parallel), biases(parallel), biases(reference)


def _assert_all_ranks_pass(results) -> None:
    for result, *_ in results:
        result.assert_ok()
    first = results[0][0]
    assert first.reference[-1].loss < first.reference[0].loss  # the model is learning
    # Every rank logs the same losses (averaged over data-parallel ranks).
    losses = {tuple(s.loss for s in r.parallel) for r, *_ in results}
    assert len(losses) == 1


def test_moe_without_ep_fsdp2_matches_single_device_loss_and_grad_norm(run_on_ranks):
    _assert_all_ranks_pass(run_on_ranks(4, _parity, {"dp_shard": 4}))


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_dropless_matches_single_device_loss_and_grad_norm(run_on_ranks, ep):
    results = run_on_ranks(4, _parity, {"dp_shard": 4, "ep": ep})
    _assert_all_ranks_pass(results)
    # One deferred host wait per MoE layer per forward: 2 layers x 10 steps.
    assert all(metrics["host_syncs"] == 20 for _, metrics, *_ in results)


def test_ep_capacity_that_drops_nothing_equals_dropless(run_on_ranks):
    # capacity_factor = E / K gives every (sequence, expert) pair room for the whole sequence.
    cap = run_on_ranks(
        4, _parity, {"dp_shard": 4, "ep": 2}, moe_dispatch="capacity", capacity_factor=4.0
    )
    drop = run_on_ranks(4, _parity, {"dp_shard": 4, "ep": 2})
    _assert_all_ranks_pass(cap)
    for (c, c_metrics, *_), (d, *_) in zip(cap, drop, strict=True):
        assert c_metrics["tokens_dropped"] == 0 and c_metrics["host_syncs"] == 0
        for cs, ds in zip(c.parallel, d.parallel, strict=True):
            assert abs(cs.loss - ds.loss) <= 1e-6 * abs(ds.loss)
            assert abs(cs.grad_norm - ds.grad_norm) <= 1e-5 * abs(ds.grad_norm)


def test_ep_capacity_that_drops_matches_single_device_model_dropping_the_same(run_on_ranks):
    results = run_on_ranks(
        4, _parity, {"dp_shard": 4, "ep": 2}, moe_dispatch="capacity", capacity_factor=0.5
    )
    _assert_all_ranks_pass(results)
    assert all(metrics["tokens_dropped"] > 0 for _, metrics, *_ in results)


def test_ep_with_fsdp2_expert_sharding_and_hsdp_matches_single_device(run_on_ranks):
    # dp_replicate 2 x dp_shard 2 with ep 2: experts live on 2 EP ranks and are replicated
    # (HSDP) over the other two, the dense parts are HSDP-sharded.
    _assert_all_ranks_pass(run_on_ranks(4, _parity, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}))


def test_ep_2_with_expert_fsdp_axis_matches_single_device(run_on_ranks):
    # dp_shard 4 = dp_shard_mod_ep 2 x ep 2: each expert is FSDP-sharded over 2 ranks.
    results = run_on_ranks(4, _parity, {"dp_shard": 4, "ep": 2}, grad_accum=2)
    _assert_all_ranks_pass(results)


def test_ep_with_tp_on_the_dense_parts_matches_single_device(run_on_ranks):
    _assert_all_ranks_pass(run_on_ranks(4, _parity, {"dp_shard": 2, "tp": 2, "ep": 2}))


def test_aux_loss_free_biases_identical_on_all_ranks_and_equal_single_device(run_on_ranks):
    results = run_on_ranks(4, _parity, {"dp_shard": 4, "ep": 2}, steps=3, moe_bias_update_rate=1e-2)
    _assert_all_ranks_pass(results)
    per_rank = [par for _, _, par, _ in results]
    assert all(b == per_rank[0] for b in per_rank)
    assert per_rank[0] == results[0][3]  # bit-identical to the single-device run
    assert any(v != 0.0 for layer in per_rank[0] for v in layer)  # they did move


def _router_grads(layout: dict, dispatch: str) -> list[float]:
    mesh, parallel, reference = _models(layout, moe_dispatch=dispatch, capacity_factor=4.0)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    rank = dist.get_rank()
    local = tokens.chunk(4)[rank]
    for model, batch in ((parallel, local), (reference, tokens)):
        logits = model(batch[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    out = []
    for (name, p), (_, q) in zip(
        parallel.named_parameters(), reference.named_parameters(), strict=True
    ):
        if "router.gate" in name:
            assert p.grad is not None, name
            out.append(float((p.grad.full_tensor() - q.grad).abs().max() / q.grad.abs().max()))
    return out


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_router_stays_in_the_autograd_graph_under_ep(run_on_ranks, dispatch):
    for errors in run_on_ranks(4, _router_grads, {"dp_shard": 4, "ep": 4}, dispatch):
        assert errors and max(errors) < 1e-5


def _compiled_ep_parity(layout: dict, ac_mode: str) -> ParityResult:
    from forge_moe_ep import moe_transformer

    from tests.integration.parity_jobs import compiled_plan_parity

    cfg = MoEModelConfig.preset("debug_moe")
    mesh = build_device_mesh(layout, "cpu", num_experts=cfg.num_experts)
    with torch.device("meta"):
        model = moe_transformer(cfg)
    return compiled_plan_parity(model, cfg, mesh, ac_mode=ac_mode, batch_size=8)


@pytest.mark.parametrize("ac_mode", ["full", "op"])
def test_ep_with_tp_ac_and_compile_matches_single_device(run_on_ranks, ac_mode):
    # Per-block compile leaves the MoE eager (forge_no_compile) and compiles attention alone,
    # so FSDP2's per-sub-module units of EP blocks stay outside compiled regions.
    for result in run_on_ranks(4, _compiled_ep_parity, {"tp": 2, "ep": 2}, ac_mode):
        result.assert_ok()

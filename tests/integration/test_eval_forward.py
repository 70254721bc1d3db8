"""An evaluation forward before the optimizer is built never trains the wrong tensors.

The pattern of issue 31: ``_ = model(x).sum()`` (grad enabled, no backward), then
``AdamW(model.parameters())``. FSDP2 leaves the units that keep their parameters after forward
(forge's last block; every unit of a pipeline stage) with their unsharded copies registered, so
the optimizer captured copies and three steps ended 16 % (Hugging Face Llama) to 40 % (forge's
Transformer) off the single-device model, silently. Now, for each model kind forge builds
(forge's Transformer through ``build_parallel_model``, a Hugging Face Llama through
``ParallelPlan.parallelize``, an MoE with expert parallelism, a pipeline-parallel model whose
stage module ran the evaluation), on 2 or 4 gloo ranks:

- that order is stopped at the first step with one line naming the fix;
- the fix (``forge_fsdp_wrap.reshard(model)`` before building the optimizer) matches the
  single-device model in loss and gradient norm at every one of 3 AdamW steps (fp32
  tolerances), and so does the normal order (optimizer first, evaluation later).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from forge.build import ParallelPlan, build_meta_model, build_parallel_model
from forge_core import ForgeConfigError, ModelConfig
from forge_core.contracts import attach_optimizer_hooks
from forge_core.testing import StepRecord, compare_runs, train_steps
from forge_core.training import forward_backward, global_grad_norm, local_batch, synthetic_tokens
from forge_fsdp_wrap import reshard
from forge_mesh import build_device_mesh
from forge_moe_ep.config import MOE_PRESETS
from forge_pp import PPConfig, pipeline_stages
from torch.distributed.device_mesh import DeviceMesh

from tests.parity_jobs import TINY_HF_DECODER, HFLogits

LINE = (
    "this optimizer holds FSDP2's unsharded copies of {n} parameters (a forward ran before it "
    "was built and no backward followed), so it would step tensors FSDP2 discards; build the "
    "optimizer before the first forward, or call forge_fsdp_wrap.reshard(model) before "
    "building it"
)
STEPS, BATCH, SEQ = 3, 4, 16


def _llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_HF_DECODER)).float()


def _models(kind: str, mesh: DeviceMesh) -> tuple[nn.Module, nn.Module, int]:
    """(single-device reference, parallel model, vocabulary) of one model kind."""
    fp32 = torch.float32
    if kind == "hf":
        reference = HFLogits(_llama())
        plan = ParallelPlan(mesh, param_dtype=fp32)
        return reference, HFLogits(plan.parallelize(copy.deepcopy(reference.model))), 64
    cfg = MOE_PRESETS["debug_moe"] if kind == "moe_ep" else ModelConfig.preset("debug")
    reference = build_parallel_model(cfg, "cpu", None, param_dtype=fp32)
    if kind == "pp":
        plan = ParallelPlan(mesh, param_dtype=fp32, pp=PPConfig(schedule="GPipe"))
        parallel = plan.parallelize(build_meta_model(cfg), device="cpu", seed=0)
    else:
        parallel = build_parallel_model(cfg, "cpu", mesh, param_dtype=fp32)
    return reference, parallel, cfg.vocab_size


def _evaluate(model: nn.Module, tokens: torch.Tensor) -> None:
    """The issue's evaluation: a forward with grad enabled, its result dropped (no backward).
    A pipeline rank model is never called as a whole: its stage modules are."""
    stages = pipeline_stages(model)
    if not stages:
        _ = model(tokens).sum()
    for index, stage in stages:
        dim = stage.config.dim
        _ = stage(tokens if index == 0 else torch.zeros(*tokens.shape, dim)).sum()


def _train(model: nn.Module, tokens: torch.Tensor, mesh: DeviceMesh, order: str) -> Any:
    """3 AdamW steps with the evaluation where ``order`` puts it; the records, or the refusal."""
    evaluation = local_batch(tokens[0], mesh)[:, :-1]
    if order != "optimizer first":
        _evaluate(model, evaluation)
    if order == "reshard":
        reshard(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0)
    hooks = attach_optimizer_hooks(model, optimizer)
    if order == "optimizer first":
        _evaluate(model, evaluation)
    records = []
    for batch in tokens:
        loss_sum, count = forward_backward(model, local_batch(batch, mesh), mesh=mesh)
        grad_norm = global_grad_norm(trainable, mesh=mesh)
        try:
            optimizer.step()
        except ForgeConfigError as e:
            return str(e)
        optimizer.zero_grad(set_to_none=True)
        records.append(StepRecord(float(loss_sum / count), float(grad_norm)))
    hooks.remove()
    return records


def _eval_forward_orders(kind: str, layout: dict[str, int], orders: list[str]) -> dict[str, Any]:
    """Each order's verdict: the refusal, or the comparison with the single-device model; and
    how many parameters the rank's parallel model has."""
    mesh = build_device_mesh(layout, "cpu")
    reference, _, vocab = _models(kind, mesh)
    tokens = synthetic_tokens(0, STEPS, BATCH, SEQ, vocab)
    # NOTE: the reference evaluates the whole batch first too (an MoE counts its tokens in it)
    _evaluate(reference, tokens[0][:, :-1])
    expected = train_steps(reference, tokens)
    out: dict[str, Any] = {}
    for order in orders:
        parallel = _models(kind, mesh)[1]
        out["parameters"] = len(list(parallel.parameters()))
        got = _train(parallel, tokens, mesh, order)
        out[order] = got if isinstance(got, str) else compare_runs(expected, got)
    return out


KINDS = {
    "forge": (2, {"dp_shard": 2}, 9),  # the last block's 9 parameters
    "hf": (2, {"dp_shard": 2}, 9),
    "moe_ep": (2, {"dp_shard": 2, "ep": 2}, 13),  # norms, attention, router, shared, experts
    "pp": (4, {"pp": 2, "dp_shard": 2}, None),  # every parameter of the rank's stage
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_evaluation_forward_before_the_optimizer_is_refused_and_reshard_fixes_it(
    run_on_ranks, kind
):
    ranks, layout, copies = KINDS[kind]
    orders = ["evaluation first", "reshard"]
    for out in run_on_ranks(ranks, _eval_forward_orders, kind, layout, orders):
        refusal = out["evaluation first"]
        assert isinstance(refusal, str), refusal.table()  # before: silently off the reference
        assert refusal == LINE.format(n=copies or out["parameters"])
        out["reshard"].assert_ok()  # loss and grad norm at each of the 3 steps


def test_an_optimizer_built_before_an_evaluation_forward_trains_like_one_device(run_on_ranks):
    for out in run_on_ranks(2, _eval_forward_orders, "forge", {"dp_shard": 2}, ["optimizer first"]):
        out["optimizer first"].assert_ok()

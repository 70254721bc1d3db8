"""``ShardedHeadParams``: a module's per-head parameter split with its heads over tp (attention
sinks, Doge's ``A``): outputs, gradients and the state dict equal the unsharded module's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from forge_core import ForgeConfigError
from forge_tp_plans import apply_tensor_parallel
from forge_tp_plans.head_params import ShardedHeadParams
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

HEADS, HEAD_DIM, DIM = 4, 3, 8


class SinkAttention(nn.Module):
    """A toy attention whose forward pairs each head with its own sink logit (as GPT-OSS does):
    the head count comes from q_proj's width, so a column-split q_proj gives the rank's heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, DIM)
        self.sinks = nn.Parameter(torch.randn(HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).unflatten(-1, (-1, HEAD_DIM))  # [B, S, heads here, D]
        sinks = self.sinks[:, None].expand(*q.shape[:-1], 1)  # one per head, as the heads here
        scores = torch.cat([q.sum(-1, keepdim=True), sinks], -1)
        weights = scores.softmax(-1)[..., :1]
        return self.o_proj((weights * q).flatten(-2))


def _parity() -> dict:
    torch.manual_seed(0)
    reference = nn.Sequential(SinkAttention())
    parallel = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (2,))
    plan = {"0": ShardedHeadParams(("sinks",)), "0.q_proj": "colwise", "0.o_proj": "rowwise"}
    apply_tensor_parallel(parallel, mesh, plan=plan)
    x = torch.randn(2, 5, DIM)
    out, want = parallel(x), reference(x)
    out.sum().backward()
    want.sum().backward()
    sinks, ref_sinks = parallel[0].sinks, reference[0].sinks
    return {
        "out": (out - want).abs().max().item(),
        "sinks_grad": (sinks.grad.full_tensor() - ref_sinks.grad).abs().max().item(),
        "local": tuple(sinks.to_local().shape),
        "state": torch.equal(parallel.state_dict()["0.sinks"].full_tensor(), ref_sinks),
        "is_dtensor_after_forward": isinstance(parallel[0].sinks, DTensor),
    }


def test_per_head_parameters_split_with_the_heads(run_on_ranks):
    for got in run_on_ranks(2, _parity):
        assert got["out"] < 1e-6 and got["sinks_grad"] < 1e-6, got
        assert got["local"] == (HEADS // 2,) and got["state"] and got["is_dtensor_after_forward"]


def _indivisible() -> str:
    module = SinkAttention()
    module.sinks = nn.Parameter(torch.randn(3))
    try:
        ShardedHeadParams(("sinks",))._apply(module, init_device_mesh("cpu", (2,)))
    except ForgeConfigError as e:
        return str(e)
    return "applied"


def test_heads_tp_does_not_divide_are_refused(run_on_ranks):
    said = run_on_ranks(2, _indivisible)[0]
    assert "SinkAttention.sinks has 3 heads along dim 0, which tp=2 does not divide" in said


def test_a_missing_parameter_is_named():
    with pytest.raises(ForgeConfigError, match="has no parameter 'bias_per_head'"):
        ShardedHeadParams(("bias_per_head",))._apply(SinkAttention(), None)  # type: ignore[arg-type]

"""Spatial domain parallelism on CPU ranks (gloo, fp32): a conv net split over 2 and 4 height
slabs equals the unsplit net in output, input gradient and every parameter gradient; CREDIT's
GroupNorm flaw is shown and fixed; refusals. Domain 2 x FSDP2 2 through forge's ParallelPlan
trains like one device: tests/integration/domain/test_domain_train.py; the domain stage's place
before forge-fsdp-wrap's AC: tests/integration/domain/test_domain_order_with_fsdp_wrap.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from domain_jobs import forward_backward_equal, group_norm_input_grads
from forge_core import ForgeConfigError
from forge_domain import WidthCircularConv2d, apply_domain_parallel

TOL = 1e-5


@pytest.mark.parametrize("domain", [2, 4])
def test_split_conv_net_equals_unsplit_in_output_and_every_gradient(run_on_ranks, domain):
    for out in run_on_ranks(domain, forward_backward_equal, domain):
        assert out["out"] <= TOL and out["input_grad"] <= TOL, out
        assert max(out["param_grads"].values()) <= TOL, out["param_grads"]
        assert {"DomainConv2d", "DomainGroupNorm", "DomainLayerNorm"} <= set(out["types"])


def test_height_not_divisible_by_domain_is_padded_and_unpadded(run_on_ranks):
    for out in run_on_ranks(4, forward_backward_equal, 4, height=14):
        assert out["shard"] == (14, 16, 4)  # 14 rows padded to 16, 4 per rank
        assert out["out"] <= TOL and out["input_grad"] <= TOL, out
        assert max(out["param_grads"].values()) <= TOL


def test_group_norm_input_gradient_that_credits_design_gets_wrong(run_on_ranks):
    out = run_on_ranks(4, group_norm_input_grads, 4)[0]
    assert out["forge_out"] <= 1e-5 and out["credit_out"] <= 1e-5  # both forwards look right
    assert out["forge_grad"] <= 1e-5, out
    assert out["credit_grad"] > 1e-2, out  # a plain all_reduce loses the cross-slab terms


class _Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)


class _Window(nn.Module):
    forge_domain_window_rows = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _refusal(model: nn.Module, x: torch.Tensor | None = None) -> str:
    from forge_mesh import build_device_mesh

    mesh = build_device_mesh({"domain": 2, "data": "none"}, "cpu")
    try:
        apply_domain_parallel(model, mesh)
        if x is not None:
            model(x)
    except ForgeConfigError as e:
        return str(e)
    return "no error"


def test_layers_that_cannot_be_split_are_refused_by_name(run_on_ranks):
    msgs = run_on_ranks(2, _refusal, _Pooled())
    assert "'pool' (MaxPool2d)" in msgs[0]
    shrinking = nn.Sequential(nn.Conv2d(3, 3, 3))  # no padding: maps H to H - 2
    msg = run_on_ranks(2, _refusal, shrinking, torch.randn(1, 3, 4, 4))[0]
    assert "'0' (kernel (3, 3), stride (1, 1), padding (0, 0)) maps height 8 to 6" in msg
    reflect = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"))
    assert "padding_mode='reflect'" in run_on_ranks(2, _refusal, reflect)[0]
    windows = nn.Sequential(nn.Conv2d(3, 3, 1), _Window())
    msg = run_on_ranks(2, _refusal, windows, torch.randn(1, 3, 6, 4))[0]
    assert "windows of 4 rows, which do not tile a height slab of 6 rows" in msg
    assert (
        "nothing for domain parallelism to split" in run_on_ranks(2, _refusal, nn.Linear(4, 4))[0]
    )


def test_width_circular_conv_wraps_width_and_zero_pads_height():
    conv = WidthCircularConv2d(1, 1, 3, padding=1, bias=False)
    with torch.no_grad():
        conv.weight.fill_(1.0)
    x = torch.zeros(1, 1, 3, 4)
    x[0, 0, 1, 0] = 1.0  # left edge: spreads to the right edge too, not past the top/bottom
    out = conv(x)[0, 0]
    assert out[:, 3].tolist() == [1.0, 1.0, 1.0] and out[:, 2].tolist() == [0.0, 0.0, 0.0]

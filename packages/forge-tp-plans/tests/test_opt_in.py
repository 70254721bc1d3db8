"""CREDIT-style opt-in: blocks declaring _tp_col / _tp_row (Linear, 1x1 Conv2d, paths into
Sequentials, lists) match the unsharded model under TP=2, with a bias on the row-parallel layer."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from forge_core import ForgeConfigError
from forge_core.testing import StepRecord, compare_runs
from forge_core.training import global_grad_norm
from forge_mesh import build_device_mesh
from forge_tp_plans import applied_tp_plan, apply_tensor_parallel


class ConvMLP(nn.Module):
    _tp_col = ["proj_up"]
    _tp_row = "proj_out"

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(1, channels)
        self.proj_up = nn.Conv2d(channels, 4 * channels, 1)
        self.proj_out = nn.Conv2d(
            4 * channels, channels, 1
        )  # bias: added once, after the reduction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj_out(F.gelu(self.proj_up(self.norm(x))))


class TokenMLP(nn.Module):
    _tp_col = "layers.0"
    _tp_row = "layers.2"

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layers(x)


class CreditNet(nn.Module):
    """A stem before the TP blocks: its gradient is wrong unless the column inputs all-reduce."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.conv_blocks = nn.ModuleList(ConvMLP(channels) for _ in range(2))
        self.token_block = TokenMLP(channels)
        self.head = nn.Conv2d(channels, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.conv_blocks:
            h = block(h)
        B, C, H, W = h.shape
        h = self.token_block(h.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(B, C, H, W)
        return self.head(h)


def _train(model: nn.Module, steps: int = 5) -> list[StepRecord]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 2, 6, 6, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    records = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        records.append(StepRecord(float(loss), float(global_grad_norm(list(model.parameters())))))
        opt.step()
        opt.zero_grad()
    return records


def _credit_parity():
    torch.manual_seed(0)
    reference = CreditNet()
    parallel = copy.deepcopy(reference)
    apply_tensor_parallel(parallel, build_device_mesh({"tp": 2, "data": "none"}, "cpu"))
    styles = applied_tp_plan(parallel).styles
    return (
        compare_runs(_train(reference), _train(parallel)),
        applied_tp_plan(parallel).source,
        styles,
    )


def test_credit_style_model_matches_under_tp2(run_on_ranks):
    result, source, styles = run_on_ranks(2, _credit_parity)[0]
    result.assert_ok()
    assert source == "opt-in attributes"
    assert styles == {
        "conv_blocks.0.proj_up": "ColwiseConv1x1",
        "conv_blocks.0.proj_out": "RowwiseConv1x1",
        "conv_blocks.1.proj_up": "ColwiseConv1x1",
        "conv_blocks.1.proj_out": "RowwiseConv1x1",
        "token_block.layers.0": "ColwiseParallel(in R -> out S(-1))",
        "token_block.layers.2": "RowwiseParallel(in S(-1) -> out R)",
    }


class _Bad3x3(nn.Module):
    _tp_col = "conv"

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3)


class _BadEmbedding(nn.Module):
    _tp_row = "emb"

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 4)


class _BadPath(nn.Module):
    _tp_col = "layers.5"

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4))


def _opt_in_errors() -> list[str]:
    mesh = build_device_mesh({"tp": 2, "data": "none"}, "cpu")
    out = []
    for model in (
        nn.Sequential(_Bad3x3()),
        nn.Sequential(_BadEmbedding()),
        nn.Sequential(_BadPath()),
    ):
        try:
            apply_tensor_parallel(model, mesh)
            out.append("no error")
        except ForgeConfigError as e:
            out.append(str(e))
    return out


def test_unsupported_opt_in_leaves_are_refused_with_path_and_type(run_on_ranks):
    bad_conv, bad_emb, bad_path = run_on_ranks(2, _opt_in_errors)[0]
    assert "'0.conv'" in bad_conv and "only nn.Linear and 1x1 nn.Conv2d" in bad_conv
    assert "'0.emb' is a Embedding" in bad_emb
    assert "'0.layers.5' is not a submodule" in bad_path


def _half_applicable_plan() -> tuple[str, bool]:
    """An explicit plan whose second entry cannot apply (colwise on a Conv2d)."""
    from torch.distributed.tensor import DTensor

    mesh = build_device_mesh({"tp": 2, "data": "none"}, "cpu")
    model = nn.Sequential(nn.Linear(4, 4), nn.Conv2d(4, 4, 1))
    try:
        apply_tensor_parallel(model, mesh, plan={"0": "colwise", "1": "colwise"})
        message = "no error"
    except ForgeConfigError as e:
        message = str(e)
    return message, isinstance(model[0].weight, DTensor)


def test_a_plan_entry_that_cannot_apply_is_refused_before_anything_is_split(run_on_ranks):
    message, split = run_on_ranks(2, _half_applicable_plan)[0]
    assert message.startswith("tp plan entry '1' gives ColwiseParallel to a Conv2d"), message
    assert "nothing was split" in message
    assert not split  # the Linear before it is untouched

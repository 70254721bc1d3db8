"""Rank functions of the Float8 tests that build through forge's build_parallel_model or compose
forge_float8 with forge_tp_plans (module level so the rank pool can pickle them)."""

from __future__ import annotations

import torch
import torch.nn as nn
from forge.build import build_parallel_model
from forge_core import ModelConfig
from forge_core.testing import StepRecord, train_steps
from forge_core.training import synthetic_tokens
from forge_float8 import use_torch_cpu_fp8_kernels
from forge_mesh import build_device_mesh
from forge_moe_ep.config import MoEModelConfig

STEPS, BATCH, SEQ = 10, 8, 32


def train(
    layout: dict | None,
    preset: str = "debug",
    fp8: bool = False,
    report: list | None = None,
    **plan: object,
) -> list[StepRecord]:
    """10 bf16-compute steps of ``preset`` under ``layout`` (None: single device)."""
    cfg = MoEModelConfig.preset(preset, dim=128, ffn_dim=256, n_heads=8, n_kv_heads=4)
    mesh = (
        None
        if layout is None
        else build_device_mesh(layout, "cpu", num_experts=cfg.num_experts if cfg.moe_layers else 0)
    )
    model = build_parallel_model(cfg, "cpu", mesh, param_dtype=torch.bfloat16, fp8=fp8, **plan)
    if report is not None:
        from forge_float8 import float8_report

        report.append(str(float8_report(model)))
    tokens = synthetic_tokens(0, STEPS, BATCH, SEQ, cfg.vocab_size)
    return train_steps(model, tokens, mesh=mesh, lr=1e-3, device="cpu")


def fp8_and_bf16(layout: dict, preset: str = "debug", **plan: object) -> dict[str, list[float]]:
    """Loss curves of the same layout in bf16 and Float8, and Float8 on one device."""
    use_torch_cpu_fp8_kernels()  # the rank pool restores it after the job
    report: list[str] = []
    sp = {k: v for k, v in plan.items() if k == "sequence_parallel"}
    return {
        "bf16": [r.loss for r in train(layout, preset, **sp)],
        "fp8": [r.loss for r in train(layout, preset, fp8=True, report=report, **plan)],
        "report": report[0],
        "fp8_single": [
            r.loss
            for r in train(
                None, preset, fp8=True, **{k: v for k, v in plan.items() if k == "fp8_recipe"}
            )
        ],
    }


def all_gather_on_off_and_hook() -> dict[str, object]:
    """fp8 all-gather on vs off under FSDP2, and whether the scale precompute ran."""
    use_torch_cpu_fp8_kernels()  # the rank pool restores it after the job
    from forge_core.contracts import attach_optimizer_hooks
    from torchao.float8.float8_linear import Float8Linear

    on = [r.loss for r in train({"dp_shard": 4}, fp8=True, fp8_fsdp_all_gather=True)]
    off = [r.loss for r in train({"dp_shard": 4}, fp8=True, fp8_fsdp_all_gather=False)]
    cfg = ModelConfig.preset("debug", dim=128, ffn_dim=256, n_heads=8, n_kv_heads=4)
    mesh = build_device_mesh({"dp_shard": 4}, "cpu")
    scales = {}
    for hooked in (True, False):
        model = build_parallel_model(
            cfg, "cpu", mesh, param_dtype=torch.bfloat16, fp8=True, fp8_fsdp_all_gather=True
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        handle = attach_optimizer_hooks(model, opt) if hooked else None
        tokens = synthetic_tokens(0, 1, 8, 17, cfg.vocab_size)[0].chunk(4)[mesh.get_rank()]
        torch.nn.functional.cross_entropy(
            model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten()
        ).backward()
        opt.step()
        if handle is not None:
            handle.remove()
        scales[hooked] = [
            getattr(m.weight._local_tensor, "_precomputed_scale", None) is not None
            for m in model.modules()
            if isinstance(m, Float8Linear)
        ]
    return {"on": on, "off": off, "scales": scales}


class _Attention(nn.Module):
    """A parent with a prepared input, two column-parallel Linears and a row-parallel one."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(64, 64, bias=False)
        self.wk = nn.Linear(64, 64, bias=False)
        self.wo = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.relu(self.wq(x)) * self.wk(x))


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x)


def parent_input_restyled_to_fp8() -> dict[str, object]:
    """TP with a ``PrepareModuleInput`` parent, then Float8 tensorwise with fp8 TP styles.

    The parent's input layouts are Replicate -> Replicate, so nothing float8 is all-gathered
    and gloo runs it; ``dist.get_backend`` reads "nccl" while ``apply_float8`` decides, the
    group on which torchao's ``PrepareFloat8ModuleInput`` would be chosen. Returns the styles
    carried over, what the parent's hooks hand its children before and after Float8, the
    outputs and gradients next to the plain-style run, and the refusals of ``restyle_tp``.
    """
    from unittest import mock

    import torch.distributed as dist
    from forge_core.contracts import restyle_tp
    from forge_float8 import apply_float8, float8_report
    from forge_tp_plans import apply_tensor_parallel
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

    mesh = build_device_mesh({"tp": 2, "data": "none"}, "cpu")
    plan = {
        "attention": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
    }
    x = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(0))
    out: dict[str, object] = {}
    runs = {}
    for fp8_styles in (True, False):
        torch.manual_seed(0)
        model = _Tiny()
        apply_tensor_parallel(model, mesh, plan=plan, sequence_parallel=False)
        seen: list[str] = []

        def look(_: nn.Module, args: tuple, seen: list[str] = seen) -> None:
            arg = args[0]
            kind = "fp8" if tensor_already_casted_to_fp8(arg) else "hp"
            seen.append(f"{type(arg).__name__}:{kind}")

        if fp8_styles:
            model.attention.register_forward_pre_hook(look)  # runs after TP's input stand-in
            model(x)
        with mock.patch.object(dist, "get_backend", lambda group=None: "nccl"):
            apply_float8(
                model,
                enable_fsdp_float8_all_gather=False,
                tp_float8_all_gather=fp8_styles,
            )
        y = model(x.clone().requires_grad_())
        y.sum().backward()
        runs[fp8_styles] = (
            y.detach(),
            model.attention.wq.weight.grad.to_local().clone(),
            float8_report(model).tp_styles,
        )
        if fp8_styles:
            out["seen"] = seen
            try:
                restyle_tp(model, "attention", ColwiseParallel())
            except ValueError as err:
                out["slot_refusal"] = str(err)
            try:
                restyle_tp(model, "attention.wq", ColwiseParallel())
            except ValueError as err:
                out["same_object_refusal"] = str(err)
            out["linears"] = sorted(type(m).__name__ for m in model.attention.children())
            out["is_dtensor"] = isinstance(model.attention.wq.weight, DTensor)
            out["modules"] = [name for name, _ in model.named_modules()]  # no stand-in among them
    out["styles"] = runs[True][2]
    out["plain_styles"] = runs[False][2]
    out["out_diff"] = (runs[True][0] - runs[False][0]).abs().max().item()
    out["out_scale"] = runs[False][0].abs().max().item()
    out["grad_diff"] = (runs[True][1] - runs[False][1]).abs().max().item()
    out["grad_scale"] = runs[False][1].abs().max().item()
    return out

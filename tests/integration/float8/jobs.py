"""Rank functions of the Float8 tests that build through forge's build_parallel_model (module
level so the rank pool can pickle them; forge_float8's own: tests/float8/jobs.py)."""

from __future__ import annotations

import torch
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

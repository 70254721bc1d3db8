"""Rank functions of the pipeline tests (module level, so the rank pool can pickle them)."""

from __future__ import annotations

from typing import Any

import torch
from forge.build import ParallelPlan
from forge_core import ModelConfig, Transformer
from forge_core.testing import ParityResult, compare_runs, train_steps
from forge_core.training import synthetic_tokens
from forge_mesh import build_device_mesh
from forge_moe_ep import moe_transformer
from forge_moe_ep.config import MoEModelConfig
from forge_pp import PPConfig


def meta_model(moe: bool, **model: Any) -> tuple[torch.nn.Module, ModelConfig]:
    """forge's debug Transformer (``moe``: the debug MoE one) on meta, with its config."""
    if moe:
        cfg: ModelConfig = MoEModelConfig.preset("debug_moe", **model)
        with torch.device("meta"):
            return moe_transformer(cfg), cfg
    cfg = ModelConfig.preset("debug", **model)
    with torch.device("meta"):
        return Transformer(cfg), cfg


def pipeline_parity(
    layout: dict[str, Any],
    *,
    pp: dict[str, Any] | None = None,
    moe: bool = False,
    ac_mode: str = "none",
    steps: int = 10,
    batch_size: int = 8,
    model: dict[str, Any] | None = None,
    reference_grad_accum: int = 1,
) -> ParityResult:
    """A pipelined model (``layout`` has pp) against the same model on one device, fp32."""
    model_args = {"n_layers": 4, **(model or {})}
    parallel_model, cfg = meta_model(moe, **model_args)
    reference_model, _ = meta_model(moe, **model_args)
    experts = getattr(cfg, "num_experts", 0) if moe else 0
    mesh = build_device_mesh(layout, "cpu", num_experts=experts)
    tp = layout.get("tp", 1) > 1
    plan = ParallelPlan(
        mesh,
        ac_mode=ac_mode,
        param_dtype=torch.float32,
        sequence_parallel=False if tp else None,
        pp=PPConfig(**(pp or {})),
    )
    parallel = plan.parallelize(parallel_model, device="cpu", seed=0)
    reference = ParallelPlan(None, param_dtype=torch.float32).parallelize(
        reference_model, device="cpu", seed=0
    )
    tokens = synthetic_tokens(0, steps, batch_size, 16, cfg.vocab_size)
    ref = train_steps(reference, tokens, grad_accum=reference_grad_accum)
    par = train_steps(parallel, tokens, mesh=mesh)
    return compare_runs(ref, par)


def rank_model_facts(layout: dict[str, Any], pp: dict[str, Any]) -> dict[str, Any]:
    """What one rank holds after the split: its parameter names, blocks and stage order."""
    from forge_core import applied_stages

    model, _ = meta_model(False, n_layers=4)
    mesh = build_device_mesh(layout, "cpu")
    plan = ParallelPlan(mesh, param_dtype=torch.float32, pp=PPConfig(**pp))
    rank_model = plan.parallelize(model, device="cpu", seed=0)
    try:
        rank_model(torch.zeros(2, 4, dtype=torch.long))
        called = "ran"
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        called = f"{type(e).__name__}: {e}"
    return {
        "names": sorted(rank_model.state_dict()),
        "blocks": sorted(rank_model.layers.keys()),
        "stages": applied_stages(rank_model),
        "call": called,
        "meta": any(t.is_meta for t in (*rank_model.parameters(), *rank_model.buffers())),
    }


def vlm_pipeline_parity(
    layout: dict[str, Any], *, pp: dict[str, Any], steps: int = 6, **plan: Any
) -> ParityResult:
    """A vision-language model with its decoder pipelined (encoder and adapter on stage 0)."""
    from forge.build import build_meta_model

    from tests.integration.vlm.jobs import build_pair, vlm_config, vlm_data

    cfg = vlm_config()
    mesh = build_device_mesh(layout, "cpu")
    parallel = ParallelPlan(
        mesh, param_dtype=torch.float32, vlm=cfg.vlm, pp=PPConfig(**pp), **plan
    ).parallelize(build_meta_model(cfg.decoder, *cfg.vlm_sections()), device="cpu", seed=0)
    _, _, reference = build_pair(None, cfg)
    tokens, images = vlm_data(reference, steps, cfg)
    common = {"images": images, "ignore_token": reference.image_token_id}
    return compare_runs(
        train_steps(reference, tokens, **common), train_steps(parallel, tokens, mesh=mesh, **common)
    )


def api_refusals(schedule: str, stages_per_rank: int) -> dict[str, Any]:
    """What ParallelPlan says of ``[pp]`` settings, and pipeline_split of a model that holds
    values (2 ranks, pp=2); whether that model still has all its blocks afterwards."""
    from forge_core import ForgeConfigError
    from forge_pp import pipeline_split

    mesh = build_device_mesh({"pp": 2}, "cpu")
    pp = PPConfig(schedule=schedule, stages_per_rank=stages_per_rank)
    said: dict[str, Any] = {}
    try:
        ParallelPlan(mesh, param_dtype=torch.float32, pp=pp)
        said["plan"] = "made"
    except ForgeConfigError as e:
        said["plan"] = str(e)
    model = Transformer(ModelConfig.preset("debug", n_layers=4))  # on the CPU: holds values
    try:
        pipeline_split(model, mesh, PPConfig())
        said["split"] = "cut"
    except ForgeConfigError as e:
        said["split"] = str(e)
    said["blocks"] = sorted(model.layers.keys())
    return said

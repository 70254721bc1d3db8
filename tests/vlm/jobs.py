"""Rank functions of the VLM tests (module-level so the rank pool can pickle them)."""

from __future__ import annotations

from typing import Any

import torch
from forge.build import build_parallel_model
from forge_core import load_config
from forge_core.stages import applied_stages
from forge_core.training import compare_runs, synthetic_vlm_batch, train_steps
from forge_mesh import build_device_mesh
from torch.distributed.fsdp import FSDPModule

SEQ_LEN = 32
BATCH = 8


def vlm_config(vlm: dict | None = None, vision: dict | None = None, adapter: dict | None = None):
    return load_config(
        {
            "model": {"preset": "debug_vlm"},
            "vlm": vlm or {},
            "vision": vision or {},
            "adapter": adapter or {},
        }
    )


def vlm_data(model: torch.nn.Module, steps: int, cfg: Any, seed: int = 0):
    v = cfg.vision
    return synthetic_vlm_batch(
        seed,
        steps,
        BATCH,
        SEQ_LEN,
        cfg.model.vocab_size,
        image_token_id=model.image_token_id,
        image_tokens=model.image_tokens,
        image_shape=(v.in_channels, v.image_size, v.image_size),
    )


def build_pair(layout: dict | None, cfg: Any, **kwargs: Any):
    mesh = build_device_mesh(layout, "cpu") if layout else None
    parts = {"vision_config": cfg.vision, "adapter_config": cfg.adapter, "vlm_config": cfg.vlm}
    kwargs.setdefault("param_dtype", torch.float32)
    parallel = build_parallel_model(cfg.model, "cpu", mesh, **parts, **kwargs)
    reference = build_parallel_model(cfg.model, "cpu", None, **parts, param_dtype=torch.float32)
    return mesh, parallel, reference


def vlm_parity(
    layout: dict,
    *,
    vlm: dict | None = None,
    vision: dict | None = None,
    adapter: dict | None = None,
    steps: int = 8,
    grad_accum: int = 1,
    **kwargs: Any,
) -> dict[str, Any]:
    """Train the parallel VLM and the single-device one on the same data; report what was built."""
    cfg = vlm_config(vlm, vision, adapter)
    mesh, parallel, reference = build_pair(layout, cfg, **kwargs)
    tokens, images = vlm_data(parallel, steps, cfg)
    common = {"images": images, "ignore_token": parallel.image_token_id}
    ref = train_steps(reference, tokens, **common)
    par = train_steps(parallel, tokens, mesh=mesh, grad_accum=grad_accum, **common)
    units = [n or "<root>" for n, m in parallel.named_modules() if isinstance(m, FSDPModule)]
    return {
        "result": compare_runs(ref, par),
        "units": units,
        "stages": {
            name: applied_stages(part)
            for name, part in (("encoder", parallel.encoder), ("decoder", parallel.decoder))
        },
        "encoder_grads": [p.grad is not None for p in parallel.encoder.parameters()],
        "encoder_dtensor": [
            type(p).__name__ == "DTensor" for p in parallel.encoder.parameters()
        ],
        "checkpointed": sorted(
            {n.split(".")[0] for n, _ in parallel.named_modules() if "_checkpoint_wrapped" in n}
        ),
    }

"""Rank functions of the VLM tests (module-level so the rank pool can pickle them)."""

from __future__ import annotations

from typing import Any

import torch
from forge import load_config
from forge.build import build_parallel_model
from forge_core.stages import applied_stages, unwrap
from forge_core.testing import compare_runs, train_steps
from forge_core.training import local_batch
from forge_mesh import build_device_mesh
from forge_tp_plans import describe_tp_plan
from forge_vlm.data import synthetic_vlm_batch
from torch.distributed.fsdp import FSDPModule

SEQ_LEN = 32
BATCH = 8


def vlm_config(
    vlm: dict | None = None,
    vision: dict | None = None,
    adapter: dict | None = None,
    model: dict | None = None,
):
    return load_config(
        {
            "model": model or {"preset": "debug_vlm"},
            "vlm": vlm or {},
            "vision": vision or {},
            "adapter": adapter or {},
        }
    )


def vlm_data(
    model: torch.nn.Module,
    steps: int,
    cfg: Any,
    seed: int = 0,
    batch: int = BATCH,
    seq_len: int = SEQ_LEN,
):
    v = cfg.vision
    return synthetic_vlm_batch(
        seed,
        steps,
        batch,
        seq_len,
        cfg.model.vocab_size,
        image_token_id=model.image_token_id,
        image_tokens=model.image_tokens,
        image_shape=(v.in_channels, v.image_size, v.image_size),
    )


def build_pair(layout: dict | None, cfg: Any, **kwargs: Any):
    mesh = build_device_mesh(layout, "cpu") if layout else None
    parts = {"vision_config": cfg.vision, "adapter_config": cfg.adapter, "vlm_config": cfg.vlm}
    kwargs.setdefault("param_dtype", torch.float32)
    parallel = build_parallel_model(cfg.decoder, "cpu", mesh, **parts, **kwargs)
    reference = build_parallel_model(cfg.decoder, "cpu", None, **parts, param_dtype=torch.float32)
    return mesh, parallel, reference


def vlm_parity(
    layout: dict,
    *,
    vlm: dict | None = None,
    vision: dict | None = None,
    adapter: dict | None = None,
    model: dict | None = None,
    steps: int = 5,
    grad_accum: int = 1,
    **kwargs: Any,
) -> dict[str, Any]:
    """Train the parallel VLM and the single-device one on the same data; report what was built."""
    cfg = vlm_config(vlm, vision, adapter, model)
    mesh, parallel, reference = build_pair(layout, cfg, **kwargs)
    inner = unwrap(parallel)  # under DDP
    tokens, images = vlm_data(inner, steps, cfg)
    common = {"images": images, "ignore_token": inner.image_token_id}
    ref = train_steps(reference, tokens, **common)
    par = train_steps(parallel, tokens, mesh=mesh, grad_accum=grad_accum, **common)
    units = [n or "<root>" for n, m in parallel.named_modules() if isinstance(m, FSDPModule)]
    # One more forward + backward to see which parameters get gradients.
    local = local_batch(tokens[0], mesh)
    logits = parallel(local[:, :-1], local_batch(images[0], mesh))
    logits.float().sum().backward()
    return {
        "result": compare_runs(ref, par),
        "units": units,
        "stages": {
            name: applied_stages(part)
            for name, part in (("encoder", inner.encoder), ("decoder", inner.decoder))
        },
        "encoder_grads": [p.grad is not None for p in inner.encoder.parameters()],
        "encoder_meshes": sorted(
            {
                str(getattr(p, "device_mesh", None) and p.device_mesh.mesh_dim_names)
                for p in inner.encoder.parameters()
            }
        ),
        "encoder_plan": describe_tp_plan(inner.encoder),
        "decoder_plan": describe_tp_plan(inner.decoder),
        "checkpointed": sorted(
            {n.split(".")[0] for n, _ in parallel.named_modules() if "_checkpoint_wrapped" in n}
        ),
    }


def bf16_hand_off(layout: dict, *, cast_forward_inputs: bool, vlm: dict | None = None) -> dict:
    """One bf16 FSDP2 training step with fp32 images; record the dtypes crossing each boundary.

    Hooks: ``before`` runs ahead of FSDP2's pre-forward (what the caller passes), ``after``
    behind it (what the unit computes with).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    cfg = vlm_config(vlm)
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        cast_forward_inputs=cast_forward_inputs,
    )
    mesh, model, _ = build_pair(layout, cfg, mp_policy=mp, param_dtype=torch.bfloat16)
    seen: dict[str, str] = {}

    def record(tag: str):
        def hook(module, args):
            floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            seen[tag] = str(floats[0].dtype) if floats else "none"

        return hook

    for name in ("root", "encoder", "adapter", "decoder"):
        part = model if name == "root" else getattr(model, name)
        part.register_forward_pre_hook(record(f"{name} before"), prepend=True)
        part.register_forward_pre_hook(record(f"{name} after"))
    tokens, images = vlm_data(model, 1, cfg)
    try:
        records = train_steps(
            model, tokens, mesh=mesh, images=images, ignore_token=model.image_token_id
        )
    except RuntimeError as e:
        return {"error": str(e).splitlines()[0], "seen": seen}
    return {"loss": records[0].loss, "seen": seen, "image_dtype": str(images.dtype)}


def encoder_mlp_only(model, ctx) -> dict:
    """An encoder plan of the test's own (imported by path): split only the ViT MLPs."""
    return {"layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"}


def fp8_and_bf16_vlm(layout: dict, steps: int = 10) -> dict[str, Any]:
    """Loss curves of the VLM in bf16 and with a Float8 decoder, and the Float8 report."""
    from forge_float8 import float8_report, use_torch_cpu_fp8_kernels

    use_torch_cpu_fp8_kernels()  # the rank pool restores it after the job

    cfg = vlm_config()
    mesh = build_device_mesh(layout, "cpu")
    parts = {"vision_config": cfg.vision, "adapter_config": cfg.adapter, "vlm_config": cfg.vlm}
    out: dict[str, Any] = {}
    for fp8 in (False, True):
        model = build_parallel_model(
            cfg.decoder, "cpu", mesh, **parts, param_dtype=torch.bfloat16, fp8=fp8
        )
        tokens, images = vlm_data(model, steps, cfg)
        records = train_steps(
            model, tokens, mesh=mesh, images=images, ignore_token=model.image_token_id
        )
        out["fp8" if fp8 else "bf16"] = [r.loss for r in records]
        if fp8:
            out["report"] = str(float8_report(model.decoder))
            out["stages"] = applied_stages(model.decoder)
    return out

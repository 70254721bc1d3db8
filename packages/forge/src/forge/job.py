"""The ``forge build`` job: build the parallel model, train a few steps, prove parity, report.

Runs on every rank (under forge's own launcher or torchrun/SLURM). Each rank also builds the
single-device reference model (same seed) and trains it on the whole global batch, so parity is
checked without a separate run. Rank 0 returns the report.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core import (
    ORDER_TEXT,
    ParallelismConfig,
    applied_stages,
    count_host_syncs,
)
from forge_core.mesh_dims import sub_mesh
from forge_core.stages import unwrap
from forge_core.testing import compare_runs, train_steps
from forge_core.torch_compat import inductor_cache_dir
from forge_core.training import forward_backward, local_batch, synthetic_tokens
from forge_float8 import float8_report, use_torch_cpu_fp8_kernels
from forge_mesh import build_device_mesh, init_distributed, mesh_layout
from forge_moe_ep import moe_metrics
from forge_pp import pipeline_stages
from forge_tp_plans import describe_tp_plan, tp_gradient_mismatches
from forge_vlm import VLMWrapper, ac_components, num_image_tokens
from forge_vlm.data import synthetic_vlm_batch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .build import ParallelPlan, model_from_config
from .checks import check_config
from .config import ForgeConfig, load_config
from .layout import Layout, resolve_layout

__all__ = ["BuildReport", "check_config", "run_build", "tp_description"]


@dataclass(frozen=True)
class BuildReport:
    text: str
    passed: bool


def _vlm_wrapper(model: nn.Module) -> VLMWrapper:
    """The ``forge_vlm.VLMWrapper`` inside a VLM config's model (DDP / compile unwrapped)."""
    # NOTE: only called when cfg.is_vlm, whose model_from_config is build_vlm's VLMWrapper
    # (FSDP2 swaps in a subclass); unwrap is typed nn.Module only.
    return cast(VLMWrapper, unwrap(model))


def _vlm_report(cfg: ForgeConfig, par: ParallelismConfig, model: nn.Module) -> list[str]:
    """The VLM lines of the report: parts, image tokens, what is frozen, TP per component."""
    if not cfg.is_vlm:
        return []
    v, a, vlm = cfg.vlm_sections()
    wrapper = _vlm_wrapper(model)
    encoder = wrapper.encoder
    if not vlm.freeze_encoder:
        state = "trainable, FSDP2 per block"
    elif any(isinstance(m, FSDPModule) for m in encoder.modules()):
        state = "frozen, FSDP2-sharded (no gradients, no optimizer state)"
    else:
        state = "frozen, replicated outside FSDP2 (no gradients, no optimizer state)"
    ac_mode = cfg.training.ac_mode
    ac = (
        "no AC"
        if ac_mode == "none"
        else f"AC {ac_mode} (scope {vlm.ac_scope}) on "
        + " and ".join(ac_components(vlm.ac_scope, vlm.freeze_encoder))
    )
    lines = [
        f"vlm:    {vlm.design} decoder; {v.backend} encoder {v.n_layers} layers x dim {v.dim} on "
        f"{v.image_size}px images ({v.grid}x{v.grid} patches of {v.patch_size}px) -> adapter "
        f"(pool {a.pool}) -> {num_image_tokens(v, a)} image tokens at placeholder id "
        f"{wrapper.image_token_id}; encoder {state}; {ac}",
        "        per component: "
        + "; ".join(
            f"{name} {' -> '.join(applied_stages(part)) or '(none)'}"
            for name, part in (("encoder", encoder), ("decoder", wrapper.decoder))
        ),
    ]
    if par.tp > 1:
        lines.append("tp:     decoder " + tp_description(wrapper.decoder, par))
        if vlm.encoder_tp:
            lines.append("tp:     encoder " + describe_tp_plan(encoder))
    return lines


def _decoder(model: nn.Module) -> nn.Module:
    """The language model: a VLM's decoder, else the model itself."""
    return getattr(unwrap(model), "decoder", model)


def tp_description(model: nn.Module, par: ParallelismConfig) -> str:
    """The ``tp:`` line of forge build's and forge train's reports: the decoder's applied plan;
    under pp, each of this rank's stages' (basic TP: no sequence or loss parallelism)."""
    stages = pipeline_stages(unwrap(model))
    if not stages:
        return describe_tp_plan(_decoder(model))
    return "\n".join(
        f"stage {index}: {describe_tp_plan(_decoder(stage))}" for index, stage in stages
    )


def _float8_text(model: nn.Module) -> str:
    """The float8 line of the report: what ``apply_float8`` converted and skipped (per stage
    under pp, where each stage module was converted on its own)."""
    stages = pipeline_stages(unwrap(model))
    if not stages:
        return str(float8_report(_decoder(model)))
    return "\n".join(f"stage {index}: {float8_report(_decoder(stage))}" for index, stage in stages)


def _param_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def _count_step_syncs(
    model: nn.Module, batch: torch.Tensor, device: torch.device, mesh: DeviceMesh
) -> str:
    """Host syncs of one forward + backward (what a GPU would wait for), as a short text.

    The step is the training step itself (``forward_backward``): a pipelined rank model runs
    its schedule over every micro-batch (the count is of this rank's stages), a context-parallel
    one its sequence shards."""
    with count_host_syncs(device) as counter:
        forward_backward(model, batch, mesh=mesh)
    model.zero_grad(set_to_none=True)
    ops = ", ".join(f"{op} x{n}" for op, n in sorted(counter.ops.items()))
    return f"{counter.count}" + (f" ({ops})" if ops else "")


def _tp_gradient_report(model: nn.Module, batch: torch.Tensor, mesh: DeviceMesh) -> list[str]:
    """Replicated-over-tp parameters whose gradients differ across the tp ranks after one more
    forward + backward (``forge_tp_plans.tp_gradient_mismatches``; every rank takes part): a
    plan that leaves a parameter replicated where each rank sees only its part of the features
    trains silently wrong. Empty when they all agree."""
    forward_backward(model, batch, mesh=mesh)
    found = tp_gradient_mismatches(model, mesh)
    model.zero_grad(set_to_none=True)
    return found


def _moe_report(
    cfg: ForgeConfig,
    par: ParallelismConfig,
    model: nn.Module,
    batch: torch.Tensor,
    device: torch.device,
    mesh: DeviceMesh,
) -> str | None:
    """The MoE line of the report (every rank takes part: the counted step runs collectives)."""
    if not cfg.decoder.moe_layers:
        return None
    metrics = moe_metrics(model)  # read before the counted step adds to them
    if par.pp > 1:  # each pipeline rank holds its stages' MoE layers: the pipeline's sum
        counts = torch.tensor(
            [metrics["moe_layers"], metrics["tokens_routed"], metrics["tokens_dropped"]],
            dtype=torch.int64,
            device=device,
        )
        dist.all_reduce(counts, group=sub_mesh(mesh, "pp").get_group())
        keys = ("moe_layers", "tokens_routed", "tokens_dropped")
        metrics = {**metrics, **dict(zip(keys, counts.tolist(), strict=True))}
    syncs = _count_step_syncs(model, batch, device, mesh)
    m = cfg.decoder
    return (
        f"moe:    {metrics['moe_layers']} MoE layers x {m.num_experts} experts (top-{m.top_k}), "
        f"ep={par.ep} ({m.num_experts // par.ep} experts per rank), dispatch {m.moe_dispatch}; "
        f"tokens dropped {metrics['tokens_dropped']} of {metrics['tokens_routed']} routed in "
        f"{cfg.training.steps} steps; host syncs "
        f"counted in one forward+backward: {syncs} (rank 0)"
    )


def setup_rank(cfg: ForgeConfig, device_type: str) -> tuple[int, torch.device, Layout, DeviceMesh]:
    """A rank's start: resolve the layout (once: every later step gets this value), check the
    config, join the process group, pick the device, build the mesh.

    Returns ``(rank, device, layout, mesh)``.
    """
    world_size = (
        dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    )
    layout = resolve_layout(cfg, world_size, device_type=device_type)
    check_config(cfg, layout)
    if device_type == "cpu" and "LOCAL_WORLD_SIZE" in os.environ:  # local ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    if device_type == "cpu" and layout.float8:
        use_torch_cpu_fp8_kernels()  # oneDNN's CPU fp8 GEMM is a slow reference kernel here
    init_distributed(device_type)
    rank = dist.get_rank()
    if cfg.training.compile and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # NOTE: inductor's on-disk cache is keyed without the process-group names that compiled
        # collectives bake in (they differ between ranks), so ranks sharing one cache can load
        # each other's code and fail (pytorch #189330 family). One cache per rank avoids it.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(inductor_cache_dir(), f"rank{rank}")
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    return rank, device, layout, build_device_mesh(layout.parallelism, device_type)


def run_build(cfg_dict: dict[str, Any], device_type: str = "cpu") -> BuildReport:
    """One rank's part of ``forge build``: every rank returns the verdict, rank 0 also the text."""
    start = time.perf_counter()
    cfg = load_config(cfg_dict)
    rank, device, layout, mesh = setup_rank(cfg, device_type)
    world_size, par = layout.world_size, layout.parallelism
    t = cfg.training
    dtype = getattr(torch, t.param_dtype)
    plan = ParallelPlan.from_config(cfg, mesh, layout=layout)  # the one config -> plan mapping
    data = plan.data
    model = plan.parallelize(model_from_config(cfg), device=device, seed=t.seed)
    model = plan.maybe_compile(model)
    # NOTE: with Float8 the reference is the same Float8 model on one device (bf16 compute when
    # asked): parity then isolates the parallelism from fp8's own rounding.
    # The reference: the same plan on one device, without AC or compile, fp32 unless Float8
    # asks for its own compute dtype (fp8 casts happen the same way in both).
    one_device = replace(
        plan,
        device_mesh=None,
        data="none",
        ac_mode="none",
        compile_model=False,
        cpu_offload=False,
        param_dtype=dtype if layout.float8 else torch.float32,
        float8=replace(cfg.float8, fsdp_float8_all_gather=False),
    )
    reference = one_device.parallelize(model_from_config(cfg), device=device, seed=t.seed)
    local_bytes = _param_bytes(model)
    all_bytes: list[int] = [0] * world_size
    dist.all_gather_object(all_bytes, local_bytes)
    vlm_batch: dict[str, Any] = {}
    if cfg.is_vlm:
        wrapper = _vlm_wrapper(reference)
        v = cfg.vlm_sections()[0]
        tokens, images = synthetic_vlm_batch(
            t.seed,
            t.steps,
            t.global_batch_size,
            t.seq_len,
            cfg.model.vocab_size,
            image_token_id=wrapper.image_token_id,
            image_tokens=wrapper.image_tokens,
            image_shape=(v.in_channels, v.image_size, v.image_size),
        )
        vlm_batch = {"images": images, "ignore_token": wrapper.image_token_id}
    else:
        tokens = synthetic_tokens(
            t.seed, t.steps, t.global_batch_size, t.seq_len, cfg.model.vocab_size
        )
    ref_steps = train_steps(reference, tokens, lr=t.lr, device=device, **vlm_batch)
    with warnings.catch_warnings():
        # NOTE: torch 2.15's FSDP2 warns whenever a unit returns a view, because an in-place op
        # on it would skip the pre-backward hook. forge's blocks only use out-of-place residual
        # adds, and the parity check below would catch a wrong gradient; the warning is noise.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        par_steps = train_steps(
            model, tokens, mesh=mesh, lr=t.lr, grad_accum=t.grad_accum, device=device, **vlm_batch
        )
        moe = (
            None
            if cfg.is_vlm
            else _moe_report(cfg, par, model, local_batch(tokens[0], mesh).to(device), device, mesh)
        )
        tp_grads = (
            _tp_gradient_report(model, local_batch(tokens[0], mesh).to(device), mesh)
            if par.tp > 1 and par.pp == 1 and not cfg.is_vlm
            else None
        )
    # Float8 rounds every GEMM input to 3 mantissa bits: low-precision tolerances.
    result = compare_runs(ref_steps, par_steps, torch.bfloat16 if layout.float8 else dtype)
    passed = result.passed and not tp_grads
    elapsed = time.perf_counter() - start
    if rank != 0:
        return BuildReport("", passed)
    full_bytes = _param_bytes(reference)
    names, sizes = mesh_layout(par, world_size)
    lines = [
        f"forge build: {world_size} rank(s) on {device_type}, {'VLM decoder' if cfg.is_vlm else 'model'} "
        f"{cfg.model.n_layers} layers x dim {cfg.model.dim} "
        f"({cfg.decoder.num_params():,} parameters), param_dtype {t.param_dtype}",
        "mesh:   "
        + " x ".join(f"{n}={s}" for n, s in zip(names, sizes, strict=True))
        + f"  (data={data})"
        + (
            f"; ep={par.ep} carved from {'dp_shard x cp' if par.cp > 1 else 'dp_shard'}: "
            f"dp_shard_mod_ep={par.dp_shard * par.cp // par.ep} x ep={par.ep}"
            if par.ep > 1
            else ""
        ),
        "stages: "
        + (" -> ".join(applied_stages(model)) or "(none)")
        + (" -> whole-model compile" if t.compile and t.compile_scope == "model" else "")
        + f"   (forge's order: {ORDER_TEXT})",
        *_vlm_report(cfg, par, model),
        f"params: unsharded {full_bytes:,} B; per rank "
        + ", ".join(f"r{r} {b:,} B ({b / full_bytes:.0%})" for r, b in enumerate(all_bytes)),
        *(["tp:     " + tp_description(model, par)] if par.tp > 1 and not cfg.is_vlm else []),
        *(
            []
            if tp_grads is None
            else [
                "tp grads: "
                + (
                    "FAIL: replicated parameters with gradients that differ across tp ranks: "
                    + "; ".join(tp_grads)
                    if tp_grads
                    else "every parameter replicated over tp has the same gradient on each tp rank"
                )
            ]
        ),
        *([moe] if moe else []),
        *([_float8_text(model)] if layout.float8 else []),
        f"train:  {t.steps} steps, global batch {t.global_batch_size} x seq {t.seq_len}, grad_accum {t.grad_accum}, AdamW lr {t.lr}",
        result.table(),
        f"{'PASS' if passed else 'FAIL'}: parallel run {'matches' if passed else 'does NOT match'} the single-device model "
        f"(rank 0 job time {elapsed:.1f}s)",
    ]
    return BuildReport("\n".join(lines), passed)

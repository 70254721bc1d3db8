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
from typing import Any

import torch
import torch.distributed as dist
from forge_core import (
    ORDER_TEXT,
    applied_stages,
)
from forge_core.testing import compare_runs, train_steps
from forge_core.torch_compat import inductor_cache_dir
from forge_core.training import local_batch
from forge_float8 import use_torch_cpu_fp8_kernels
from forge_mesh import build_device_mesh, init_distributed, mesh_layout
from torch.distributed.device_mesh import DeviceMesh

from .build import ParallelPlan, model_from_config
from .build_report import float8_text, param_bytes, tp_description
from .checks import check_config
from .config import ForgeConfig, load_config
from .kinds import model_kind
from .layout import Layout, resolve_layout

__all__ = ["BuildReport", "check_config", "run_build", "tp_description"]


@dataclass(frozen=True)
class BuildReport:
    text: str
    passed: bool


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
    data = plan.data_mode
    weights = model_kind(cfg).weights()  # a Hugging Face directory's, read sharded
    model = plan.parallelize(model_from_config(cfg), device=device, seed=t.seed, weights=weights)
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
    reference = one_device.parallelize(
        model_from_config(cfg), device=device, seed=t.seed, weights=weights
    )
    local_bytes = param_bytes(model)
    all_bytes: list[int] = [0] * world_size
    dist.all_gather_object(all_bytes, local_bytes)
    kind = model_kind(cfg)
    tokens, vlm_batch = kind.build_steps(reference)
    ref_steps = train_steps(reference, tokens, lr=t.lr, device=device, **vlm_batch)
    with warnings.catch_warnings():
        # NOTE: torch 2.15's FSDP2 warns whenever a unit returns a view, because an in-place op
        # on it would skip the pre-backward hook. forge's blocks only use out-of-place residual
        # adds, and the parity check below would catch a wrong gradient; the warning is noise.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        par_steps = train_steps(
            model, tokens, mesh=mesh, lr=t.lr, grad_accum=t.grad_accum, device=device, **vlm_batch
        )
        moe, tp_grads = kind.decoder_reports(
            model, local_batch(tokens[0], mesh).to(device), par, device, mesh
        )
    # Float8 rounds every GEMM input to 3 mantissa bits: low-precision tolerances.
    result = compare_runs(ref_steps, par_steps, torch.bfloat16 if layout.float8 else dtype)
    passed = result.passed and not tp_grads
    elapsed = time.perf_counter() - start
    if rank != 0:
        return BuildReport("", passed)
    full_bytes = param_bytes(reference)
    names, sizes = mesh_layout(par, world_size)
    lines = [
        f"forge build: {world_size} rank(s) on {device_type}, {kind.label} "
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
        *kind.part_lines(model, par),
        f"params: unsharded {full_bytes:,} B; per rank "
        + ", ".join(f"r{r} {b:,} B ({b / full_bytes:.0%})" for r, b in enumerate(all_bytes)),
        *kind.tp_lines(model, par),
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
        *([float8_text(model)] if layout.float8 else []),
        f"train:  {t.steps} steps, global batch {t.global_batch_size} x seq {t.seq_len}, grad_accum {t.grad_accum}, AdamW lr {t.lr}",
        result.table(),
        f"{'PASS' if passed else 'FAIL'}: parallel run {'matches' if passed else 'does NOT match'} the single-device model "
        f"(rank 0 job time {elapsed:.1f}s)",
    ]
    return BuildReport("\n".join(lines), passed)

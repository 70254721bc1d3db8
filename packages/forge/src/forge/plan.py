"""``forge plan``: what a layout costs on every rank, computed in one process without a GPU.

Provides :func:`plan_layout` (-> :class:`LayoutPlan`, :meth:`LayoutPlan.text`),
:func:`estimate_activations`, :func:`build_on_meta` and :func:`run_plan` (the CLI's entry); for
pipelines :class:`PipelinePlan`, :func:`estimate_pipeline_activations` and
:func:`build_stages_on_meta` (the schedules' action orders are forge-pp's
:func:`forge_pp.pipeline_actions`).

The model is built ONCE, as rank 0 of a ``fake`` process group of ``world_size`` ranks, on the
meta device by ``forge build``'s own ``build_parallel_model`` with no device, so nothing is
materialized (asserted). Every other rank's numbers are arithmetic:

- Parameters: each DTensor's global shape + placements + the rank's coordinate in the
  parameter's mesh, for every rank at once (forge-mesh's :func:`forge_mesh.per_rank.per_rank_bytes`,
  which says how ``Shard`` and FSDP2's ``_StridedShard`` chunk, and checks rank 0's arithmetic
  against the meta model's ``to_local()`` on every run). Bytes count as ``forge.job._param_bytes``
  does (unpadded); FSDP2 allocates the padded shard (``ceil(L/n)`` rows on every rank, even one
  holding nothing), shown as "padded".
- Gradients: the trainable shard, same bytes. AdamW: two float32 states per trainable element.
- Activations: :func:`estimate_activations` (formula in its docstring; the tests compare it with
  the tensors autograd saves on real runs).
- Collectives per training step, rank 0's view (every rank of a group moves the same bytes:
  FSDP2 all-gathers padded shards): FSDP2 from each unit's parameter groups (in param_dtype),
  TP/SP, EP, DDP and the per-step reductions from the config, for AC none or full (selective
  and op count as none). Float8's fp8 all-gather and amax reductions are not modelled.

Pipeline parallelism (``parallelism.pp > 1``): pipeline ranks hold different blocks, so the
model is built once per pipeline rank (:func:`build_stages_on_meta`: that rank's stage modules,
cut and parallelized as ``forge build`` does, on meta), still in the one process as rank 0.
Each rank's parameters, gradients and AdamW states are its own pipeline rank's stages' (the
same arithmetic, on the ranks of that pp coordinate); its activations the peak its schedule
holds at micro-batches of ``batch_per_rank / pp.microbatches``
(:func:`estimate_pipeline_activations`, the rule per schedule in its docstring); collectives
one table per pipeline rank: its stages' FSDP2 units (parameters gathered once per step: a
stage keeps them across micro-batches), TP and EP per micro-batch over its blocks, the
point-to-point sends and receives of activations and their gradients to the neighbouring
stages' ranks, and the pp reductions of the loss report and the gradient norm. The section
also gives each pipeline rank's stages and the schedule's theoretical bubble
(:func:`forge_pp.bubble_fraction`). Not modelled: torch's first-step shape inference (one more
forward and backward, and metadata sends).

Broken rules (every problem ``forge.checks.config_problems`` finds, then, when those are clean,
``forge.checks.import_problems``'s, and a ``ForgeConfigError`` from the build) are collected and
reported, not raised. ``plan_layout`` refuses to run where a process group exists, and destroys
the fake one it creates.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core import ForgeConfigError, ParallelismConfig, applied_stages
from forge_core.costs import Collective
from forge_core.errors import refuse
from forge_core.mesh_dims import axis_size, sub_mesh
from forge_mesh import build_device_mesh, mesh_layout
from forge_mesh.per_rank import (
    BYTE_KINDS,
    per_rank_bytes,
    rank_coordinates,
    unique_params,
)
from forge_moe_ep.costs import expert_skew
from forge_pp import PipelineSplit
from torch.distributed.device_mesh import DeviceMesh

from .build import ParallelPlan, model_from_config
from .checks import config_problems, import_problems
from .config import ForgeConfig, load_config
from .kinds import model_kind
from .layout import resolve_layout
from .plan_collectives import mesh_dim_index, pipeline_share, step_collectives, whole_model_share
from .plan_memory import (
    ActivationEstimate,
    PipelinePlan,
    estimate_activations,
    estimate_pipeline_activations,
    pipeline_plan,
)
from .plan_predict import (
    GPUProfile,
    MemoryPeak,
    StepTime,
    defaulted,
    load_gpu,
    predict_memory,
    predict_time,
    prediction_json,
)

__all__ = [
    "ActivationEstimate",
    "Collective",
    "LayoutPlan",
    "PipelinePlan",
    "build_on_meta",
    "build_stages_on_meta",
    "estimate_activations",
    "estimate_pipeline_activations",
    "plan_layout",
    "run_plan",
]


@dataclass
class LayoutPlan:
    """The plan: per-rank lists (index = global rank), collectives, broken rules, timings.

    With ``parallelism.pp > 1``: ``pipeline`` (:class:`PipelinePlan`), ``pipeline_rank`` (each
    rank's place on the pp axis), ``pipeline_collectives`` (each pipeline rank's view;
    ``collectives`` is pipeline rank 0's), ``micro_batch`` the pipeline's, the activation lists
    each rank's peak under the schedule and ``activation`` pipeline rank 0's."""

    config: ForgeConfig
    world_size: int
    parallelism: ParallelismConfig | None = None
    mesh: tuple[tuple[str, int], ...] = ()
    data: str = ""
    stages: list[str] = field(default_factory=list)
    micro_batch: int = 0
    unsharded_param_bytes: int = 0
    param_bytes: list[int] = field(default_factory=list)
    padded_param_bytes: list[int] = field(default_factory=list)
    grad_bytes: list[int] = field(default_factory=list)
    optim_bytes: list[int] = field(default_factory=list)
    activation_none: list[int] = field(default_factory=list)
    activation_full: list[int] = field(default_factory=list)
    activation_kept: list[int] = field(default_factory=list)
    activation_peak: list[int] = field(default_factory=list)
    activation: ActivationEstimate | None = None
    collectives: list[Collective] = field(default_factory=list)
    pipeline: PipelinePlan | None = None
    pipeline_collectives: list[list[Collective]] = field(default_factory=list)
    pipeline_rank: list[int] = field(default_factory=list)
    broken_rules: list[str] = field(default_factory=list)
    all_meta: bool | None = None
    timings: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0
    moe_skew: float = 1.0

    @property
    def ok(self) -> bool:
        return not self.broken_rules

    def text(self) -> str:
        """A readable report; ranks with identical numbers share one row."""
        m, t, p = self.config.decoder, self.config.training, self.parallelism
        kind = model_kind(self.config).label
        out = [
            f"forge plan: {self.world_size} ranks (fake process group, meta tensors), {kind} "
            f"{m.n_layers} layers x dim {m.dim} ({m.num_params():,} parameters), {t.param_dtype}"
        ]
        if p is not None:
            axes = " x ".join(f"{n}={s}" for n, s in self.mesh)
            out.append(f"mesh:   {axes}  (data={self.data})" + (f"; ep={p.ep}" if p.ep > 1 else ""))
        if self.param_bytes and p is not None:  # per-rank numbers: a layout was resolved
            rows: dict[tuple[int, ...], list[int]] = {}
            cols = (self.param_bytes, self.padded_param_bytes, self.grad_bytes, self.optim_bytes)
            # NOTE: the second activation column: AC full, or the config's AC mode when another
            ac = t.ac_mode if t.ac_mode in ("selective", "op") else "full"
            acts = (
                self.activation_none,
                self.activation_peak if ac != "full" else self.activation_full,
            )
            for r, row in enumerate(zip(*cols, *acts, strict=True)):
                rows.setdefault(row, []).append(r)
            heads = ("params", "padded", "grads", "AdamW", "static", "act", f"act AC {ac}")
            pipe = self.pipeline
            split = (
                f"grad_accum {t.grad_accum}"
                if pipe is None
                else f"pp.microbatches {pipe.microbatches}"
            )
            act = "per micro-batch" if pipe is None else "the schedule's peak in flight"
            out += [
                "stages: " + (" -> ".join(self.stages) or "(none)"),
                f"batch:  {self.micro_batch} x {t.seq_len // p.cp} tokens per micro-batch per rank "
                f"(global {t.global_batch_size} / dp {p.dp_degree} / {split}"
                + (f"; seq {t.seq_len} / cp {p.cp}, two chunks each)" if p.cp > 1 else ")"),
                *(self._pipeline_lines() if pipe is not None else []),
                f"memory per rank (unsharded params {fmt_bytes(self.unsharded_param_bytes)}; padded: "
                f"FSDP2's allocation; static: params + grads + AdamW; act: {act}, CUDA)"
                + ("; cpu_offload: static bytes live on the CPU" if t.cpu_offload else ""),
            ]
            named = sorted((ranks[0], _ranks_text(ranks), row) for row, ranks in rows.items())
            width = max(len(name) for _, name, _ in named) + 2
            out.append(f"  {'ranks':<{width}}" + "".join(f"{h:>12}" for h in heads))
            for _, name, (w, pad, g, o, a0, a1) in named:
                cells = "".join(f"{fmt_bytes(v):>12}" for v in (w, pad, g, o, w + g + o, a0, a1))
                out.append(f"  {name:<{width}}{cells}")
            views: list[tuple[str, Sequence[Collective]]] = []
            if pipe is None:
                views = [("rank 0's view", self.collectives)]
            else:  # pipeline ranks with the same table share it
                same: dict[tuple[Collective, ...], list[int]] = {}
                for r, of_rank in enumerate(self.pipeline_collectives):
                    same.setdefault(tuple(of_rank), []).append(r)
                for shared, rs in same.items():  # "pipeline ranks 1-5's view"
                    names = _ranks_text(rs).rsplit(" (", 1)[0]
                    views.append((f"pipeline rank{'s' * (len(rs) > 1)} {names}'s view", shared))
            for view, shown in views:
                out.append(f"collectives per training step, {view} ({len(shown)}):")
                out.append(
                    f"  {'phase':<9}{'op':<15}{'group (ranks)':<24}{'bytes/call':>11}  calls"
                )
                for c in shown:
                    group, size = f"{c.group} ({c.group_size})", fmt_bytes(c.bytes)
                    out.append(
                        f"  {c.phase:<9}{c.kind:<15}{group:<24}{size:>11}{c.count:>7}  {c.what}"
                    )
        out += [f"BROKEN: {r}" for r in self.broken_rules] or ["rules:  OK"]
        steps = ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items()) or "no model built"
        meta = "" if self.all_meta is None else f"; every parameter on meta: {self.all_meta}"
        out.append(f"plan time {self.elapsed_s:.2f} s ({steps}){meta}")
        return "\n".join(out)

    def _pipeline_lines(self) -> list[str]:
        """The pipeline section: schedule, bubble, each pipeline rank's stages and peak."""
        pipe = self.pipeline
        assert pipe is not None
        last = pipe.num_stages - 1
        inputs = model_kind(self.config).first_stage
        lines = [
            f"pipeline: {pipe.schedule}, {pipe.num_stages} stages ({pipe.stages_per_rank} per "
            f"rank), {pipe.microbatches} micro-batches of {pipe.micro_batch}; bubble "
            f"{pipe.bubble:.1%} in theory (forward 1, backward 2, no communication)",
            f"  micro-batches in flight at each pipeline rank's activation peak ({pipe.order}):",
        ]
        for r, stages in enumerate(pipe.rank_stages):
            held = []
            for s in stages:
                blocks = pipe.stage_blocks[s]
                name = (
                    f"blocks {blocks.start}-{blocks.stop - 1}"
                    if len(blocks) > 1
                    else f"block {blocks.start}"
                )
                name = (f"{inputs} + " if s == 0 else "") + name + (" + head" if s == last else "")
                held.append(f"stage {s} ({name}) x{pipe.in_flight[r].get(s, 0)}")
            ranks = _ranks_text([g for g, q in enumerate(self.pipeline_rank) if q == r])
            lines.append(f"  pp rank {r}, ranks {ranks}: " + ", ".join(held))
        return lines


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _ranks_text(ranks: list[int]) -> str:
    """Sorted ranks as arithmetic runs, ``0-4094/2 (2048)``: start-end/step (count)."""
    parts, i = [], 0
    while i < len(ranks):
        j, step = i, ranks[i + 1] - ranks[i] if i + 1 < len(ranks) else 1
        while j + 1 < len(ranks) and ranks[j + 1] - ranks[j] == step:
            j += 1
        run = f"{ranks[i]}-{ranks[j]}" + (f"/{step}" if step > 1 else "")
        parts.append(str(ranks[i]) if i == j else run)
        i = j + 1
    return ",".join(parts[:3]) + (",..." if len(parts) > 3 else "") + f" ({len(ranks)})"


def _broken_rules(cfg: ForgeConfig, world_size: int) -> list[str]:
    """Every broken rule of ``cfg`` on ``world_size`` ranks: the value problems
    (:func:`forge.checks.config_problems`), else the import problems
    (:func:`forge.checks.import_problems`), as ``forge build`` / ``forge train`` refuse them."""
    return config_problems(cfg, world_size) or import_problems(cfg, world_size)


def build_on_meta(cfg: ForgeConfig, mesh: DeviceMesh, data: str) -> nn.Module:
    """``forge build``'s model for this rank of ``mesh``, parallelized on meta, not materialized.
    DDP wraps only materialized weights: a DDP layout is planned as the replicated model. With a
    ``pp`` axis: the rank model of this rank's pipeline rank (:func:`build_stages_on_meta`)."""
    if axis_size(mesh, "pp") > 1:
        return build_stages_on_meta(cfg, mesh, data, sub_mesh(mesh, "pp").get_local_rank()).model
    plan = ParallelPlan.from_config(cfg, mesh, data="none" if data == "ddp" else data)
    return plan.parallelize(model_from_config(cfg))  # no device: nothing is materialized


def build_stages_on_meta(
    cfg: ForgeConfig, mesh: DeviceMesh, data: str, pp_rank: int
) -> PipelineSplit:
    """Pipeline rank ``pp_rank``'s share of ``forge build``'s model on meta, not materialized:
    the model cut as :func:`forge_pp.pipeline_split` cuts it for that rank, and each stage module
    parallelized as ``ParallelPlan`` parallelizes a stage (basic TP, FSDP2 keeping parameters
    gathered between micro-batches) without the device, the schedule or the materialization.

    Any rank of the process group can build any pipeline rank's share: the shapes and placements
    depend on the mesh's other axes, which every pipeline rank has alike.
    """
    plan = ParallelPlan.from_config(cfg, mesh, data="none" if data == "ddp" else data)
    return plan.parallelize_stages(model_from_config(cfg), pp_rank=pp_rank)


def plan_layout(
    cfg: ForgeConfig, world_size: int, *, device: str = "cuda", moe_skew: float = 1.0
) -> LayoutPlan:
    """Plan ``cfg`` on ``world_size`` ranks in this process (fake process group, meta tensors).
    ``device``: whose kernels the activation estimate follows (``"cpu"``: the CPU's composite
    norm, which keeps float32 copies; what ``tools/bench_plan_accuracy.py`` measures against).
    ``moe_skew``: the busiest expert-parallel rank's routed rows over the balanced count (>= 1;
    see :func:`forge.plan_memory.estimate_activations`)."""
    check_moe_skew(moe_skew)
    if dist.is_initialized():
        raise ForgeConfigError(
            f"plan_layout creates a fake process group of {world_size} ranks, but this process "
            "already has one: run it in a fresh process (e.g. `forge plan`), not inside a job"
        )
    refuse(model_kind(cfg).plan_problems())
    start = time.perf_counter()
    plan = LayoutPlan(cfg, world_size, broken_rules=_broken_rules(cfg, world_size))
    plan.moe_skew = moe_skew
    try:
        layout = resolve_layout(cfg, world_size)
    except ForgeConfigError:  # no layout at all: the rules say why
        plan.elapsed_s = time.perf_counter() - start
        return plan
    experts = cfg.routed_experts
    par = layout.parallelism
    plan.parallelism, plan.micro_batch = par, layout.micro_batch
    plan.mesh = tuple(zip(*mesh_layout(par, world_size, experts), strict=True))
    plan.data = layout.data
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        tick = time.perf_counter()
        mesh = build_device_mesh(par, "cpu", num_experts=experts)
        plan.timings["mesh"], tick = time.perf_counter() - tick, time.perf_counter()
        try:
            if par.pp > 1:
                pipe, estimates, problems = pipeline_plan(cfg, layout, device, moe_skew)
                plan.broken_rules += [p for p in problems if p not in plan.broken_rules]
                splits = [build_stages_on_meta(cfg, mesh, plan.data, r) for r in range(par.pp)]
                shares = [pipeline_share(pipe, r) for r in range(par.pp)]
                holdings = [split.stages for split in splits]
            else:
                holdings = [[build_on_meta(cfg, mesh, plan.data)]]
                shares = [whole_model_share(cfg, layout)]
                estimates = [
                    estimate_activations(cfg, world_size, device=device, moe_skew=moe_skew)
                ]
        except ForgeConfigError as err:
            plan.broken_rules += [str(err)] if str(err) not in plan.broken_rules else []
            return plan
        plan.timings["model"], tick = time.perf_counter() - tick, time.perf_counter()
        plan.all_meta = all(
            x.is_meta for held in holdings for m in held for x in (*m.parameters(), *m.buffers())
        )
        if not plan.all_meta:
            raise AssertionError("forge plan materialized a tensor; everything must stay on meta")
        plan.stages = applied_stages(holdings[0][0])
        # Every rank's numbers are its pipeline rank's (the only one without pp).
        pp_rank = torch.zeros(world_size, dtype=torch.long)
        if par.pp > 1:
            plan.pipeline, plan.micro_batch = pipe, pipe.micro_batch
            pp_rank = rank_coordinates(mesh, world_size)[:, mesh_dim_index(mesh, "pp")]
            plan.pipeline_rank = pp_rank.tolist()
        per_rank = {k: torch.zeros(world_size, dtype=torch.long) for k in BYTE_KINDS}
        coords: dict[DeviceMesh, torch.Tensor] = {}
        for r, held in enumerate(holdings):
            mine = pp_rank == r
            for k, v in per_rank_bytes(held, world_size, coords).items():
                per_rank[k][mine] = v[mine]
        plan.param_bytes = per_rank["params"].tolist()
        plan.padded_param_bytes = per_rank["padded"].tolist()
        plan.grad_bytes, plan.optim_bytes = per_rank["grads"].tolist(), per_rank["optim"].tolist()
        plan.unsharded_param_bytes = sum(
            p.numel() * p.element_size() for held in holdings for p in unique_params(held)
        )
        plan.activation = estimates[0]
        ranks = pp_rank.tolist()
        plan.activation_none = [estimates[r].none for r in ranks]
        plan.activation_full = [estimates[r].full for r in ranks]
        mode = cfg.training.ac_mode  # NOTE: the peak counts one recomputed block under AC
        plan.activation_kept = [estimates[r].saved(mode) for r in ranks]
        plan.activation_peak = [estimates[r].peak(mode) for r in ranks]
        tables = [
            step_collectives(cfg, layout, h, s) for h, s in zip(holdings, shares, strict=True)
        ]
        plan.collectives, plan.pipeline_collectives = tables[0], tables if par.pp > 1 else []
        plan.timings["per-rank arithmetic"] = time.perf_counter() - tick
    finally:
        dist.destroy_process_group()
        plan.elapsed_s = time.perf_counter() - start
    return plan


def check_moe_skew(moe_skew: float) -> None:
    """One line for a skew that is not a finite number >= 1."""
    if not (isinstance(moe_skew, int | float) and math.isfinite(moe_skew) and moe_skew >= 1):
        raise ForgeConfigError(
            f"--moe-skew must be a number >= 1 (the busiest expert-parallel rank's routed rows "
            f"over the balanced count; 1: balanced routing), got {moe_skew!r}"
        )


def run_plan(
    config: ForgeConfig | str | None,
    world_size: int,
    overrides: Sequence[str] = (),
    *,
    gpu: str | None = None,
    output: str = "text",
    moe_skew: float = 1.0,
) -> int:
    """``forge plan``: print the plan; 0 when every rule holds, 2 for a bad config or layout.

    ``config``: a loaded config, or a TOML path (None: the default) read with ``overrides``.
    ``gpu``: a profile name (``forge.plan_predict.gpu_names``) for the memory verdict and the
    step time; ``output``: ``"text"`` or ``"json"`` (one JSON object on stdout,
    :func:`forge.plan_predict.prediction_json`); ``moe_skew``: see :func:`plan_layout`.
    """
    try:
        profile = load_gpu(gpu) if gpu is not None else None
        cfg = config if isinstance(config, ForgeConfig) else load_config(config, overrides)
        plan = plan_layout(cfg, world_size, moe_skew=moe_skew)
    except ForgeConfigError as err:
        print(f"forge plan: config error: {err}", file=sys.stderr)
        return 2
    memory = predict_memory(plan) if plan.param_bytes else None
    time_ = predict_time(plan, profile) if profile and memory else None
    if output == "json":
        if memory is None:
            print(json.dumps({"broken_rules": plan.broken_rules, "peak_bytes": None}))
        else:
            print(json.dumps(prediction_json(memory, time_, profile, plan)))
    else:
        print("\n".join([plan.text(), *prediction_lines(plan, memory, time_, profile)]))
    return 0 if plan.ok else 2


def prediction_lines(
    plan: LayoutPlan, memory: MemoryPeak | None, time_: StepTime | None, gpu: GPUProfile | None
) -> list[str]:
    """The report's prediction section (none when no layout resolved)."""
    if memory is None:
        return []
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in memory.breakdown.items() if v)
    lines = [f"peak:   {fmt_bytes(memory.peak_bytes)} on rank {memory.peak_rank} ({parts})"]
    par = plan.parallelism
    if (
        par is not None and expert_skew(plan.config.decoder, par.ep, 2.0) > 1
    ):  # NOTE: a skew applies to this layout
        lines.append(
            f"routing: the busiest EP rank's experts get {plan.moe_skew:g}x the balanced "
            "routed rows (--moe-skew; 1 = balanced)"
        )
    if gpu is not None:
        fits = memory.peak_bytes <= gpu.memory_bytes
        verdict = "fits" if fits else "does NOT fit"
        lines.append(f"gpu:    {gpu.description}: {verdict} in {fmt_bytes(gpu.memory_bytes)}")
    if time_ is not None:
        lines.append(
            f"time:   {time_.step_seconds * 1e3:.1f} ms per step (compute "
            f"{time_.compute_seconds * 1e3:.1f} ms, exposed communication "
            f"{time_.exposed_comm_seconds * 1e3:.1f} ms, bubble {time_.bubble:.0%}); "
            f"{time_.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, MFU {time_.mfu:.1%}; "
            f"dominated by {time_.dominant}"
        )
    shown = defaulted(plan)
    if shown:
        lines.append("defaults: " + ", ".join(shown) + " (set them to your run's)")
    return lines

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

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core import ForgeConfigError, ParallelismConfig, applied_stages
from forge_core.costs import Collective, CollectiveTally
from forge_core.mesh_dims import axis_size, sub_mesh
from forge_core.stages import unwrap
from forge_cp.costs import cp_attention_extra_bytes, cp_collectives, cp_kept_once_bytes
from forge_fsdp_wrap.costs import ddp_collectives, fsdp_collectives
from forge_mesh import build_device_mesh, mesh_layout
from forge_mesh.per_rank import (
    BYTE_KINDS,
    SHARD_PLACEMENTS,
    per_rank_bytes,
    rank_coordinates,
    unique_params,
)
from forge_moe_ep.costs import (
    ep_collectives,
    expert_load_collectives,
    moe_slot_activation_bytes,
    routed_rows,
)
from forge_pp import PipelineSplit, bubble_fraction, pipeline_actions, replay_peak
from forge_pp.costs import pp_collectives
from forge_pp.split import balanced_blocks, stage_indices
from forge_tp_plans import applied_tp_plan
from forge_tp_plans.costs import tp_collectives
from forge_vlm import ac_components
from forge_vlm.costs import vlm_activation_bytes
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .build import ParallelPlan, model_from_config
from .checks import config_problems, import_problems
from .config import ForgeConfig, load_config
from .layout import Layout, resolve_layout

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


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes autograd keeps per micro-batch on a rank: ``none`` without AC; with AC full,
    ``full_saved`` after the forward plus ``full_block`` (one block recomputed in backward)."""

    none: int
    full_saved: int
    full_block: int

    @property
    def full(self) -> int:
        return self.full_saved + self.full_block


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
    activation: ActivationEstimate | None = None
    collectives: list[Collective] = field(default_factory=list)
    pipeline: PipelinePlan | None = None
    pipeline_collectives: list[list[Collective]] = field(default_factory=list)
    pipeline_rank: list[int] = field(default_factory=list)
    broken_rules: list[str] = field(default_factory=list)
    all_meta: bool | None = None
    timings: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.broken_rules

    def text(self) -> str:
        """A readable report; ranks with identical numbers share one row."""
        m, t, p = self.config.model, self.config.training, self.parallelism
        kind = "VLM decoder" if self.config.is_vlm else "model"
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
            acts = (self.activation_none, self.activation_full)
            for r, row in enumerate(zip(*cols, *acts, strict=True)):
                rows.setdefault(row, []).append(r)
            heads = ("params", "padded", "grads", "AdamW", "static", "act", "act AC full")
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
                f"memory per rank (unsharded params {_fmt(self.unsharded_param_bytes)}; padded: "
                f"FSDP2's allocation; static: params + grads + AdamW; act: {act}, CUDA)"
                + ("; cpu_offload: static bytes live on the CPU" if t.cpu_offload else ""),
            ]
            named = sorted((ranks[0], _ranks_text(ranks), row) for row, ranks in rows.items())
            width = max(len(name) for _, name, _ in named) + 2
            out.append(f"  {'ranks':<{width}}" + "".join(f"{h:>12}" for h in heads))
            for _, name, (w, pad, g, o, a0, a1) in named:
                cells = "".join(f"{_fmt(v):>12}" for v in (w, pad, g, o, w + g + o, a0, a1))
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
                    group, size = f"{c.group} ({c.group_size})", _fmt(c.bytes)
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
        inputs = "encoder + adapter + embedding" if self.config.is_vlm else "embedding"
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


def _fmt(n: int) -> str:
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


def _itemsize(cfg: ForgeConfig) -> int:
    return getattr(torch, cfg.training.param_dtype).itemsize


def _checkpointed(cfg: ForgeConfig) -> tuple[str, ...]:
    """The components AC full wraps (a plain model: its decoder blocks)."""
    vlm = cfg.vlm
    return ac_components(vlm.ac_scope, vlm.freeze_encoder) if vlm else ("decoder",)


@dataclass(frozen=True)
class _ActivationParts:
    """:func:`estimate_activations`' bytes per micro-batch, by where they are made: ``first``
    before the decoder blocks (token ids; a VLM's encoder, adapter and image embeddings; what a
    first pipeline stage adds), one entry per decoder block, ``last`` after the blocks (final
    norm, targets, the loss: what a last stage adds). ``*_full``: under AC full (a block keeps its
    checkpointed input); ``recompute``: what AC full recomputes in backward, per block (0 when
    the decoder is not checkpointed) and for the first part (a checkpointed ViT block)."""

    first: int
    first_full: int
    blocks: tuple[int, ...]
    blocks_full: tuple[int, ...]
    block_recompute: tuple[int, ...]
    first_recompute: int
    last: int


def estimate_activations(
    cfg: ForgeConfig, world_size: int, *, device: str = "cuda"
) -> ActivationEstimate:
    """What autograd saves for backward per micro-batch on one rank, in bytes.

    ``b = global_batch_size / dp_degree / grad_accum`` sequences of ``s = seq_len``; ``e`` bytes
    per ``param_dtype`` element; tp degree ``t``; ``r = s/t`` with sequence parallelism (SP),
    else ``s``. Per dense block without AC:

    - each RMSNorm (2): on ``device="cuda"`` (torch's fused kernel) its input and float32
      ``rstd`` (``b r e + 4 b r``), on ``"cpu"`` (the composite, computed in float32) the float32
      input and ``x*rstd`` and ``rstd`` (``8 b r d + 4 b r``); and its output as the projections
      keep it (``b s d e``; under SP the all-gathered copy);
    - attention: q and the SDPA output ``2 b s d/t e``, k and v ``2 b s kv_dim/t e``, the
      logsumexp ``4 b s h/t`` (a fused SDPA: no ``s x s`` matrix); below fp32 also the RoPE tables
      cast per call ``4 s head_dim e``;
    - SwiGLU FFN: w1 out, silu out, w3 out and their product, ``4 b s ffn/t e``;
    - an MoE slot instead (replicated on tp, ``T = b s`` tokens, ``R`` routed rows: ``T k``
      dropless with balanced routing, or ``E b capacity``): scores ``4 T E``, per routed row the
      permuted input, grouped SwiGLU, expert output (kept by the combine) and gather index
      ``R (2 d e + 4 moe_ffn e + 8)``, per (token, choice) ids, float32 weight and scatter index
      ``20 T k``, offsets ``4 E``, the shared expert ``4 T shared_hidden e``, below fp32 the
      router's float32 input and weight ``4 T d + 4 E d``.

    Outside the blocks: token ids ``8 b (s+1)`` and targets ``8 b s``, the final norm, the loss's
    float32 log-probabilities ``4 b s V`` (``V/t`` with loss parallel). A VLM adds the adapter,
    the image embeddings and, when trainable, the ViT encoder (per block LayerNorm inputs/outputs
    and mean/rstd, q/k/v/out, logsumexp, GELU MLP; the patch stem). AC full keeps each block's
    input (``b r d e``; the first block's unsplit, ``b s d e``: its checkpoint wraps the SP split)
    and recomputes one block in backward. The tests measure it exact on CPU (float32 and
    bfloat16, with TP and SP); the CUDA norm term follows the fused kernel's backward signature.

    Context parallelism (``cp > 1``): a rank holds ``s = seq_len / cp`` tokens of each sequence
    and every term above uses that ``s``, except k and v: attention keeps the all-gathered
    ``2 b seq_len kv_dim/t e`` instead, and the output of its two SDPA calls (one per chunk) is
    kept twice, by them and concatenated by ``wo`` (``+ b s d/t e``). Once per rank (AC none): in fp32 the RoPE rows of its
    positions ``2 s head_dim 4``, and on ``device="cpu"`` the two mask rows the kernel shares by
    every layer, ``e ((2 cp + 3) c - 2)`` with ``c = seq_len / 2 cp`` (CUDA's kernels need none).
    """
    layout = resolve_layout(cfg, world_size)
    parts = _activation_parts(cfg, layout, layout.micro_batch, device)
    none = parts.first + sum(parts.blocks) + parts.last
    full = parts.first_full + sum(parts.blocks_full) + parts.last
    top = max((*parts.block_recompute, parts.first_recompute))
    return ActivationEstimate(none=none, full_saved=full, full_block=top)


def _activation_parts(cfg: ForgeConfig, layout: Layout, b: int, device: str) -> _ActivationParts:
    """The terms of :func:`estimate_activations` for micro-batches of ``b`` sequences."""
    m, t = cfg.model, layout.tp
    kv_heads, ffn = m.n_kv_heads, m.ffn_dim
    assert kv_heads and ffn  # filled in by ModelConfig.__post_init__
    sp, lp, cp = layout.sequence_parallel, layout.loss_parallel, layout.parallelism.cp
    e, d, whole = _itemsize(cfg), m.dim, cfg.training.seq_len
    s = whole // cp  # this rank's tokens of each sequence
    r = s // t if sp else s
    low = e != 4  # below fp32: casts that fp32 does not make
    norm_in = 8 * b * r * d if device == "cpu" else b * r * d * e
    norm = norm_in + 4 * b * r + b * s * d * e
    kv_dim = kv_heads * m.head_dim
    attn = 2 * b * s * (d // t) * e + 2 * b * s * (kv_dim // t) * e
    attn += cp_attention_extra_bytes(
        b=b, seq_len=whole, cp=cp, dim=d, kv_dim=kv_dim, tp=t, itemsize=e
    )
    attn += 4 * b * s * (m.n_heads // t) + (4 * s * m.head_dim * e if low else 0)
    dense = moe = 2 * norm + attn + 4 * b * s * (ffn // t) * e
    if m.moe_layers:
        moe = 2 * norm + attn + moe_slot_activation_bytes(m, b, s, e)
    blocks = tuple(moe if m.is_moe_layer(i) else dense for i in range(m.n_layers))
    vocab = m.vocab_size // t if lp else m.vocab_size
    first = 8 * b * (s + (cp == 1))  # token ids (a cp rank's are a copy, without the last)
    cp_once = cp_kept_once_bytes(
        seq_len=whole, cp=cp, head_dim=m.head_dim, itemsize=e, device=device
    )
    last = 8 * b * s + 4 + norm + 4 * b * s * vocab  # targets, loss scalar, final norm, log-probs
    in_ac = "decoder" in _checkpointed(cfg)
    kept = blocks
    if in_ac:  # AC full: each block keeps its input (the first block's unsplit under SP)
        kept = tuple(
            b * r * d * e + (b * (s - r) * d * e if i == 0 else 0) for i in range(len(blocks))
        )
    recompute = blocks if in_ac else tuple(0 for _ in blocks)
    first_full, first_top = first, 0
    v, a, vlm = cfg.vision, cfg.adapter, cfg.vlm
    if v is not None and a is not None and vlm is not None:  # a VLM (ForgeConfig: all or none)
        vis = vlm_activation_bytes(v, a, vlm, b=b, s=s, dim=d, tp=t, itemsize=e)
        first, first_full, first_top = first + vis.none, first_full + vis.full, vis.recompute
    first += cp_once  # NOTE: under AC full they are saved only while a block is recomputed
    return _ActivationParts(first, first_full, blocks, kept, recompute, first_top, last)


# ------------------------------------------------------------------------ pipeline parallelism
@dataclass(frozen=True)
class PipelinePlan:
    """What ``parallelism.pp > 1`` adds to a plan.

    ``microbatches`` of ``micro_batch`` sequences per step (each data-parallel rank's batch
    split); ``stage_blocks``: the decoder blocks of each stage (stage 0 also holds the embedding,
    the last stage the final norm and head); ``rank_stages``: the stages of each pipeline rank;
    ``in_flight``: per pipeline rank, the micro-batches of each of its stages whose activations
    are held at that rank's peak (AC none); ``bubble``: the idle fraction in theory
    (:func:`forge_pp.bubble_fraction`); ``order``: where the action order came from (see
    :func:`forge_pp.pipeline_actions`)."""

    schedule: str
    pp: int
    microbatches: int
    micro_batch: int
    stages_per_rank: int
    stage_blocks: tuple[range, ...]
    rank_stages: tuple[tuple[int, ...], ...]
    in_flight: tuple[dict[int, int], ...]
    bubble: float
    order: str

    @property
    def num_stages(self) -> int:
        return len(self.stage_blocks)


def _pipeline(
    cfg: ForgeConfig, layout: Layout, device: str
) -> tuple[PipelinePlan, list[ActivationEstimate], list[str]]:
    """The pipeline section, each pipeline rank's activations (peak in flight) and the settings
    torch refuses when it builds the schedule."""
    pp_cfg, pp = cfg.pp, layout.parallelism.pp
    v, m = pp_cfg.local_stages(), pp_cfg.num_microbatches(pp)
    b = max(1, layout.batch_per_rank // m)
    n_stages = pp * v
    problems: list[str] = []
    ranges = balanced_blocks(cfg.model.n_layers, n_stages, pp_cfg.split_points)
    try:
        ranks, order = pipeline_actions(pp_cfg.schedule, pp, m, v)
    except ValueError as err:
        problems.append(
            f"pp.schedule={pp_cfg.schedule!r} with parallelism.pp={pp}, {m} micro-batches, "
            f"{v} stages per rank: torch refuses it: {err}"
        )
        ranks, order = pipeline_actions("GPipe", pp, m, 1)
    parts = _activation_parts(cfg, layout, b, device)
    e, s, d = _itemsize(cfg), cfg.training.seq_len, cfg.model.dim
    # NOTE: a stage keeps its output until that micro-batch's backward (hidden states; the
    # last stage its logits), and nothing longer: forge_pp runs the schedule with
    # return_outputs=False (the merged logits are never kept).
    hidden, logits = b * s * d * e, b * s * cfg.model.vocab_size * e
    last = n_stages - 1
    out_mb = {st: logits if st == last else hidden for st in range(n_stages)}

    def stage_bytes(stage: int, full: bool) -> int:
        blocks = parts.blocks_full if full else parts.blocks
        out = sum(blocks[i] for i in ranges[stage])
        if stage == 0:
            out += parts.first_full if full else parts.first
        return out + (parts.last if stage == last else 0)

    none_mb = {st: stage_bytes(st, False) for st in range(n_stages)}
    full_mb = {st: stage_bytes(st, True) for st in range(n_stages)}
    recompute = {  # AC full: a stage's backward recomputes one of its blocks at a time
        st: max(
            [parts.block_recompute[i] for i in ranges[st]] + [parts.first_recompute] * (st == 0)
        )
        for st in range(n_stages)
    }
    placement = pp_cfg.info.placement
    rank_stages = tuple(tuple(stage_indices(r, pp, v, placement)) for r in range(pp))
    estimates, in_flight = [], []
    for actions in ranks:
        none, held = replay_peak(actions, none_mb, out_mb)
        saved = replay_peak(actions, full_mb, out_mb)[0]
        full = replay_peak(actions, full_mb, out_mb, recompute)[0]
        estimates.append(ActivationEstimate(none=none, full_saved=saved, full_block=full - saved))
        in_flight.append(held)
    pipe = PipelinePlan(
        schedule=pp_cfg.schedule,
        pp=pp,
        microbatches=m,
        micro_batch=b,
        stages_per_rank=v,
        stage_blocks=tuple(ranges),
        rank_stages=rank_stages,
        in_flight=tuple(in_flight),
        bubble=bubble_fraction(pp_cfg.schedule, pp, m, v),
        order=order,
    )
    return pipe, estimates, problems


def estimate_pipeline_activations(
    cfg: ForgeConfig, world_size: int, *, device: str = "cuda"
) -> list[ActivationEstimate]:
    """Each pipeline rank's activation peak under ``cfg``'s schedule (``parallelism.pp > 1``).

    What a (stage, micro-batch) holds, for micro-batches of ``b = batch_per_rank / microbatches``
    sequences: the :func:`estimate_activations` terms of the stage's blocks (stage 0 also the
    token ids and a VLM's encoder, adapter and image embeddings; the last stage the final norm,
    targets and loss) and its output (``b s d e``, the last stage's logits ``b s V e``: torch's
    stage keeps it for the backward). Nothing outlives its micro-batch's backward: forge_pp runs
    the schedule without merging the last stage's outputs (``return_outputs=False``).

    When: the rank's actions in order (:func:`forge_pp.pipeline_actions`) are replayed; a forward adds
    its (stage, micro-batch), the full backward frees it, or for the zero-bubble schedules
    (backward split into input and weight gradients) the weight gradient, which still needs the
    saved inputs (an upper bound: the input step frees a little). ``none`` and ``full_saved`` (AC
    full: each block keeps its input) are the peaks of that sum; ``full_block`` what AC full adds
    at its own peak, where a backward recomputes one block of its stage on top.

    Micro-batches in flight at most on pipeline rank ``r`` of ``p`` (``m`` micro-batches, ``v``
    stages per rank, ``q = m / max(1, m // p)`` per round): GPipe ``m`` (all forwards, then all
    backwards); 1F1B ``min(m, p - r)`` (that many warm-up forwards, then a backward before each
    forward); LoopedBFS ``v m``; Interleaved1F1B ``w + 1`` with ``w = min((v-1) q + 2 (p-1-r),
    v m)`` (``w`` when that is ``v m``); InterleavedZeroBubble ``(v-1) q + p``; ZBVZeroBubble
    ``min(m, 2p-1-r)`` of stage ``r`` and ``r + 1`` of stage ``2p-1-r``; DualPipeV
    ``min(m, 2p-r)`` and ``r + 1``. Where a rank's stages differ in size (interleaved: the
    balanced split's stages hold different block counts, the first and last stage more) the
    byte peak can fall at another moment than the count's: the replay finds it.
    """
    layout = resolve_layout(cfg, world_size)
    if layout.parallelism.pp <= 1:
        raise ForgeConfigError("estimate_pipeline_activations needs parallelism.pp > 1")
    _, estimates, problems = _pipeline(cfg, layout, device)
    if problems:
        raise ForgeConfigError(problems[0])
    return estimates


def _broken_rules(cfg: ForgeConfig, world_size: int) -> list[str]:
    """Every broken rule of ``cfg`` on ``world_size`` ranks: the value problems
    (:func:`forge.checks.config_problems`), else the import problems
    (:func:`forge.checks.import_problems`), as ``forge build`` / ``forge train`` refuse them."""
    return config_problems(cfg, world_size) or import_problems(cfg, world_size)


@dataclass(frozen=True)
class _Share:
    """What one pipeline rank runs per step (the whole model without pp): its decoder blocks,
    its forward passes (``grad_accum``, or the pipeline's micro-batches of ``micro_batch``), the
    head (last stage) or not, and its stages' neighbours on other pipeline ranks."""

    blocks: tuple[int, ...]
    passes: int
    micro_batch: int
    head: bool
    pipelined: bool = False
    sends_to: tuple[int, ...] = ()  # stages whose next stage lives on another pipeline rank
    recvs_from: tuple[int, ...] = ()  # stages whose previous stage lives on another rank


def _whole_model(cfg: ForgeConfig, layout: Layout) -> _Share:
    passes = cfg.training.grad_accum
    return _Share(tuple(range(cfg.model.n_layers)), passes, layout.micro_batch, head=True)


def _pipeline_share(pipe: PipelinePlan, r: int) -> _Share:
    """Pipeline rank ``r``'s share: its stages' blocks, one pass per micro-batch."""
    local, last = pipe.rank_stages[r], pipe.num_stages - 1
    owner = {s: q for q, stages in enumerate(pipe.rank_stages) for s in stages}
    return _Share(
        blocks=tuple(i for s in local for i in pipe.stage_blocks[s]),
        passes=pipe.microbatches,
        micro_batch=pipe.micro_batch,
        head=last in local,
        pipelined=True,
        sends_to=tuple(s for s in local if s < last and owner[s + 1] != r),
        recvs_from=tuple(s for s in local if s > 0 and owner[s - 1] != r),
    )


def _collectives(
    cfg: ForgeConfig, layout: Layout, modules: Sequence[nn.Module], share: _Share
) -> list[Collective]:
    """Every collective of one training step on a rank holding ``modules`` (a model, or a
    pipeline rank's stage modules) and running ``share``; the rank's view where its group's
    ranks differ (rank 0's without pp, each pipeline rank's with it)."""
    m, tr, par = cfg.model, cfg.training, layout.parallelism
    e, b, s, acc = _itemsize(cfg), share.micro_batch, tr.seq_len // par.cp, share.passes
    tally = CollectiveTally(_group_sizes(par))
    fsdp_collectives(tally, modules, passes=acc, pipelined=share.pipelined, itemsize=e)
    params = unique_params(modules)
    if layout.data == "ddp":
        ddp_collectives(tally, params)
    top = unwrap(modules[0])
    applied = applied_tp_plan(getattr(top, "decoder", top))
    # AC full recomputes each block's forward up to its last saved tensor (w2's input / the MoE
    # combine): the attention's collectives again, the FFN's output reduction not. (Selective
    # and op AC are counted as none.)
    ac = int(tr.ac_mode == "full" and "decoder" in _checkpointed(cfg))
    moe_blocks = sum(m.is_moe_layer(i) for i in share.blocks)
    block_passes = len(share.blocks) * acc
    if par.tp > 1 and applied is not None:
        tp_collectives(
            tally,
            applied,
            dim=m.dim,
            vocab_size=m.vocab_size,
            tie_embeddings=m.tie_embeddings,
            block_passes=block_passes,
            replicated_passes=moe_blocks * acc,  # an MoE slot runs replicated: no TP inside
            head_passes=acc if share.head else 0,  # the final norm + head (the last stage's)
            ac=ac,
            tokens=b * s,
            itemsize=e,
        )
    if par.cp > 1:
        kv_dim = (m.n_kv_heads or m.n_heads) * m.head_dim
        cp_collectives(
            tally,
            b=b,
            seq_len=tr.seq_len,
            kv_dim=kv_dim,
            tp=par.tp,
            itemsize=e,
            block_passes=block_passes,
            ac=ac,
        )
    if par.ep > 1 and moe_blocks:
        ep_collectives(tally, m, moe_blocks * acc, routed_rows(m, b, s) * m.dim * e, ac)
    _step_collectives(tally, cfg, par, params, moe_blocks)
    if share.pipelined:
        hidden = b * s * m.dim * e
        sends, recvs = len(share.sends_to), len(share.recvs_from)
        pp_collectives(tally, sends=sends, recvs=recvs, passes=acc, hidden_bytes=hidden)
    return tally.table()


def _group_sizes(par: ParallelismConfig) -> dict[str, int]:
    """The size of each group name the cost terms count on."""
    return {
        "tp": par.tp,
        "ep": par.ep,
        "dp": par.dp_degree,
        "dp_replicate": par.dp_replicate,
        "dp_shard": par.dp_shard,
        "pp": par.pp,
        "cp": par.cp,
        "dp_cp": par.dp_degree * par.cp,
    }


def _step_collectives(
    tally: CollectiveTally,
    cfg: ForgeConfig,
    par: ParallelismConfig,
    params: Sequence[nn.Parameter],
    moe_blocks: int,
) -> None:
    """The step's scalar reductions: loss average, MoE expert loads, grad norm partial sums."""
    for axis in ("dp_replicate", "dp_shard", "cp"):
        tally.add("step all_reduce", axis, 4, 1, "loss average (fp32 scalar)")
    expert_load_collectives(tally, cfg.model, moe_blocks, cp=par.cp)
    sharded = {  # a gradient norm sums over every mesh dim some gradient is sharded on
        (_dim_name(p.device_mesh, j), p.device_mesh.shape[j]): None
        for p in params
        if isinstance(p, DTensor) and p.requires_grad
        for j, pl in enumerate(p.placements)
        if isinstance(pl, SHARD_PLACEMENTS)
    }
    for axis, size in sharded:
        tally.add("step all_reduce", axis, 4, 1, "grad norm partial sum (fp32 scalar)", size)


def _dim_index(mesh: DeviceMesh, name: str) -> int:
    names = mesh.mesh_dim_names
    assert names is not None, "forge's meshes name their dims"
    return names.index(name)


def _dim_name(mesh: DeviceMesh, j: int) -> str:
    """The name of ``mesh``'s dim ``j`` (forge names every dim of the meshes it builds)."""
    names = mesh.mesh_dim_names
    assert names is not None, "forge's meshes name their dims"
    return names[j]


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


def plan_layout(cfg: ForgeConfig, world_size: int) -> LayoutPlan:
    """Plan ``cfg`` on ``world_size`` ranks in this process (fake process group, meta tensors)."""
    if dist.is_initialized():
        raise ForgeConfigError(
            f"plan_layout creates a fake process group of {world_size} ranks, but this process "
            "already has one: run it in a fresh process (e.g. `forge plan`), not inside a job"
        )
    if cfg.is_field:
        raise ForgeConfigError(
            "forge plan models token models (the reference decoder, MoE, VLM); a field model "
            "([field], model.preset=debug_field) is not planned yet: its activations are 2-D fields"
        )
    start = time.perf_counter()
    plan = LayoutPlan(cfg, world_size, broken_rules=_broken_rules(cfg, world_size))
    try:
        layout = resolve_layout(cfg, world_size)
    except ForgeConfigError:  # no layout at all: the rules say why
        plan.elapsed_s = time.perf_counter() - start
        return plan
    experts = cfg.model.num_experts if cfg.model.moe_layers else 0
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
                pipe, estimates, problems = _pipeline(cfg, layout, "cuda")
                plan.broken_rules += [p for p in problems if p not in plan.broken_rules]
                splits = [build_stages_on_meta(cfg, mesh, plan.data, r) for r in range(par.pp)]
                shares = [_pipeline_share(pipe, r) for r in range(par.pp)]
                holdings = [split.stages for split in splits]
            else:
                holdings = [[build_on_meta(cfg, mesh, plan.data)]]
                shares = [_whole_model(cfg, layout)]
                estimates = [estimate_activations(cfg, world_size)]
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
            pp_rank = rank_coordinates(mesh, world_size)[:, _dim_index(mesh, "pp")]
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
        tables = [_collectives(cfg, layout, h, s) for h, s in zip(holdings, shares, strict=True)]
        plan.collectives, plan.pipeline_collectives = tables[0], tables if par.pp > 1 else []
        plan.timings["per-rank arithmetic"] = time.perf_counter() - tick
    finally:
        dist.destroy_process_group()
        plan.elapsed_s = time.perf_counter() - start
    return plan


def run_plan(
    config: ForgeConfig | str | None, world_size: int, overrides: Sequence[str] = ()
) -> int:
    """``forge plan``: print the plan; 0 when every rule holds, 2 for a bad config or layout.

    ``config``: a loaded config, or a TOML path (None: the default) read with ``overrides``.
    """
    try:
        cfg = config if isinstance(config, ForgeConfig) else load_config(config, overrides)
        plan = plan_layout(cfg, world_size)
    except ForgeConfigError as err:
        print(f"forge plan: config error: {err}", file=sys.stderr)
        return 2
    print(plan.text())
    return 0 if plan.ok else 2

"""``forge plan``: what a layout costs on every rank, computed in one process without a GPU.

Provides :func:`plan_layout` (-> :class:`LayoutPlan`, :meth:`LayoutPlan.text`),
:func:`estimate_activations`, :func:`build_on_meta` and :func:`run_plan` (the CLI's entry).

The model is built ONCE, as rank 0 of a ``fake`` process group of ``world_size`` ranks, on the
meta device by ``forge build``'s own ``build_parallel_model`` with no device, so nothing is
materialized (asserted). Every other rank's numbers are arithmetic:

- Parameters: each DTensor's global shape + placements + the rank's coordinate in the
  parameter's mesh (for every rank at once, from the mesh layout: ``remap_to_tensor``). ``Shard``
  chunks as ``torch.chunk`` does (``ceil(L/n)`` per rank, the last ranks get less or nothing). A
  tensor dim carrying a ``_StridedShard`` (FSDP2 over TP- or EP-sharded weights) is chunked right
  to left, inner (TP/EP) mesh dims first and FSDP2's last: that is how FSDP2 stores it
  (``to_local()``); torch's left-to-right ``_StridedShard`` rule agrees unless the inner dims
  split unevenly (TP/EP plans refuse that).
  Rank 0's arithmetic is checked against the meta model's ``to_local()`` on every run. Bytes
  count as ``forge.job._param_bytes`` does (unpadded); FSDP2 allocates the padded shard
  (``ceil(L/n)`` rows on every rank, even one holding nothing), shown as "padded".
- Gradients: the trainable shard, same bytes. AdamW: two float32 states per trainable element.
- Activations: :func:`estimate_activations` (formula in its docstring; the tests compare it with
  the tensors autograd saves on real runs).
- Collectives per training step, rank 0's view (every rank of a group moves the same bytes:
  FSDP2 all-gathers padded shards): FSDP2 from each unit's parameter groups (in param_dtype),
  TP/SP, EP, DDP and the per-step reductions from the config, for AC none or full (selective
  and op count as none). Float8's fp8 all-gather and amax reductions are not modelled.

Broken rules (every problem ``forge.checks.config_problems`` finds, then, when those are clean,
``forge.checks.import_problems``'s, and a ``ForgeConfigError`` from the build) are collected and
reported, not raised. ``plan_layout`` refuses to run where a process group exists, and destroys
the fake one it creates.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core import ForgeConfigError, ParallelismConfig, applied_stages
from forge_core.stages import unwrap
from forge_core.torch_compat import (
    fsdp_param_groups,
    fsdp_reshards_root_after_forward,
    mesh_group_ranks,
    strided_shard_type,
)
from forge_mesh import build_device_mesh, mesh_layout
from forge_tp_plans import applied_tp_plan
from forge_vlm import ac_components, num_image_tokens
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Placement, Shard

from .build import ParallelPlan, model_from_config
from .checks import config_problems, import_problems
from .config import ForgeConfig, load_config
from .layout import Layout, resolve_layout

__all__ = [
    "ActivationEstimate",
    "Collective",
    "LayoutPlan",
    "build_on_meta",
    "estimate_activations",
    "plan_layout",
    "run_plan",
]

_DDP_BUCKET = 25 * 2**20  # DDP's default bucket_cap_mb
_STRIDED_SHARD = strided_shard_type()
_SHARDS = (Shard, _STRIDED_SHARD)  # NOTE: torch 2.15's _StridedShard is not a Shard subclass
#: How a parameter groups for the per-rank arithmetic: shape, mesh, placements, FSDP2's mesh dim.
_ParamKey = tuple[tuple[int, ...], DeviceMesh | None, tuple[Placement, ...], int | None]


class _ShardLike(Protocol):
    """What ``Shard`` and ``_StridedShard`` (no common base but ``Placement``) share here."""

    dim: int


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


@dataclass(frozen=True)
class Collective:
    """``count`` calls per training step in ``phase`` (forward, backward, step); ``bytes`` per
    call on the unsharded side (all-gather output, reduce-scatter input); ``group`` names the
    mesh axis of ``group_size`` ranks."""

    phase: str
    kind: str
    group: str
    group_size: int
    bytes: int
    count: int
    what: str


@dataclass
class LayoutPlan:
    """The plan: per-rank lists (index = global rank), collectives, broken rules, timings."""

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
            out += [
                "stages: " + (" -> ".join(self.stages) or "(none)"),
                f"batch:  {self.micro_batch} x {t.seq_len} tokens per micro-batch per rank "
                f"(global {t.global_batch_size} / dp {p.dp_degree} / grad_accum {t.grad_accum})",
                f"memory per rank (unsharded params {_fmt(self.unsharded_param_bytes)}; padded: "
                "FSDP2's allocation; static: params + grads + AdamW; act: per micro-batch, CUDA)"
                + ("; cpu_offload: static bytes live on the CPU" if t.cpu_offload else ""),
            ]
            named = sorted((ranks[0], _ranks_text(ranks), row) for row, ranks in rows.items())
            width = max(len(name) for _, name, _ in named) + 2
            out.append(f"  {'ranks':<{width}}" + "".join(f"{h:>12}" for h in heads))
            for _, name, (w, pad, g, o, a0, a1) in named:
                cells = "".join(f"{_fmt(v):>12}" for v in (w, pad, g, o, w + g + o, a0, a1))
                out.append(f"  {name:<{width}}{cells}")
            out.append(f"collectives per training step, rank 0's view ({len(self.collectives)}):")
            out.append(f"  {'phase':<9}{'op':<15}{'group (ranks)':<24}{'bytes/call':>11}  calls")
            for c in self.collectives:
                group, size = f"{c.group} ({c.group_size})", _fmt(c.bytes)
                out.append(f"  {c.phase:<9}{c.kind:<15}{group:<24}{size:>11}{c.count:>7}  {c.what}")
        out += [f"BROKEN: {r}" for r in self.broken_rules] or ["rules:  OK"]
        steps = ", ".join(f"{k} {v:.2f} s" for k, v in self.timings.items()) or "no model built"
        meta = "" if self.all_meta is None else f"; every parameter on meta: {self.all_meta}"
        out.append(f"plan time {self.elapsed_s:.2f} s ({steps}){meta}")
        return "\n".join(out)


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


def _routed_rows(cfg: ForgeConfig, b: int) -> int:
    """Rows an MoE layer sends to its experts: ``T k`` dropless, ``E b capacity`` capped."""
    m, s = cfg.model, cfg.training.seq_len
    if m.moe_dispatch == "dropless":
        return b * s * m.top_k
    return m.num_experts * b * max(1, math.ceil(m.capacity_factor * s * m.top_k / m.num_experts))


def _checkpointed(cfg: ForgeConfig) -> tuple[str, ...]:
    """The components AC full wraps (a plain model: its decoder blocks)."""
    vlm = cfg.vlm
    return ac_components(vlm.ac_scope, vlm.freeze_encoder) if vlm else ("decoder",)


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
    """
    layout = resolve_layout(cfg, world_size)
    m, t = cfg.model, layout.tp
    kv_heads, ffn, hidden = m.n_kv_heads, m.ffn_dim, m.moe_ffn_dim
    assert kv_heads and ffn and hidden  # filled in by (MoE)ModelConfig.__post_init__
    sp, lp = layout.sequence_parallel, layout.loss_parallel
    e, s, b, d = _itemsize(cfg), cfg.training.seq_len, layout.micro_batch, m.dim
    r = s // t if sp else s
    low = e != 4  # below fp32: casts that fp32 does not make
    norm_in = 8 * b * r * d if device == "cpu" else b * r * d * e
    norm = norm_in + 4 * b * r + b * s * d * e
    attn = 2 * b * s * (d // t) * e + 2 * b * s * (kv_heads * m.head_dim // t) * e
    attn += 4 * b * s * (m.n_heads // t) + (4 * s * m.head_dim * e if low else 0)
    dense = moe = 2 * norm + attn + 4 * b * s * (ffn // t) * e
    if m.moe_layers:
        tok, n_exp = b * s, m.num_experts
        moe = 2 * norm + attn + 4 * tok * n_exp + 4 * n_exp + tok * m.top_k * 20
        moe += _routed_rows(cfg, b) * (8 + 2 * d * e + 4 * hidden * e)
        moe += 4 * d * (tok + n_exp) if low else 0
        moe += 4 * tok * m.num_shared_experts * hidden * e
    blocks = [moe if m.is_moe_layer(i) else dense for i in range(m.n_layers)]
    vocab = m.vocab_size // t if lp else m.vocab_size
    outside = 8 * b * (s + 1) + 8 * b * s + 4 + norm + 4 * b * s * vocab
    kept = len(blocks) * b * r * d * e + b * (s - r) * d * e  # AC full: block inputs
    in_ac = "decoder" in _checkpointed(cfg)
    none, full = sum(blocks) + outside, (kept if in_ac else sum(blocks)) + outside
    top = max(blocks) if in_ac else 0
    v, a, vlm = cfg.vision, cfg.adapter, cfg.vlm
    if v is not None and a is not None and vlm is not None:  # a VLM (ForgeConfig: all or none)
        n, n_img, tv = v.num_patches, num_image_tokens(v, a), t if vlm.encoder_tp else 1
        extra = b * n * v.dim * e + 2 * b * n_img * (a.hidden_dim or d) * e + b * n_img * d * e
        extra += 9 * b * s + (b * n_img * v.dim * e if a.pool > 1 else 0)
        none, full = none + extra, full + extra
        if not vlm.freeze_encoder:
            mlp = v.mlp_dim
            assert mlp  # filled in by VisionEncoderConfig.__post_init__
            vit = 4 * b * n * v.dim * e + 16 * b * n + 4 * b * n * (v.dim // tv) * e
            vit += 4 * b * n * (v.n_heads // tv) + 2 * b * n * (mlp // tv) * e
            stem = b * v.in_channels * v.image_size**2 * e + b * n * v.dim * e + 8 * b * n
            in_ac = "encoder" in _checkpointed(cfg)
            none += v.n_layers * vit + stem
            full += v.n_layers * (b * n * v.dim * e if in_ac else vit) + stem
            top = max(top, vit if in_ac else 0)
    return ActivationEstimate(none=none, full_saved=full, full_block=top)


def _broken_rules(cfg: ForgeConfig, world_size: int) -> list[str]:
    """Every broken rule of ``cfg`` on ``world_size`` ranks: the value problems
    (:func:`forge.checks.config_problems`), else the import problems
    (:func:`forge.checks.import_problems`), as ``forge build`` / ``forge train`` refuse them."""
    return config_problems(cfg, world_size) or import_problems(cfg, world_size)


def _coordinates(mesh: DeviceMesh, world_size: int) -> torch.Tensor:
    """``[world_size, mesh.ndim]``: every rank's coordinate in ``mesh`` (-1 if not in it)."""
    groups = mesh_group_ranks(mesh)  # every group's ranks
    grid = torch.stack(torch.meshgrid(*[torch.arange(n) for n in mesh.shape], indexing="ij"), -1)
    grid = grid.reshape(-1, mesh.ndim)
    coords = torch.full((world_size, mesh.ndim), -1, dtype=torch.long)
    coords[groups] = grid.repeat(groups.numel() // grid.shape[0], 1)
    return coords


def _local_sizes(
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    mesh: DeviceMesh,
    coords: torch.Tensor,
    padded_dim: int | None = None,
) -> list[torch.Tensor]:
    """Per tensor dim, its local size on every rank; mesh dim ``padded_dim`` (FSDP2's) gives
    every rank the full ``ceil(L/n)`` chunk (FSDP2's padded allocation)."""
    sizes = [torch.full((coords.shape[0],), n, dtype=torch.long) for n in shape]
    by_dim: dict[int, list[int]] = {}
    for j, p in enumerate(placements):
        if isinstance(p, _SHARDS):  # both kinds name the tensor dim they split
            by_dim.setdefault(cast(_ShardLike, p).dim % len(shape), []).append(j)
    for k, dims in by_dim.items():
        if any(isinstance(placements[j], _STRIDED_SHARD) for j in dims):
            dims.reverse()  # FSDP2 sharded the TP/EP-local tensor: inner mesh dims first
        for j in dims:
            cur, n = sizes[k], mesh.shape[j]
            chunk = (cur + n - 1) // n
            own = (cur - coords[:, j] * chunk).clamp(min=0).minimum(chunk)
            sizes[k] = chunk if j == padded_dim else own
    return sizes


def _per_rank_bytes(model: nn.Module, world_size: int) -> dict[str, torch.Tensor]:
    """params / padded / grads / optim bytes of every rank; rank 0 checked against ``to_local``."""
    fsdp_dim = {
        id(fp.sharded_param): fp.mesh_info.shard_mesh_dim
        for unit in model.modules()
        if isinstance(unit, FSDPModule)
        for group in fsdp_param_groups(unit)
        for fp in group.fsdp_params
    }
    out = {
        k: torch.zeros(world_size, dtype=torch.long) for k in ("params", "padded", "grads", "optim")
    }
    coords: dict[DeviceMesh, torch.Tensor] = {}
    groups: dict[_ParamKey, list[nn.Parameter]] = {}  # params that shard alike: one arithmetic
    for p in model.parameters():
        key: _ParamKey = (tuple(p.shape), None, (), None)
        if isinstance(p, DTensor):
            key = (tuple(p.shape), p.device_mesh, tuple(p.placements), fsdp_dim.get(id(p)))
        groups.setdefault(key, []).append(p)
    for (shape, mesh, placements, fdim), params in groups.items():
        local: int | torch.Tensor = math.prod(shape)  # a DTensor's: per rank, [world_size]
        padded = local
        if mesh is not None:
            if mesh not in coords:
                coords[mesh] = _coordinates(mesh, world_size)
            sizes = _local_sizes(shape, placements, mesh, coords[mesh])
            first = params[0]
            assert isinstance(first, DTensor)  # a mesh in the key: DTensor parameters
            rank0, truth = [int(x[0]) for x in sizes], list(first.to_local().shape)
            if rank0 != truth:
                raise AssertionError(f"{shape} {placements}: rank 0 {rank0} != to_local {truth}")
            local = _product(sizes)
            padded = _product(_local_sizes(shape, placements, mesh, coords[mesh], fdim))
        trained = [q for q in params if q.requires_grad]
        out["params"] += local * sum(q.element_size() for q in params)
        out["padded"] += padded * sum(q.element_size() for q in params)
        out["grads"] += local * sum(q.element_size() for q in trained)
        out["optim"] += local * 8 * len(trained)  # AdamW: exp_avg, exp_avg_sq in float32
    return out


def _product(sizes: list[torch.Tensor]) -> int | torch.Tensor:
    """Elementwise product of per-rank sizes (1 for none), as ``math.prod`` would give."""
    total: int | torch.Tensor = 1
    for n in sizes:
        total = total * n
    return total


def _fold(name: str) -> str:
    """A module name with wrapper parts dropped and block numbers folded to ``*``."""
    name = re.sub(r"\._checkpoint_wrapped_module|\._orig_mod", "", name)
    return re.sub(r"\.\d+(\.|$)", r".*\1", name) or "(root)"


def _collectives(cfg: ForgeConfig, layout: Layout, model: nn.Module) -> list[Collective]:
    """Every collective of one training step (``grad_accum`` micro-batches), rank 0's view."""
    m, tr, par, data = cfg.model, cfg.training, layout.parallelism, layout.data
    e, b, s, acc = _itemsize(cfg), layout.micro_batch, tr.seq_len, tr.grad_accum
    sizes = {"tp": par.tp, "ep": par.ep, "dp": par.dp_degree, "dp_replicate": par.dp_replicate}
    sizes["dp_shard"] = par.dp_shard
    counts: dict[tuple[str, str, str, int, int, str], int] = {}

    def add(op: str, group: str, nbytes: int, n: int, what: str, size: int = 0) -> None:
        size = size or sizes[group]
        if size > 1 and n > 0:
            phase, kind = op.split()
            key = (phase, kind, group, size, nbytes, what)
            counts[key] = counts.get(key, 0) + n

    # NOTE: torch leaves named_modules' return type unannotated (Any); typed here for the checker
    named: Iterator[tuple[str, nn.Module]] = model.named_modules()
    for name, unit in named:
        if not isinstance(unit, FSDPModule):
            continue
        for group in fsdp_param_groups(unit):  # one per unit in forge
            info, fps, what = group.mesh_info, group.fsdp_params, f"FSDP2 unit {_fold(name)}"
            n, axis = info.shard_mesh_size, info.mesh.mesh_dim_names[info.shard_mesh_dim]
            numel = sum(fp.padded_sharded_param_size.numel() for fp in fps)
            trained = [fp for fp in fps if fp.sharded_param.requires_grad]
            grads = sum(fp.padded_sharded_param_size.numel() for fp in trained)
            add("forward all_gather", axis, numel * n * e, acc, what + " params", n)
            # FSDP2 keeps the root's parameters after forward only when its reshard_after_forward
            # was left unset (forge sets it); every other resharded unit is gathered again.
            post = group.post_forward_mesh_info
            if post is not None and (name or not fsdp_reshards_root_after_forward(unit)):
                regather = what + " params again"
                add("backward all_gather", axis, numel * n * e, acc, regather, post.shard_mesh_size)
            add("backward reduce_scatter", axis, grads * n * 4, int(grads > 0), what + " grads", n)
            if hasattr(info, "replicate_mesh_size"):
                rep, size = info.mesh.mesh_dim_names[0], info.replicate_mesh_size
                add("backward all_reduce", rep, grads * 4, int(grads > 0), what + " (HSDP)", size)
    if data == "ddp":
        total = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        for i in range(math.ceil(total / _DDP_BUCKET)):
            nbytes = min(_DDP_BUCKET, total - i * _DDP_BUCKET)
            add("backward all_reduce", "dp_replicate", nbytes, 1, "DDP gradient bucket")
    applied = applied_tp_plan(getattr(unwrap(model), "decoder", unwrap(model)))
    # AC full recomputes each block's forward up to its last saved tensor (w2's input / the MoE
    # combine): the attention's collectives again, the FFN's output reduction not. (Selective
    # and op AC are counted as none.)
    ac = tr.ac_mode == "full" and "decoder" in _checkpointed(cfg)
    if par.tp > 1 and applied is not None:
        act, blocks = b * s * m.dim * e, m.n_layers * acc
        dense = blocks - len(m.moe_layers) * acc  # an MoE slot runs replicated: no TP inside
        if applied.sequence_parallel:  # per block: gather in, reduce-scatter out (MoE: slice)
            rows = [
                ("forward all_gather", 2 * blocks * (1 + ac) + acc, "SP: attention/FFN/head input"),
                ("forward reduce_scatter", blocks * (1 + ac) + dense, "SP: wo/w2 output"),
                ("backward reduce_scatter", blocks + dense + acc, "SP: grads of gathered inputs"),
                ("backward all_gather", 2 * blocks + acc, "SP: grads of split outputs/block 0"),
            ]
            add("backward all_reduce", "tp", m.dim * e, 2 * blocks + acc, "SP: norm weight grads")
        else:  # each column-parallel Linear's input gradient is reduced on its own
            fwd = blocks * (1 + ac) + dense + acc * m.tie_embeddings  # + the tied embedding
            rows = [
                ("forward all_reduce", fwd, "TP: row-parallel outputs"),
                ("backward all_reduce", 3 * blocks + 2 * dense + acc, "TP: column-parallel inputs"),
            ]
        for op, n, what in rows:
            add(op, "tp", act, n, what)
        if applied.loss_parallel:
            add("forward all_reduce", "tp", 4 * b * s, 3 * acc, "loss parallel: max/sum/target")
        else:
            add("forward all_gather", "tp", b * s * m.vocab_size * e, acc, "TP: logits")
    again = 1 + ac
    if par.ep > 1 and m.moe_layers:
        layers, rows_ep = len(m.moe_layers) * acc, _routed_rows(cfg, b)
        nbytes, how = rows_ep * m.dim * e, "(balanced routing)"
        if m.moe_dispatch == "capacity":
            how = "(capacity buffer)"
        else:
            add("forward all_to_all", "ep", 4 * m.num_experts, layers * again, "EP: expert counts")
        add("forward all_to_all", "ep", nbytes, 2 * layers * again, f"EP: dispatch+combine {how}")
        add("backward all_to_all", "ep", nbytes, 2 * layers, "EP: their gradients")
    for axis in ("dp_replicate", "dp_shard"):
        add("step all_reduce", axis, 4, 1, "loss average (fp32 scalar)")
    if m.moe_layers and m.moe_bias_update_rate > 0:
        add("step all_reduce", "dp", 4 * m.num_experts, len(m.moe_layers), "MoE expert loads")
    sharded = {  # a gradient norm sums over every mesh dim some gradient is sharded on
        (_dim_name(p.device_mesh, j), p.device_mesh.shape[j]): None
        for p in model.parameters()
        if isinstance(p, DTensor) and p.requires_grad
        for j, pl in enumerate(p.placements)
        if isinstance(pl, _SHARDS)
    }
    for axis, size in sharded:
        add("step all_reduce", axis, 4, 1, "grad norm partial sum (fp32 scalar)", size)
    order = {"forward": 0, "backward": 1, "step": 2}
    ranked = sorted(counts.items(), key=lambda kv: (order[kv[0][0]], kv[0][2], kv[0][5]))
    return [
        Collective(phase, kind, group, size, nbytes, count=n, what=what)
        for (phase, kind, group, size, nbytes, what), n in ranked
    ]


def _dim_name(mesh: DeviceMesh, j: int) -> str:
    """The name of ``mesh``'s dim ``j`` (forge names every dim of the meshes it builds)."""
    names = mesh.mesh_dim_names
    assert names is not None, "forge's meshes name their dims"
    return names[j]


def build_on_meta(cfg: ForgeConfig, mesh: DeviceMesh, data: str) -> nn.Module:
    """``forge build``'s model for this rank of ``mesh``, parallelized on meta, not materialized.
    DDP wraps only materialized weights: a DDP layout is planned as the replicated model."""
    plan = ParallelPlan.from_config(cfg, mesh, data="none" if data == "ddp" else data)
    return plan.parallelize(model_from_config(cfg))  # no device: nothing is materialized


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
            model = build_on_meta(cfg, mesh, plan.data)
        except ForgeConfigError as err:
            plan.broken_rules += [str(err)] if str(err) not in plan.broken_rules else []
            return plan
        plan.timings["model"], tick = time.perf_counter() - tick, time.perf_counter()
        plan.all_meta = all(x.is_meta for x in (*model.parameters(), *model.buffers()))
        if not plan.all_meta:
            raise AssertionError("forge plan materialized a tensor; everything must stay on meta")
        plan.stages = applied_stages(model)
        per_rank = {k: v.tolist() for k, v in _per_rank_bytes(model, world_size).items()}
        plan.param_bytes, plan.padded_param_bytes = per_rank["params"], per_rank["padded"]
        plan.grad_bytes, plan.optim_bytes = per_rank["grads"], per_rank["optim"]
        plan.unsharded_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        plan.activation = act = estimate_activations(cfg, world_size)
        plan.activation_none = [act.none] * world_size  # the same micro-batch on every rank
        plan.activation_full = [act.full] * world_size
        plan.collectives = _collectives(cfg, layout, model)
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

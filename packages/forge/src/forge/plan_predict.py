"""``forge plan``'s predictions: each rank's peak memory in a training step, and with a GPU
profile (``--gpu NAME``) the step time, tokens/s per GPU and MFU, from the layout plan's exact
byte counts and collectives (:mod:`forge.plan`). The model and its limits: docs/planning.md.

**Memory** of a rank: its parameters as FSDP2 allocates them (padded shards), gradients,
AdamW's two float32 states, the activations autograd keeps under the config's AC mode with one
recomputed block (:mod:`forge.plan_memory`), and the step's temporaries: two FSDP2
units' unsharded parameters (the one computing and the one prefetched), one unit's unsharded
gradients being reduce-scattered, the logits in ``param_dtype`` and their float32 gradient; plus
5 % of the temporaries and activations for the caching allocator's rounding and fragmentation
(a stated assumption until measured).

**Time**: the step's FLOPs (6 x active parameters + causal attention per token; x 4/3 with AC
full, which recomputes the forward) at the profile's peak x efficiency (fp8 peak for Float8's
matmuls, TF32 = half the bf16 peak for float32), split evenly over the ranks, plus the
memory-bound kernels (passes over the activations at the HBM bandwidth); each collective at
its ring volume over NVLink when its group fits in a node, else over the network, plus a
latency per call. With a routing skew (``--moe-skew F``, expert parallelism, dropless), the
busiest rank runs F x its routed-expert FLOPs and its row all-to-alls take F x as long. FSDP2's and DDP's collectives overlap the compute (only what exceeds it
shows); TP, EP, CP, PP and the step's reductions do not. A pipeline's bubble
(forge_pp's theory) stretches the compute.

Pure arithmetic on a :class:`~forge.plan.LayoutPlan`: milliseconds for any world size.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge_core import ParallelismConfig
from forge_core.costs import Collective
from forge_core.errors import ForgeConfigError, did_you_mean
from forge_core.mesh_dims import AXES
from forge_moe_ep.costs import active_params, expert_skew, routed_active_params

from .job_config import TrainingConfig
from .layout import resolve_layout
from .plan_collectives import group_sizes

if TYPE_CHECKING:
    from .plan import LayoutPlan

__all__ = ["GPUProfile", "MemoryPeak", "StepTime", "gpu_names", "load_gpu", "predict_memory"]

#: The share of activations and temporaries added for the caching allocator (assumed).
ALLOCATOR_OVERHEAD = 0.05
_PROFILES = "gpu_profiles"


@dataclass(frozen=True)
class GPUProfile:
    """One GPU model's numbers (a data file in ``forge/gpu_profiles``): memory, dense peaks,
    bandwidths per GPU (one direction), GPUs per node, and the efficiencies applied to them."""

    name: str
    description: str
    memory_bytes: int
    bf16_flops: float
    fp8_flops: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    gpus_per_node: int
    matmul_efficiency: float
    attention_efficiency: float
    comm_efficiency: float
    latency_s: float


def gpu_names() -> list[str]:
    """The profiles forge ships (``--gpu NAME``)."""
    folder = resources.files("forge").joinpath(_PROFILES)
    return sorted(
        p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml")
    )


def load_gpu(name: str) -> GPUProfile:
    """The profile ``name``, or the profile file at ``name`` when it ends in ``.toml`` (a GPU
    forge does not ship: the same fields, read as data). An unknown name, an unreadable file or
    a bad field is one line."""
    if name.endswith(".toml"):
        path = Path(name)
        try:
            text = path.read_text()
        except OSError as err:
            raise ForgeConfigError(
                f"--gpu {name}: cannot read the profile file ({err.strerror}); give a "
                f"readable .toml with the fields of forge/gpu_profiles/h100-sxm.toml"
            ) from None
        return _profile(text, f"--gpu {name}")
    names = gpu_names()
    if name not in names:
        raise ForgeConfigError(
            f"--gpu {name!r} is not a GPU profile forge has{did_you_mean(name, names)}; "
            f"choose one of {names}, or give a profile file (NAME.toml)"
        )
    text = resources.files("forge").joinpath(_PROFILES, f"{name}.toml").read_text()
    return _profile(text, f"forge's profile {name}")


def _profile(text: str, where: str) -> GPUProfile:
    """A :class:`GPUProfile` from a TOML text, every field checked (``where`` names it)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ForgeConfigError(f"{where}: not valid TOML ({err})") from None
    known = {f.name: f.type for f in fields(GPUProfile)}
    missing = [k for k in known if k not in raw]
    unknown = [k for k in raw if k not in known]
    if missing or unknown:
        raise ForgeConfigError(
            f"{where}: missing fields {missing}, unknown fields {unknown}; the fields are "
            f"{list(known)}"
        )
    for key, kind in known.items():
        value = raw[key]
        if kind == "str":
            ok = isinstance(value, str) and bool(value.strip())
        elif kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
            ok = ok and math.isfinite(value) and (not key.endswith("_efficiency") or value <= 1)
        if not ok:
            rule = "in (0, 1]" if key.endswith("_efficiency") else "a positive number"
            rule = "text" if kind == "str" else "a positive integer" if kind == "int" else rule
            raise ForgeConfigError(f"{where}: {key} = {value!r} must be {rule}")
    values: dict[str, Any] = {k: float(v) if known[k] == "float" else v for k, v in raw.items()}
    return GPUProfile(**values)


@dataclass(frozen=True)
class MemoryPeak:
    """The largest rank's peak bytes in a step, which rank, and what makes it up."""

    peak_bytes: int
    peak_rank: int
    breakdown: dict[str, int]


def _unit_bytes(table: list[Collective], op: str, phase: str) -> int:
    """The largest FSDP2 unit's unsharded bytes moved by collective ``op`` in ``phase``."""
    rows = [(c.phase, c.kind, c.what, c.bytes) for c in table]
    sizes = [n for p, o, what, n in rows if (p, o) == (phase, op) and "FSDP2" in what]
    return max(sizes, default=0)


def _logits_bytes(plan: LayoutPlan) -> int:
    """A micro-batch's logits in ``param_dtype`` and their float32 gradient, on one rank."""
    cfg = plan.config
    t, par = cfg.training, plan.parallelism
    assert par is not None  # NOTE: predict_memory is called on a resolved plan
    itemsize = 4 if t.param_dtype == "float32" else 2
    layout = resolve_layout(cfg, plan.world_size)  # NOTE: the decisions, made once there
    vocab = cfg.model.vocab_size // (par.tp if layout.loss_parallel else 1)
    return plan.micro_batch * (t.seq_len // par.cp) * vocab * (itemsize + 4)


def predict_memory(plan: LayoutPlan, *, static_scale: float = 1.0) -> MemoryPeak:
    """Every rank's peak (the module docstring's model); the largest, the first rank with it.
    ``static_scale`` multiplies the static bytes (``forge.plan_search`` plans a smaller
    data-parallel degree and scales FSDP2's shards back). What does not vary per rank (the
    logits, each pipeline rank's FSDP2 units) is computed once."""
    logits = _logits_bytes(plan)
    acts = plan.activation_peak
    tables = plan.pipeline_collectives or [plan.collectives]
    units = [
        (2 * _unit_bytes(t, "all_gather", "forward"), _unit_bytes(t, "reduce_scatter", "backward"))
        for t in tables
    ]
    best: tuple[int, int, dict[str, int]] | None = None
    for r in range(plan.world_size):
        unsharded, reduce_buffer = units[plan.pipeline_rank[r] if plan.pipeline_rank else 0]
        parts = {
            "params": int(plan.padded_param_bytes[r] * static_scale),
            "grads": int(plan.grad_bytes[r] * static_scale),
            "optimizer": int(plan.optim_bytes[r] * static_scale),
            "activations": acts[r],
            "unsharded_params": unsharded,
            "grad_reduce_buffer": reduce_buffer,
            "logits": logits,
        }
        dynamic = acts[r] + unsharded + reduce_buffer + logits
        parts["allocator"] = int(ALLOCATOR_OVERHEAD * dynamic)
        total = sum(parts.values())
        if best is None or total > best[0]:
            best = (total, r, parts)
    assert best is not None  # NOTE: a plan has at least one rank
    return MemoryPeak(best[0], best[1], best[2])


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time and what it is made of."""

    step_seconds: float
    compute_seconds: float
    exposed_comm_seconds: float
    overlapped_comm_seconds: float
    bubble: float
    tokens_per_second_per_gpu: float
    mfu: float
    dominant: str


def _strides(mesh: tuple[tuple[str, int], ...], ep: int) -> dict[str, tuple[int, int]]:
    """Each group name's ``(stride, extent)`` in global ranks of ``mesh`` (axis, size): its
    ranks are ``stride`` apart and span ``extent`` consecutive ranks (tp innermost; ep the
    innermost part of dp_shard x cp)."""
    sizes = dict(mesh)
    stride, inner = {}, 1
    for name in reversed(AXES):
        stride[name] = inner
        inner *= sizes.get(name, 1)

    def span(names: tuple[str, ...]) -> tuple[int, int]:
        low = min(stride[n] for n in names)
        return low, max(stride[n] * sizes.get(n, 1) for n in names)

    groups = {n: span((n,)) for n in AXES}
    groups["dp"] = span(("dp_replicate", "dp_shard"))
    groups["dp_cp"] = span(("dp_replicate", "dp_shard", "cp"))
    low = stride["domain"]
    groups["ep"] = (low, low * ep)
    return groups


def _call_seconds(c: Collective, gpu: GPUProfile, extent: int) -> float:
    """One call: latency + its ring volume over NVLink (group within a node) or the network."""
    n, op = c.group_size, c.kind
    share = (n - 1) / n
    ring = {"all_gather": share, "reduce_scatter": share, "all_to_all": share}
    volume = c.bytes * {**ring, "all_reduce": 2 * share}.get(op, 1.0)
    link = gpu.nvlink_bytes_per_s if extent <= gpu.gpus_per_node else gpu.network_bytes_per_s
    return gpu.latency_s + volume / (link * gpu.comm_efficiency)


def _comm_seconds(
    plan: LayoutPlan,
    gpu: GPUProfile,
    mesh: tuple[tuple[str, int], ...],
    par: ParallelismConfig,
    skew: float = 1.0,
) -> tuple[float, float, dict[str, float]]:
    """``(overlappable, exposed, exposed per group)`` of the slowest pipeline rank's table,
    each group of its size and place in ``mesh`` (``par``'s); the expert-parallel row
    all-to-alls ``skew`` times longer (the busiest rank receives that many more rows)."""
    groups = _strides(mesh, par.ep)
    real = group_sizes(par)
    tables = [
        [dataclasses.replace(c, group_size=real.get(c.group, c.group_size)) for c in table]
        for table in plan.pipeline_collectives or [plan.collectives]
    ]
    worst: tuple[float, float, dict[str, float]] = (0.0, 0.0, {})
    for table in tables:
        hidden, shown = 0.0, 0.0
        by_group: dict[str, float] = {}
        for c in table:
            seconds = c.count * _call_seconds(c, gpu, groups.get(c.group, (1, 1))[1])
            if c.group == "ep" and not c.what.endswith("expert counts"):
                seconds *= skew
            if c.what.startswith(("FSDP2", "DDP")):
                hidden += seconds
            else:
                shown += seconds
                by_group[c.group] = by_group.get(c.group, 0.0) + seconds
        if hidden + shown > sum(worst[:2]):
            worst = (hidden, shown, by_group)
    return worst


def _flops(plan: LayoutPlan) -> tuple[float, float]:
    """The step's ``(matmul, attention)`` training FLOPs, the whole job."""
    cfg = plan.config
    m, t = cfg.decoder, cfg.training
    tokens = t.global_batch_size * t.seq_len
    return 6.0 * active_params(m) * tokens, 6.0 * m.n_layers * t.seq_len * m.dim * tokens


#: HBM passes over the activations a step makes besides its matmuls (written in forward,
#: read twice in backward: norms, activations, softmax, residuals), plus one more under AC full.
ACTIVATION_PASSES = 3
#: The share of the HBM peak elementwise kernels reach (assumed; FACTS: a copy reaches 0.9).
HBM_EFFICIENCY = 0.7


def _memory_bound_seconds(plan: LayoutPlan, gpu: GPUProfile) -> float:
    """The memory-bound kernels' time on a rank: ``ACTIVATION_PASSES`` (+1 under AC full) passes
    over the bytes its forward produces (the activation estimate without AC) per micro-batch,
    for each of the step's micro-batches, at the HBM bandwidth."""
    if plan.activation is None:
        return 0.0
    t, pipe = plan.config.training, plan.pipeline
    per_micro, count = float(plan.activation.none), t.grad_accum
    if pipe is not None:  # NOTE: the peak holds several micro-batches in flight
        per_micro /= max(1, sum(pipe.in_flight[0].values()))
        count = pipe.microbatches
    passes = ACTIVATION_PASSES + (1 if t.ac_mode == "full" else 0)
    return passes * per_micro * count / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)


def predict_time(
    plan: LayoutPlan,
    gpu: GPUProfile,
    *,
    mesh: tuple[tuple[str, int], ...] | None = None,
    parallelism: ParallelismConfig | None = None,
) -> StepTime:
    """The module docstring's time model on ``gpu``. ``mesh`` and ``parallelism``: the real
    layout when ``plan`` was made at a smaller data-parallel degree (``forge.plan_search``):
    its groups' sizes and places."""
    par = parallelism or plan.parallelism
    assert par is not None  # NOTE: called on a resolved plan
    t, cfg = plan.config.training, plan.config
    matmul, attention = _flops(plan)
    peak = gpu.fp8_flops if resolve_layout(cfg, plan.world_size).float8 else gpu.bf16_flops
    if t.param_dtype == "float32":
        peak = gpu.bf16_flops / 2  # NOTE: TF32 tensor cores: half the bf16 rate
    recompute = 4 / 3 if t.ac_mode == "full" else 1.0
    skew = expert_skew(cfg.decoder, par.ep, plan.moe_skew)
    # NOTE: the busiest expert-parallel rank runs skew x its share of the routed experts' FLOPs
    busiest = matmul + (skew - 1) * 6.0 * routed_active_params(cfg.decoder) * t.seq_len * (
        t.global_batch_size
    )
    compute = recompute * (
        busiest / (peak * gpu.matmul_efficiency)
        + attention / (gpu.bf16_flops * gpu.attention_efficiency)
    )
    compute = compute / plan.world_size + _memory_bound_seconds(plan, gpu)
    bubble = plan.pipeline.bubble if plan.pipeline is not None else 0.0
    stretched = compute / (1 - bubble) if bubble < 1 else float("inf")
    hidden, shown, by_group = _comm_seconds(plan, gpu, mesh or plan.mesh, par, skew)
    exposed = max(0.0, hidden - compute) + shown
    step = stretched + exposed
    tokens = t.global_batch_size * t.seq_len
    per_gpu = tokens / step / plan.world_size
    mfu = (matmul + attention) / tokens * per_gpu / gpu.bf16_flops
    candidates = {"compute": compute, "pipeline bubble": stretched - compute}
    candidates.update({f"{g} communication": s for g, s in by_group.items()})
    candidates["FSDP2/DDP communication beyond the compute"] = max(0.0, hidden - compute)
    dominant = max(candidates, key=lambda k: candidates[k])
    return StepTime(step, compute, exposed, hidden, bubble, per_gpu, mfu, dominant)


def defaulted(plan: LayoutPlan) -> list[str]:
    """The ``[training]`` settings the prediction depends on that kept their defaults."""
    t, base = plan.config.training, TrainingConfig()
    names = ("seq_len", "global_batch_size", "param_dtype", "ac_mode")
    return [f"training.{n}={getattr(t, n)!r}" for n in names if getattr(t, n) == getattr(base, n)]


def prediction_json(
    memory: MemoryPeak, time: StepTime | None, gpu: GPUProfile | None, plan: LayoutPlan
) -> dict[str, Any]:
    """``forge plan --format json``'s object (stable keys; the time ones None without a GPU)."""
    return {
        "peak_bytes": memory.peak_bytes,
        "peak_rank": memory.peak_rank,
        "breakdown": memory.breakdown,
        "step_seconds": time.step_seconds if time else None,
        "tokens_per_second_per_gpu": time.tokens_per_second_per_gpu if time else None,
        "mfu": time.mfu if time else None,
        "gpu": gpu.name if gpu else None,
        "gpu_memory_bytes": gpu.memory_bytes if gpu else None,
        "fits": memory.peak_bytes <= gpu.memory_bytes if gpu else None,
        "time": asdict(time) if time else None,
        "defaults": defaulted(plan),
        "world_size": plan.world_size,
        "mesh": dict(plan.mesh),
        "broken_rules": plan.broken_rules,
        "moe_skew": plan.moe_skew,
    }

"""Pipeline schedules on CPU: step time and measured idle against ``forge_pp.bubble_fraction``;
writes ``benchmarks/pp.md``.

Run: ``uv run python tools/bench_pp.py`` (about 2.5 minutes on a quiet 2-core machine),
``--quick`` (pp=2 only, a tiny model: seconds; what ``tests/tools/test_bench_pp.py`` runs),
``--no-write`` (print only), ``--out PATH``, ``--rounds N`` (timed steps per repeat),
``--repeats N``.

What runs: every schedule of ``forge_pp.SCHEDULES`` at pp=2 and pp=4 (one gloo process per
pipeline rank, ``forge_core.testing.RankPool``, ``data="none"``), 8 micro-batches, fp32, the
reference ``Transformer`` built through ``forge.build.ParallelPlan(pp=PPConfig(...))`` with
forge's default balanced split. A step is ``forge_core.training.forward_backward`` (forward,
loss and backward of every micro-batch through the schedule; no optimizer). All schedules of
one pp degree are built side by side in the same ranks and stepped round-robin (schedule A
step, schedule B step, ...), so load from elsewhere on the machine hits them alike; every step
starts after a barrier of the pipeline ranks. Warm-up steps first (the first one also runs
torch's shape inference), then ``--rounds`` timed steps; the whole is done ``--repeats`` times
(default 2) and the page shows each repeat's median.

How idle is measured (per rank, per step):

- step ``T``: wall time from the barrier to the return of ``forward_backward`` (which ends with
  an all-reduce of the loss over the pipeline ranks, so every rank's step ends together).
- busy ``B``: the summed wall time of this rank's compute: each stage's ``forward_one_chunk``,
  ``backward_one_chunk`` (full backward, or the input-gradient half in the zero-bubble
  schedules) and ``backward_weight_one_chunk`` (the weight-gradient half), and the schedule's
  loss call, wrapped on the ``PipelineStage`` objects of the schedule that forge builds
  (``rank_model.__dict__["forge_pipeline"]``). Receives are waited for *before* these calls and
  sends posted after them, so the intervals hold compute (and a little Python around it), not
  communication. Time spent in the schedule's point-to-point waits is timed too.
- measured idle ``= 1 - B / T``, averaged over the ranks (the table also gives the range over
  ranks). It is everything that is not compute: waiting for a neighbour (the bubble proper),
  copying activations over gloo, the schedule's bookkeeping, splitting the batch into
  micro-batches, and the closing loss all-reduce.
- replayed idle: the same step's actions, in the order each rank ran them, re-run on an ideal
  machine (a core per rank, free communication, no overhead): an action starts when its rank is
  free and its input is ready (a forward after the previous stage's forward of the same
  micro-batch, a backward after the next stage's). Three cost models: *measured* (each action's
  CPU time, ``time.thread_time``: with one torch thread per rank a rank's compute runs on its
  own thread, and CPU time does not stretch when a core is shared), *even stages* (the mean
  cost of each kind of action: the model's real backward/forward and input/weight ratios, the
  stages made alike) and *unit* (the formula's costs: forward 1, backward 2, halves 1 + 1).
  unit vs theory checks the formula against torch's real action order; even - unit is what the
  real cost ratios add, measured - even what uneven stages add, and measured idle - replay what
  the runtime adds (gloo, Python, the all-reduce, shared cores).
- theory: ``forge_pp.bubble_fraction(schedule, pp, 8, stages_per_rank)`` (forward 1 unit,
  backward 2, equal stages, no communication; theory.py calls the zero-bubble value an
  approximation).

Shared machine: a timed step counts only if the other processes on the machine (its busy CPU
time from ``/proc/stat`` minus the ranks' own) kept at most ``QUIET_CORES`` cores busy during
it; a (schedule, repeat) with fewer than two such steps uses all of its steps, and the page says
so. The load averages at start and end are on the page too.

Limits:

- 2 cores. At pp=2 each rank has a core. At pp=4, 4 processes share 2 cores: each rank runs one
  torch thread (more would only fight over the cores), but while more than two ranks compute at
  once each runs at about half speed, so compute stretches in the steady phase (all ranks busy)
  and not in the fill and drain (few busy). Measured idle at pp=4 is therefore *lower* than a
  4-core (or 4-GPU) run would show, and step times are not those of a real pp=4 pipeline. The
  "CPU share" column (CPU time / wall time inside the compute calls; 1.0 = a core to itself)
  says how much; the replays, from CPU times, are not affected by it.
- The model is small enough to run in minutes on CPU (dim 256, 8 blocks): compute per action
  is tens of milliseconds, so the schedule's Python and the gloo copies (activations of 2 x 128
  x 256 fp32 = 256 KiB per micro-batch) are a larger part of the step than on GPUs at scale.
  On a GPU, host timers would time kernel launches, not kernels: this script is CPU-only.
- DualPipeV's overlapped forward+backward pairs run one after the other here (no streams on
  CPU). Zero-bubble schedules run the first stage's input-gradient step as a no-op and its
  whole backward in the weight step (torch's implementation); the unit replay models that.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from benchlib import machine_busy_s, measure_on_rank_pools  # noqa: E402 - sibling module (tools/ is the script's folder)
from forge_core import ModelConfig
from forge_pp import SCHEDULES, PPConfig, bubble_fraction, schedule_problems

ROOT = Path(__file__).resolve().parent.parent
OUT_MD = ROOT / "benchmarks" / "pp.md"

#: A timed step counts only if other processes kept at most this many cores busy during it
#: (a shared machine; see quiet_steps).
QUIET_CORES = 0.25

#: The schedules bubble_fraction gives the zero-bubble formula.
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

#: (kind, stage index, micro-batch, wall seconds, CPU seconds) of one compute call.
Action = tuple[str, int, int, float, float]
RunOnRanks = Callable[..., list[Any]]


@dataclass(frozen=True)
class Settings:
    """One benchmark configuration (model, batch, pp degrees, timing rounds)."""

    label: str
    pp_degrees: tuple[int, ...]
    microbatches: int
    dim: int
    n_layers: int
    n_heads: int
    vocab: int
    batch: int
    seq: int
    warmup: int
    rounds: int
    repeats: int

    def model_config(self) -> ModelConfig:
        return ModelConfig.preset(
            "debug",
            vocab_size=self.vocab,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_heads,
            ffn_dim=None,  # the Llama rule: 8/3 x dim rounded up to 64
            max_seq_len=self.seq,
        )


FULL = Settings(
    "full",
    (2, 4),
    8,
    dim=256,
    n_layers=8,
    n_heads=4,
    vocab=2048,
    batch=16,
    seq=128,
    warmup=1,
    rounds=6,
    repeats=2,
)
QUICK = Settings(
    "quick",
    (2,),
    8,
    dim=32,
    n_layers=4,
    n_heads=2,
    vocab=64,
    batch=8,
    seq=8,
    warmup=1,
    rounds=2,
    repeats=1,
)


def stages_per_rank(schedule: str) -> int:
    """1 for GPipe / 1F1B, 2 for the interleaved, looped and V schedules (forge's default)."""
    return PPConfig(schedule=schedule).local_stages()


# --------------------------------------------------------------------------- ranks
class Recorder:
    """Times one rank's compute calls (outermost only) and its point-to-point waits."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.wait_s = 0.0
        self.depth = 0
        self.last_forward_mb = -1

    def reset(self) -> None:
        self.actions, self.wait_s, self.depth, self.last_forward_mb = [], 0.0, 0, -1

    def timed(
        self, kind: str, stage: int, mb: int, fn: Callable[..., Any], *a: Any, **k: Any
    ) -> Any:
        if self.depth:  # nested in a timed call: already counted
            return fn(*a, **k)
        self.depth += 1
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
            self.depth -= 1
            self.actions.append((kind, stage, mb, wall, cpu))


#: The recorder of the schedule stepping now (the p2p wait patch is process-wide).
_ACTIVE: list[Recorder] = []


@contextmanager
def timed_p2p_waits() -> Iterator[None]:
    """While in the block, time the schedules' point-to-point waits into the active recorder.

    NOTE: ``torch.distributed.pipelining.schedules._wait_batch_p2p`` is private; every schedule
    waits on its receives (and sends) through it in torch 2.15 (checked). Without it the wait
    column reads nan and nothing else changes. Restored on exit: a rank pool's workers run
    other code afterwards (the test suite shares them).
    """
    import torch.distributed.pipelining.schedules as schedules

    original = getattr(schedules, "_wait_batch_p2p", None)
    if original is None:
        yield
        return

    def wait(work: Any) -> Any:
        rec = _ACTIVE[-1] if _ACTIVE else None
        if rec is None or rec.depth:
            return original(work)
        t0 = time.perf_counter()
        try:
            return original(work)
        finally:
            rec.wait_s += time.perf_counter() - t0

    schedules._wait_batch_p2p = wait
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original


def _instrument(rank_model: torch.nn.Module, rec: Recorder) -> int:
    """Wrap the compute calls of the schedule forge attached to ``rank_model``; return the
    pipeline's stage count.

    NOTE: ``_stages`` (multi-stage schedules) / ``_stage`` (single-stage) and ``_compute_loss``
    are private attributes of torch's schedule objects (checked on torch 2.15; a torch without
    them fails here, loudly); the stage methods wrapped are public ``PipelineStage`` API.
    """
    schedule = rank_model.__dict__["forge_pipeline"]
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    for stage in stages:
        index = stage.stage_index
        fwd, bwd, wgt = (
            stage.forward_one_chunk,
            stage.backward_one_chunk,
            stage.backward_weight_one_chunk,
        )

        def forward_one_chunk(mb: int, *a: Any, _i: int = index, _f: Any = fwd, **k: Any) -> Any:
            rec.last_forward_mb = mb
            return rec.timed("F", _i, mb, _f, mb, *a, **k)

        def backward_one_chunk(mb: int, *a: Any, _i: int = index, _f: Any = bwd, **k: Any) -> Any:
            full = k.get("full_backward", a[1] if len(a) > 1 else True)
            return rec.timed("B" if full else "I", _i, mb, _f, mb, *a, **k)

        def backward_weight_one_chunk(
            mb: int, *a: Any, _i: int = index, _f: Any = wgt, **k: Any
        ) -> Any:
            return rec.timed("W", _i, mb, _f, mb, *a, **k)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
    n_stages = stages[0].num_stages
    compute_loss = schedule._compute_loss

    def loss(*a: Any, **k: Any) -> Any:  # runs right after the last stage's forward
        return rec.timed("L", n_stages - 1, rec.last_forward_mb, compute_loss, *a, **k)

    schedule._compute_loss = loss
    return n_stages


def rank_measure(settings: Settings, pp: int, schedules: list[str]) -> dict[str, Any]:
    """On every rank: build each schedule's rank model, step them round-robin, return per
    schedule and repeat the timed steps' records (step time, waits, compute actions)."""
    import torch.distributed.pipelining.schedules as pipe_schedules
    from forge.build import ParallelPlan
    from forge_core import Transformer
    from forge_core.training import forward_backward, synthetic_tokens
    from forge_mesh import build_device_mesh

    torch.set_num_threads(1)
    mesh = build_device_mesh({"pp": pp, "data": "none"}, "cpu")
    group = mesh["pp"].get_group()
    cfg = settings.model_config()
    built: dict[str, tuple[torch.nn.Module, Recorder]] = {}
    for name in schedules:
        with torch.device("meta"):
            model = Transformer(cfg)
        pp_cfg = PPConfig(
            schedule=name,
            microbatches=settings.microbatches,
            stages_per_rank=stages_per_rank(name),
        )
        plan = ParallelPlan(mesh, param_dtype=torch.float32, pp=pp_cfg)
        rank_model = plan.parallelize(model, device="cpu", seed=0)
        rec = Recorder()
        _instrument(rank_model, rec)
        built[name] = (rank_model, rec)
    tokens = synthetic_tokens(0, 1, settings.batch, settings.seq, cfg.vocab_size)[0]
    first_rank = dist.get_rank() == 0
    waits_timed = hasattr(pipe_schedules, "_wait_batch_p2p")

    def step(name: str) -> dict[str, Any]:
        model, rec = built[name]
        model.zero_grad(set_to_none=True)
        rec.reset()
        _ACTIVE.append(rec)
        try:
            dist.barrier(group=group)
            m0 = machine_busy_s() if first_rank else None
            t0, p0 = time.perf_counter(), time.process_time()
            forward_backward(model, tokens, mesh=mesh)
            step_s, proc_s = time.perf_counter() - t0, time.process_time() - p0
            m1 = machine_busy_s() if first_rank else None
        finally:
            _ACTIVE.pop()
        return {
            "step_s": step_s,
            "wait_s": rec.wait_s if waits_timed else None,
            "proc_cpu_s": proc_s,
            "machine_busy_s": None if m0 is None or m1 is None else m1 - m0,
            "actions": list(rec.actions),
        }

    out: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in schedules}
    with timed_p2p_waits():
        for name in schedules:  # the first step also infers the shapes passed between stages
            step(name)
        for _ in range(settings.repeats):
            steps: dict[str, list[dict[str, Any]]] = {name: [] for name in schedules}
            for i in range(settings.warmup + settings.rounds):
                for name in schedules:  # round-robin: schedules share the machine's noise
                    record = step(name)
                    if i >= settings.warmup:
                        steps[name].append(record)
            for name in schedules:
                out[name].append(steps[name])
    return {"rank": dist.get_rank(), "steps": out}


# --------------------------------------------------------------------------- analysis
def unit_cost(action: Action) -> float:
    """The formula's costs: forward 1, backward 2 (input half 1, weight half 1), loss 0.

    NOTE: torch runs the first stage's input-gradient step as a no-op (its input needs no
    gradient) and its whole backward in the weight step: 0 and 2 there.
    """
    kind, stage = action[0], action[1]
    if kind == "I":
        return 0.0 if stage == 0 else 1.0
    if kind == "W":
        return 2.0 if stage == 0 else 1.0
    return {"F": 1.0, "B": 2.0, "L": 0.0}[kind]


def cpu_cost(action: Action) -> float:
    """The action's measured CPU time."""
    return action[4]


def even_stage_cost(per_rank: list[list[Action]]) -> Callable[[Action], float]:
    """Measured costs with every stage made alike: each kind of action costs the mean CPU time
    of that kind over the step (the first stage's backward, all in its weight step, costs a
    mean input half plus a mean weight half). Keeps the real backward/forward ratio and the
    real input/weight split; drops the uneven split of the model into stages."""
    sums: dict[str, list[float]] = {}
    for acts in per_rank:
        for kind, stage, _mb, _wall, cpu in acts:
            if kind in "IW" and stage == 0:
                continue
            sums.setdefault(kind, []).append(cpu)
    mean = {kind: statistics.fmean(v) for kind, v in sums.items()}

    def cost(action: Action) -> float:
        kind, stage = action[0], action[1]
        if kind == "I" and stage == 0:
            return 0.0
        if kind == "W" and stage == 0:
            return mean.get("I", 0.0) + mean.get("W", 0.0)
        if kind == "L":  # only the last stage has it: part of the stages' unevenness
            return 0.0
        return mean[kind]

    return cost


def replay(per_rank: list[list[Action]], cost: Callable[[Action], float]) -> float:
    """Mean idle fraction over the ranks of their actions replayed on an ideal machine.

    Actions keep each rank's recorded order and take ``cost(action)``; an action waits for its
    rank and for its input: a forward (``F``) for the previous stage's forward of the same
    micro-batch, a backward (``B`` full or ``I`` input half) for the next stage's backward.
    Loss (``L``) and weight (``W``) steps depend on this rank's earlier actions only. The step
    ends when the last rank finishes (forge's step ends with an all-reduce over the ranks).
    """
    n_stages = 1 + max(a[1] for acts in per_rank for a in acts)
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(per_rank)
    pos = [0] * len(per_rank)
    left = sum(len(acts) for acts in per_rank)
    while left:
        progressed = False
        for r, acts in enumerate(per_rank):
            while pos[r] < len(acts):
                kind, stage, mb = acts[pos[r]][:3]
                dep = None
                if kind == "F" and stage > 0:
                    dep = ("F", stage - 1, mb)
                elif kind in ("B", "I") and stage < n_stages - 1:
                    dep = ("B", stage + 1, mb)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done[dep] if dep is not None else 0.0)
                clock[r] = start + cost(acts[pos[r]])
                if kind in ("F", "B", "I"):
                    done["F" if kind == "F" else "B", stage, mb] = clock[r]
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"replay stuck at positions {pos}: inconsistent action logs")
    span = max(clock)
    return statistics.fmean(1.0 - sum(cost(a) for a in acts) / span for acts in per_rank)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def step_metrics(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers of one step from every rank's record of it (rank order)."""
    step = [rec["step_s"] for rec in recs]
    busy = [sum(a[3] for a in rec["actions"]) for rec in recs]
    cpu = [sum(a[4] for a in rec["actions"]) for rec in recs]
    rank_idle = [1.0 - b / t for b, t in zip(busy, step, strict=True)]
    acts = [a for rec in recs for a in rec["actions"]]

    def cpu_of(kinds: str, first_stage: bool = True) -> float:
        return sum(a[4] for a in acts if a[0] in kinds and (first_stage or a[1] > 0))

    split = cpu_of("IW", first_stage=False)
    n_stages = 1 + max(a[1] for a in acts)
    return {
        "stage_ms": [1e3 * sum(a[4] for a in acts if a[1] == i) for i in range(n_stages)],
        "step_ms": 1e3 * max(step),
        "idle": statistics.fmean(rank_idle),
        "idle_lo": min(rank_idle),
        "idle_hi": max(rank_idle),
        "replay": replay([rec["actions"] for rec in recs], cpu_cost),
        "even": replay(
            [rec["actions"] for rec in recs],
            even_stage_cost([rec["actions"] for rec in recs]),
        ),
        "wait": statistics.fmean(rec["wait_s"] / t for rec, t in zip(recs, step, strict=True))
        if all(rec["wait_s"] is not None for rec in recs)
        else float("nan"),
        "cpu_share": sum(cpu) / sum(busy),
        "bwd_fwd": cpu_of("BIW") / cpu_of("FL"),
        "split_frac": sum(a[0] == "I" for a in acts) / max(1, sum(a[0] in "BI" for a in acts)),
        # weight half of the split backward (stages past the first, where torch splits it)
        "w_share": cpu_of("W", first_stage=False) / split if split else float("nan"),
        "imbalance": max(cpu) / statistics.fmean(cpu),
        # for the other processes' load: summed over steps, then divided (10 ms ticks)
        "machine_s": recs[0]["machine_busy_s"] if recs[0]["machine_busy_s"] is not None else 0.0,
        "ranks_cpu_s": sum(rec["proc_cpu_s"] for rec in recs),
        "step_s": max(step),
        "has_machine": float(recs[0]["machine_busy_s"] is not None),
        "other_step": (recs[0]["machine_busy_s"] - sum(rec["proc_cpu_s"] for rec in recs))
        / max(step)
        if recs[0]["machine_busy_s"] is not None
        else float("nan"),
    }


def _aggregate(steps: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        k: [_median(list(v)) for v in zip(*(m[k] for m in steps), strict=True)]
        if isinstance(steps[0][k], list)
        else _median([m[k] for m in steps])
        for k in steps[0]
    }
    if all(m["has_machine"] for m in steps):
        machine = sum(m["machine_s"] for m in steps) - sum(m["ranks_cpu_s"] for m in steps)
        out["other_cores"] = machine / sum(m["step_s"] for m in steps)
    else:
        out["other_cores"] = float("nan")
    return out


def quiet_steps(steps: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """(steps used, whether they are quiet): the steps during which other processes kept at
    most ``QUIET_CORES`` cores busy (plus the 10 ms ticks' resolution), or all of them when
    fewer than two were that quiet."""
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    quiet = [
        m
        for m in steps
        if not m["other_step"] > QUIET_CORES + 2 * tick / m["step_s"]  # NaN: no reading, kept
    ]
    if len(quiet) >= min(2, len(steps)):
        return quiet, True
    return steps, False


def summarize(
    pp: int, schedule: str, microbatches: int, per_rank: list[list[list[dict[str, Any]]]]
) -> dict[str, Any]:
    """One table row from every rank's records (``per_rank[rank][repeat][step]``): medians over
    the quiet timed steps of each repeat (``repeats``) and of all repeats together (the row's
    own keys)."""
    spr = stages_per_rank(schedule)
    every = [
        [step_metrics([per_rank[r][rep][s] for r in range(pp)]) for s in range(len(steps))]
        for rep, steps in enumerate(per_rank[0])
    ]
    used = [quiet_steps(steps) for steps in every]
    # the schedule's own order with the formula's costs: the same for every step and repeat
    unit = replay([per_rank[r][0][0]["actions"] for r in range(pp)], unit_cost)
    return {
        "pp": pp,
        "schedule": schedule,
        "stages_per_rank": spr,
        "theory": bubble_fraction(schedule, pp, microbatches, spr),
        "unit": unit,
        "repeats": [
            {**_aggregate(kept), "kept": len(kept), "timed": len(steps), "quiet": quiet}
            for (kept, quiet), steps in zip(used, every, strict=True)
        ],
        # the row's own numbers: the quiet steps of all repeats together
        **_aggregate(quiet_steps([m for steps in every for m in steps])[0]),
    }


def available_schedules() -> list[str]:
    """The schedules forge-pp runs with this torch (it refuses the V-placed ones on torch <
    2.15, where their stage set-up fails on gloo)."""
    return [name for name in SCHEDULES if not schedule_problems(PPConfig(schedule=name))]


def measure(settings: Settings, run_on_ranks: RunOnRanks) -> list[dict[str, Any]]:
    """Every (pp, schedule) row; ``run_on_ranks(n, fn, *args)`` runs ``fn`` on n gloo ranks."""
    schedules = available_schedules()
    rows = []
    for pp in settings.pp_degrees:
        t0 = time.perf_counter()
        results = run_on_ranks(pp, rank_measure, settings, pp, schedules)
        for name in schedules:
            per_rank = [res["steps"][name] for res in results]
            rows.append(summarize(pp, name, settings.microbatches, per_rank))
        print(f"  pp={pp}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


# --------------------------------------------------------------------------- output
def _pair(row: dict[str, Any], key: str, fmt: str) -> str:
    return " / ".join(format(r[key], fmt) for r in row["repeats"])


def results_table(rows: list[dict[str, Any]]) -> list[str]:
    """The main table: step time and idle fractions (medians over the timed steps; ``r1 / r2``:
    each repeat's)."""
    lines = [
        "| pp | schedule | stages/rank | step ms (r1 / r2) | measured idle (r1 / r2) "
        "| range over ranks | replay: measured costs | replay: even stages "
        "| replay: unit costs | theory | measured - theory |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pp']} | {r['schedule']} | {r['stages_per_rank']} "
            f"| {_pair(r, 'step_ms', '.0f')} | {_pair(r, 'idle', '.3f')} "
            f"| {r['idle_lo']:.2f}-{r['idle_hi']:.2f} | {r['replay']:.3f} | {r['even']:.3f} "
            f"| {r['unit']:.3f} | {r['theory']:.3f} | {r['idle'] - r['theory']:+.3f} |"
        )
    return lines


def _num(value: float, fmt: str) -> str:
    return "—" if math.isnan(value) else format(value, fmt)


def detail_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where the measured idle goes, the load around the run, and what the formula assumes that
    the run does not."""
    lines = [
        "| pp | schedule | p2p wait | other non-compute | CPU share in compute "
        "| other processes, cores (r1 / r2) | quiet steps used (r1 / r2) "
        "| backward / forward (CPU) | weight half of split backward "
        "| busiest rank / mean (CPU) | CPU ms per stage |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        others = " / ".join(_num(max(0.0, x["other_cores"]), ".2f") for x in r["repeats"])
        kept = " / ".join(
            f"{x['kept']} of {x['timed']}" if x["quiet"] else f"all {x['timed']}, none quiet"
            for x in r["repeats"]
        )
        stages = " ".join(f"{ms:.0f}" for ms in r["stage_ms"])
        lines.append(
            f"| {r['pp']} | {r['schedule']} | {_num(r['wait'], '.3f')} "
            f"| {_num(r['idle'] - r['wait'], '.3f')} | {r['cpu_share']:.2f} | {others} "
            f"| {kept} | {r['bwd_fwd']:.2f} | {_num(r['w_share'], '.2f')} "
            f"| {r['imbalance']:.2f} | {stages} |"
        )
    return lines


def _span(values: list[float], fmt: str) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}} to {hi:{fmt}}"


def reading(rows: list[dict[str, Any]], settings: Settings) -> list[str]:
    """The numbers the page's reading rests on, computed from this run's rows."""
    # rows whose backward mostly runs split in halves (input, then weight)
    split = [r for r in rows if r["split_frac"] >= 0.5]
    whole = [r for r in rows if r["split_frac"] == 0.0]
    unit_err = max(abs(r["unit"] - r["theory"]) for r in rows)
    if unit_err < 1e-6:
        first = (
            "- Theory vs the schedule itself: replayed in torch's own action order with the "
            "formula's costs (forward 1, backward 2, halves 1 + 1), every schedule idles "
            f"exactly what `bubble_fraction` says (largest difference {unit_err:.1e}). So for "
            "the action orders torch runs, the formula (the zero-bubble one included) is exact; "
            "what it leaves out is the costs: real stages are not alike and real backward "
            "halves are not 1 + 1."
        )
    else:
        off = [r for r in rows if abs(r["unit"] - r["theory"]) >= 1e-6]
        first = (
            "- Theory vs the schedule itself: replayed in torch's own action order with the "
            "formula's costs (forward 1, backward 2, halves 1 + 1), these schedules idle other "
            "than `bubble_fraction` says: "
            + "; ".join(
                f"pp={r['pp']} {r['schedule']} {r['unit']:.3f} vs {r['theory']:.3f}" for r in off
            )
            + " (the formula does not describe torch's action order there)."
        )
    lines = [first]
    for pp in settings.pp_degrees:
        at = [r for r in rows if r["pp"] == pp]
        fastest = min(at, key=lambda r: r["step_ms"])
        lines.append(
            f"- pp={pp}: measured idle {_span([r['idle'] for r in at], '.3f')} against theory "
            f"{_span([r['theory'] for r in at], '.3f')} (measured - theory "
            f"{_span([r['idle'] - r['theory'] for r in at], '+.3f')}); replay with measured "
            f"costs {_span([r['replay'] for r in at], '.3f')}. Fastest step: {fastest['schedule']} "
            f"({fastest['step_ms']:.0f} ms); slowest: "
            f"{max(at, key=lambda r: r['step_ms'])['schedule']} "
            f"({max(r['step_ms'] for r in at):.0f} ms)."
        )
    lines.append(
        "- Costs the formula assumes and this model does not have: backward / forward "
        f"{_span([r['bwd_fwd'] for r in whole], '.2f')} with the whole backward in one step "
        f"(formula: 2), {_span([r['bwd_fwd'] for r in split], '.2f')} where it is split into an "
        f"input half and a weight half ({', '.join(dict.fromkeys(r['schedule'] for r in split))}"
        "; DualPipeV splits only a few); the "
        f"weight half is {_span([r['w_share'] for r in split], '.2f')} of a split backward "
        "(formula: 0.5); the busiest rank computes "
        f"{_span([r['imbalance'] for r in rows], '.2f')} x the mean rank (formula: 1)."
    )

    def gap(group: list[dict[str, Any]], a: str, b: str) -> str:
        return _span([r[a] - r[b] for r in group], "+.3f")

    if split and whole:
        extra = statistics.fmean(r["bwd_fwd"] for r in split) / statistics.fmean(
            r["bwd_fwd"] for r in whole
        )
        lines.append(
            f"- Splitting the backward costs compute: the split schedules' backward takes "
            f"{extra:.2f} x the single backward's CPU time per forward. torch's split runs two "
            "autograd passes (input half, then the weight half as one `autograd.grad` call per "
            "parameter group, each gradient added into `.grad` by hand) where the single "
            "backward runs one; their smaller bubble is partly paid back in compute (compare "
            "their step times with 1F1B's)."
        )
    lines += _split_reading(rows, settings)
    zb = [r for r in rows if r["schedule"] in ZERO_BUBBLE]
    others = [r for r in rows if r["schedule"] not in ZERO_BUBBLE]
    for label, group in (("GPipe / 1F1B formulas", others), ("zero-bubble formula", zb)):
        if group:
            lines.append(
                f"- Where the gap comes from ({label}: "
                f"{', '.join(dict.fromkeys(r['schedule'] for r in group))}): real "
                f"backward/forward and input/weight costs {gap(group, 'even', 'unit')} "
                f"(even stages - unit costs); uneven stages {gap(group, 'replay', 'even')} "
                f"(measured costs - even stages); the runtime {gap(group, 'idle', 'replay')} "
                "(measured - replay: point-to-point copies and waits over gloo, the schedule's "
                "Python, the closing all-reduce, and at pp=4 the shared cores)."
            )
    for pp in settings.pp_degrees:
        at = [r for r in rows if r["pp"] == pp]
        reps = [x for r in at for x in r["repeats"]]
        noisy = sum(not x["quiet"] for x in reps)
        lines.append(
            f"- pp={pp}, {pp} ranks on {os.cpu_count()} cores: CPU share inside compute "
            f"{_span([r['cpu_share'] for r in at], '.2f')} (1.0: a core each). Other processes "
            f"kept {_span([max(0.0, x['other_cores']) for x in reps], '.2f')} cores busy during "
            f"the steps used; {noisy} of {len(reps)} (schedule, repeat) medians had fewer than "
            "two quiet steps and use all their steps (marked in the table)."
        )
    return lines


def _split_reading(rows: list[dict[str, Any]], settings: Settings) -> list[str]:
    """What forge's balanced split gives this model, in measured block costs (from the 1F1B row
    with the most stages)."""
    from forge_pp import balanced_blocks

    ones = [r for r in rows if r["schedule"] == "1F1B"]
    if not ones:
        return []
    row = max(ones, key=lambda r: r["pp"])
    stage_ms = row["stage_ms"]
    blocks = [len(b) for b in balanced_blocks(settings.n_layers, len(stage_ms))]
    middle = [ms / n for ms, n in zip(stage_ms[1:-1], blocks[1:-1], strict=True)]
    if not middle:
        return []
    block = statistics.median(middle)
    first = (stage_ms[0] - blocks[0] * block) / block
    last = (stage_ms[-1] - blocks[-1] * block) / block
    layout = " ".join(
        f"[{b[0]}-{b[-1]}]" if len(b) > 1 else f"[{b[0]}]"
        for b in balanced_blocks(settings.n_layers, len(stage_ms))
    )
    return [
        f"- Uneven stages come from forge's balanced split, which weighs the embedding and the "
        f"final norm + head as one block each: {settings.n_layers} blocks on {len(stage_ms)} "
        f"stages give {layout}. Measured (1F1B, pp={row['pp']}, CPU ms per step by stage: "
        f"{' '.join(f'{ms:.0f}' for ms in stage_ms)}), a block costs {block:.0f} ms, the "
        f"embedding {max(0.0, first):.2f} blocks and the norm + head + loss {last:.2f} blocks, "
        f"so the busiest stage does {row['imbalance']:.2f} x the mean rank's work."
    ]


def render_markdown(
    info: dict[str, str], settings: Settings, rows: list[dict[str, Any]], wall_s: float
) -> str:
    cfg = settings.model_config()
    per_mb = settings.batch // settings.microbatches
    lines = [
        "# Pipeline schedules: step time and idle against theory",
        "",
        "Written by `uv run python tools/bench_pp.py`; rerun it to refresh this page.",
        "",
        "## Machine",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        "## Settings",
        "",
        f"- Model: forge's reference `Transformer`, dim {cfg.dim}, {cfg.n_layers} blocks, "
        f"{cfg.n_heads} heads, FFN {cfg.ffn_dim}, vocabulary {cfg.vocab_size}, untied; fp32; "
        "forge's balanced split (embedding and head weigh one block each).",
        f"- Batch {settings.batch} x {settings.seq} tokens per step, "
        f"{settings.microbatches} micro-batches of {per_mb}; one `forward_backward` per step "
        "(no optimizer).",
        f'- pp in {list(settings.pp_degrees)}, `data="none"`; stages per rank 1 (GPipe, 1F1B) '
        "or 2 (the others; V placement for ZBVZeroBubble and DualPipeV); one gloo process per "
        "rank (`RankPool`), one torch thread each.",
        f"- Timing: all schedules of a pp degree built in the same ranks and stepped round-robin; "
        f"a barrier before each step; one untimed first step each (shape inference), then per "
        f"repeat {settings.warmup} warm-up and {settings.rounds} timed steps, "
        f"{settings.repeats} repeats; medians. Wall time of this run: {wall_s / 60:.1f} min.",
        "",
        "## How idle is measured",
        "",
        "- Step: wall time on each rank from the barrier to the return of `forward_backward` "
        "(which ends with an all-reduce of the loss over the pipeline ranks).",
        "- Busy: each rank's summed wall time inside its stages' `forward_one_chunk`, "
        "`backward_one_chunk` and `backward_weight_one_chunk` and the schedule's loss call "
        "(wrapped on the `PipelineStage` objects of the schedule forge builds). Receives are "
        "waited for before these calls and sends posted after them.",
        "- **measured idle** = 1 - busy / step, the mean over ranks (range over ranks beside "
        "it): the bubble plus everything else that is not compute (waits and copies over gloo, "
        "the schedule's Python, the closing all-reduce). The detail table splits it into time "
        "in the schedule's point-to-point waits and the rest.",
        "- **replay**: the same step's actions, in each rank's recorded order, re-run on an "
        "ideal machine (a core per rank, free communication, no overhead): an action starts "
        "when its rank is free and its input is ready (a forward after the previous stage's "
        "forward of that micro-batch, a backward after the next stage's backward). Costs: "
        "*measured* = each action's CPU time (`time.thread_time`: not stretched by a shared "
        "core); *even stages* = the mean CPU time of its kind (forward, backward, input half, "
        "weight half, loss), which keeps the model's real cost ratios but makes the stages "
        "alike; *unit* = the formula's costs. Read: unit vs theory checks the formula against "
        "torch's action order; even - unit is what the real cost ratios add; measured costs - "
        "even what uneven stages add; measured idle - replay what the runtime adds.",
        "- **theory** = `forge_pp.bubble_fraction(schedule, pp, microbatches, stages_per_rank)`.",
        f"- Shared machine: a timed step counts only if other processes kept at most "
        f"{QUIET_CORES} cores busy during it; a (schedule, repeat) with fewer than two such "
        "steps uses all its steps (shown as 'none quiet' in the detail table).",
        "- CPU share = CPU time / wall time inside the compute calls (1.0: the rank had a core "
        "to itself). Other processes = busy CPU of the whole machine (`/proc/stat`, 10 ms "
        "ticks; a small negative reading from the ticks is shown as 0) minus the ranks' own, per "
        "second of step.",
        "",
        "## Results",
        "",
        *results_table(rows),
        "",
        "## Where the idle goes",
        "",
        *detail_table(rows),
        "",
        "## Reading",
        "",
        *reading(rows, settings),
        *READING_NOTES,
    ]
    return "\n".join(lines) + "\n"


#: What the numbers above do not say by themselves (limits of the method).
READING_NOTES = [
    "- pp=4 oversubscribes the CPU: 4 single-thread ranks on 2 cores. When more than two ranks "
    "compute at once each runs at about half speed, which happens in the steady phase and not "
    "in the fill and drain, so the wall-clock measured idle at pp=4 is *lower* than four real "
    "devices would show and the step times are not a pp=4 pipeline's. One torch thread per "
    "rank keeps the ranks from fighting over the cores with intra-op threads (and keeps each "
    "rank's compute on its own thread, which the CPU-time replay relies on); it makes every "
    "compute call slower than a 2-thread process would be. The replay columns use CPU time and "
    "do not depend on the sharing.",
    "- The model is small (compute per action is tens of milliseconds), so gloo copies and the "
    "schedule's Python weigh more in a step than they would with larger actions. On a GPU the "
    "host timers used here would time kernel launches, not kernels: this script is CPU-only "
    "by design.",
    "- Torch runs the first stage's input-gradient step of the zero-bubble schedules as a "
    "no-op and its whole backward in the weight step (its input needs no gradient); "
    "DualPipeV's overlapped forward+backward pairs run one after the other (no streams on "
    "CPU). The unit-cost replay models the first; the second costs nothing in the formula.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pp=2, tiny model (seconds)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--out", type=Path, default=OUT_MD)
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.rounds or args.repeats:
        settings = Settings(
            **{
                **settings.__dict__,
                "rounds": args.rounds or settings.rounds,
                "repeats": args.repeats or settings.repeats,
            }
        )
    rows, info, wall_s = measure_on_rank_pools(lambda run: measure(settings, run))
    print("\n" + "\n".join(results_table(rows)))
    print("\n" + "\n".join(detail_table(rows)))
    print("\n" + "\n".join(reading(rows, settings)))
    print(f"\nwall time {wall_s:.0f} s")
    if not args.no_write:
        args.out.write_text(render_markdown(info, settings, rows, wall_s))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    # NOTE: run main() from this file imported as ``bench_pp`` (tools/ is on sys.path as the
    # script's folder): RankPool's workers unpickle rank_measure and Settings by module name,
    # and names of __main__ would not resolve in them.
    sys.exit(importlib.import_module("bench_pp").main())

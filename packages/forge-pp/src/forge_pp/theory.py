"""What a schedule costs in theory: the bubble, and the order each pipeline rank runs its
forwards and backwards in, replayed for the peak of what it holds (no process group)."""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn as nn

from .config import SCHEDULES
from .split import stage_indices

__all__ = ["Action", "bubble_fraction", "pipeline_actions", "replay_peak"]

#: A pipeline rank's compute action: ``("F" | "I" | "B" | "W", stage, micro-batch)``: forward,
#: input-gradient backward (zero-bubble), full backward, weight-gradient backward (zero-bubble).
Action = tuple[str, int, int]


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The fraction of a step a pipeline rank idles, with forward = 1 and backward = 2 units per
    micro-batch and stage, and no communication cost.

    GPipe and 1F1B idle ``(p - 1) / (m + p - 1)``; interleaving ``v`` stages per rank divides the
    fill and drain by ``v``: ``(p - 1) / (v m + p - 1)``. Zero-bubble schedules fill part of the
    drain with weight-gradient work (backward split into input and weight halves); their ideal
    ``(p - 1) / (3 v m + p - 1)`` counts the warm-up forwards alone as idle (an approximation).
    """
    if schedule not in SCHEDULES:
        raise KeyError(f"unknown schedule {schedule!r}; known: {list(SCHEDULES)}")
    p, m, v = pp, microbatches, stages_per_rank
    if p <= 1:
        return 0.0
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if schedule in ("Interleaved1F1B", "LoopedBFS"):
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * v * m + p - 1)


def pipeline_actions(
    schedule: str, pp: int, microbatches: int, stages_per_rank: int
) -> tuple[list[list[Action]], str]:
    """Every pipeline rank's compute actions in the order the schedule runs them, and where the
    order came from.

    - GPipe: the ``m`` forwards, then the ``m`` backwards (torch's ScheduleGPipe loop);
    - 1F1B: ``min(m, pp - r)`` forwards on pipeline rank ``r``, then a backward before each
      remaining forward, then the remaining backwards (torch's Schedule1F1B loop);
    - every multi-stage schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
      ZBVZeroBubble, DualPipeV): torch's own per-rank action list (``pipeline_order``), which the
      schedule computes arithmetically for every rank when it is built; here it is built over
      stand-in stages (no process group, no module).

    Should the installed torch refuse the stand-ins, the order falls back to a bound: every local
    stage runs all its forwards before any backward (GPipe-like: the most a schedule can hold).
    ``ValueError`` (torch refusing the settings themselves, e.g. DualPipeV with fewer
    micro-batches than stages) is raised.
    """
    m, v = microbatches, stages_per_rank
    if schedule == "GPipe":
        return [[*_runs("F", r, m), *_runs("B", r, m)] for r in range(pp)], "forge's rule"
    if schedule == "1F1B":
        ranks = []
        for r in range(pp):
            warm = min(m, pp - r)
            steady = [a for i in range(m) for a in (("B", r, i), ("F", r, warm + i)) if a[2] < m]
            ranks.append([*_runs("F", r, warm), *steady])
        return ranks, "forge's rule"
    info = SCHEDULES[schedule]
    try:
        return _torch_order(schedule, pp, m, v), "torch's pipeline_order"
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - any torch that builds its schedules differently
        bound = []
        for r in range(pp):
            local = stage_indices(r, pp, v, info.placement)
            bound.append([(k, s, i) for k in "FB" for s in local for i in range(m)])
        return bound, f"bound (torch's order unavailable: {type(err).__name__})"


def _runs(kind: str, stage: int, m: int) -> list[Action]:
    return [(kind, stage, i) for i in range(m)]


def _torch_order(schedule: str, pp: int, m: int, v: int) -> list[list[Action]]:
    """torch's ``pipeline_order`` of a multi-stage schedule, built over stand-in stages."""
    from torch.distributed.pipelining import schedules

    info, n = SCHEDULES[schedule], pp * v
    stand_ins = [
        SimpleNamespace(
            stage_index=i,
            num_stages=n,
            group_size=pp,
            group_rank=0,
            is_first=i == 0,
            is_last=i == n - 1,
            submod=nn.Module(),
        )
        for i in stage_indices(0, pp, v, info.placement)
    ]
    built = getattr(schedules, info.torch_class)(stand_ins, n_microbatches=m)
    order = built.pipeline_order
    out: list[list[Action]] = []
    for r in range(pp):
        actions = [a for step in order[r] if step is not None for a in step.sub_actions or (step,)]
        kinds = [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in actions]
        out.append([(k, s, i) for k, s, i in kinds if k in ("F", "I", "B", "W")])
    return out


def replay_peak(
    actions: list[Action],
    per_mb: dict[int, int],
    out_mb: dict[int, int],
    recompute: dict[int, int] | None = None,
) -> tuple[int, dict[int, int]]:
    """The peak bytes over ``actions`` and the micro-batches of each stage in flight then: a
    forward adds its stage's ``per_mb`` (saved for the backward) and ``out_mb`` (its output,
    kept by torch's stage for the backward) bytes; a full backward (B) frees both; a zero-bubble
    input gradient (I) frees the output, the weight gradient (W, which still needs the saved
    inputs) the rest. ``recompute``: what a stage's backward (B or I) recomputes on top while it
    runs (AC full: its largest block)."""
    live: set[tuple[int, int]] = set()
    outputs: set[tuple[int, int]] = set()
    total = peak = 0
    at_peak: dict[int, int] = {}
    for kind, s, i in actions:
        during = 0
        if kind == "F" and (s, i) not in live:
            live.add((s, i))
            outputs.add((s, i))
            total += per_mb[s] + out_mb[s]
        elif kind in ("B", "I") and recompute:
            during = recompute[s]
        if total + during > peak:
            peak, at_peak = total + during, {}
            for st, _ in live:
                at_peak[st] = at_peak.get(st, 0) + 1
        if kind in ("B", "I") and (s, i) in outputs:
            outputs.remove((s, i))
            total -= out_mb[s]
        if kind in ("B", "W") and (s, i) in live:
            live.remove((s, i))
            total -= per_mb[s]
    return peak, dict(sorted(at_peak.items()))

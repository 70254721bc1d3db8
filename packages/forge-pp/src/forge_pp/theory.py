"""What a schedule costs in theory: the bubble (pure Python)."""

from __future__ import annotations

from .config import SCHEDULES

__all__ = ["bubble_fraction"]


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

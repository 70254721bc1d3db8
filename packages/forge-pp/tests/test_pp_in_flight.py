"""forge_pp's replay of each schedule (``pipeline_actions``): the micro-batches in flight per
rank follow the rules ``forge.plan.estimate_pipeline_activations`` writes down (the plan's
activation peaks against real schedule steps: tests/integration/pp/test_pp_plan.py)."""

from __future__ import annotations

from forge_pp import SCHEDULES, pipeline_actions, stage_indices


def test_activation_peak_counts_follow_the_documented_rules():
    """The micro-batches in flight at most (every stage weighing the same) in the action order
    the plan replays, as ``estimate_pipeline_activations`` writes them, for pp 2..8 and
    micro-batches pp..3 pp; torch's own order for the multi-stage schedules."""

    def most(actions: list[tuple[str, int, int]]) -> int:
        live: set[tuple[int, int]] = set()
        top = 0
        for kind, stage, mb in actions:
            if kind == "F":
                live.add((stage, mb))
            elif kind in ("B", "W"):
                live.discard((stage, mb))
            top = max(top, len(live))
        return top

    def rule(name: str, p: int, m: int, v: int, r: int) -> int:
        q = m // max(1, m // p)
        w = min((v - 1) * q + 2 * (p - 1 - r), v * m)
        return {
            "GPipe": m,
            "1F1B": min(m, p - r),
            "LoopedBFS": v * m,
            "Interleaved1F1B": w + (w < v * m),
            "InterleavedZeroBubble": (v - 1) * q + p,
            "ZBVZeroBubble": min(m, 2 * p - 1 - r) + r + 1,
            "DualPipeV": min(m, 2 * p - r) + r + 1,
        }[name]

    checked = 0
    for name, info in SCHEDULES.items():
        for p in (2, 3, 4, 8):
            for m in range(p, 3 * p + 1):
                for v in {"one": (1,), "two": (2,)}.get(info.stages_per_rank, (2, 3)):
                    try:
                        ranks, order = pipeline_actions(name, p, m, v)
                    except ValueError:  # torch refuses these micro-batches for the schedule
                        continue
                    assert not order.startswith("bound"), order
                    for r, actions in enumerate(ranks):
                        assert {s for _, s, _ in actions} == set(
                            stage_indices(r, p, v, info.placement)
                        )
                        assert most(actions) == rule(name, p, m, v, r), (name, p, m, v, r)
                        checked += 1
    assert checked > 500

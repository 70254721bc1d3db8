"""tools/bench_pp.py's measurement on its smallest setting (pp=2, a tiny model: seconds).

Every schedule this torch runs (``bench_pp.available_schedules``) must give a row, every idle fraction must be one
(in [0, 1]), and the replay with the formula's own costs must give back ``bubble_fraction``: a
torch upgrade that changes a schedule's action order, or a change to the formula, shows here
rather than as an odd benchmark page.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_pp  # noqa: E402 - tools/ is not a package

IDLE_KEYS = ("idle", "idle_lo", "idle_hi", "replay", "even", "unit", "theory")


@pytest.fixture(scope="module")
def rows(run_on_ranks: bench_pp.RunOnRanks) -> list[dict]:
    return bench_pp.measure(bench_pp.QUICK, run_on_ranks)


def test_every_schedule_has_a_row(rows: list[dict]) -> None:
    table = bench_pp.results_table(rows)
    details = bench_pp.detail_table(rows)
    for pp in bench_pp.QUICK.pp_degrees:
        for name in bench_pp.available_schedules():
            row = f"| {pp} | {name} |"
            assert sum(line.startswith(row) for line in table) == 1, (name, table)
            assert sum(line.startswith(row) for line in details) == 1, (name, details)
    assert len(rows) == len(bench_pp.available_schedules()) * len(bench_pp.QUICK.pp_degrees)


def test_idle_fractions_are_fractions(rows: list[dict]) -> None:
    for row in rows:
        values = [row[k] for k in IDLE_KEYS] + [r["idle"] for r in row["repeats"]]
        assert all(0.0 <= v <= 1.0 for v in values), (row["schedule"], values)
        assert row["step_ms"] > 0
        assert 0.0 < row["cpu_share"] <= 1.05  # CPU time inside wall time (timer granularity)


def test_unit_cost_replay_gives_the_formula(rows: list[dict]) -> None:
    for row in rows:
        assert math.isclose(row["unit"], row["theory"], abs_tol=1e-9), row["schedule"]


def test_page_renders(rows: list[dict]) -> None:
    page = bench_pp.render_markdown({"date": "today"}, bench_pp.QUICK, rows, 1.0)
    assert "## Results" in page and "## Reading" in page
    assert all(f"| {name} |" in page for name in bench_pp.available_schedules())

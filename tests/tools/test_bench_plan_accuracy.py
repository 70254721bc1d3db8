"""tools/bench_plan_accuracy.py on its quick rows (a dense FSDP2 layout on 4 ranks, an
Interleaved1F1B pipeline on 2): every measured kind has a prediction within the page's 5 %, the
numbers are real (non-zero, the pipeline's ranks differ), and the page renders them. A change to
what forge builds, to what torch saves or to the planner's formulas shows here first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_plan_accuracy  # noqa: E402 - tools/ is not a package

ROWS = [r for r in bench_plan_accuracy.ROWS if r[0] in bench_plan_accuracy.QUICK]


@pytest.fixture(scope="module")
def rows(run_on_ranks) -> list[dict]:
    return bench_plan_accuracy.measure(ROWS, run_on_ranks)


def test_every_quick_row_is_predicted_within_five_percent(rows: list[dict]) -> None:
    assert [r["name"] for r in rows] == bench_plan_accuracy.QUICK
    for row in rows:
        for kind, ratio in bench_plan_accuracy.worst_ratios(row).items():
            assert abs(ratio - 1) <= bench_plan_accuracy.TOLERANCE, (row["name"], kind, ratio)
        for measured in row["measured"]:
            assert min(measured[k] for k in bench_plan_accuracy.KINDS) > 0, measured


def test_the_pipeline_ranks_hold_different_bytes_and_the_page_shows_them(rows: list[dict]) -> None:
    pipeline = rows[1]["measured"]
    assert pipeline[0]["params"] != pipeline[1]["params"]
    lines = bench_plan_accuracy.table(rows)
    assert len(lines) == 2 + len(rows) and all(line.endswith("| yes |") for line in lines[2:])
    page = bench_plan_accuracy.render({"date": "today"}, rows, 1.0)
    assert "| PP 2 Interleaved1F1B | 2 |" in page and "## Method" in page

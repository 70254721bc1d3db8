"""tools/bench_plan_search.py's measurement on its quick setting (the debug model on 16 ranks):
a row with the candidates tried, the fitting best layout and its table. No timing assertion (a
shared machine: the page records the times)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_plan_search  # noqa: E402 - tools/ is not a package


def test_the_quick_search_has_a_row_with_a_fitting_best_layout() -> None:
    rows = bench_plan_search.measure([], (16,), 1, "h100-sxm")
    (row,) = rows
    assert row["world"] == 16 and row["tried"] >= row["fit"] >= 1
    best = row["best"]
    assert best is not None and best.fits and best.tokens_per_second_per_gpu > 0
    layout = best.layout
    assert (
        layout["tp"] * layout["pp"] * layout["cp"] * layout["dp_shard"] * layout["dp_replicate"]
        == 16
    )
    lines = bench_plan_search.table(rows)
    assert len(lines) == 3 and "| 16 |" in lines[2]
    page = bench_plan_search.render({"date": "today"}, rows, 1, "h100-sxm")
    assert "4,096 ranks not measured." in page

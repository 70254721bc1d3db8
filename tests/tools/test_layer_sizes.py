"""tools/layer_sizes.py: the counter counts what cloc counts, and every layer keeps to the budget.

The budget (LAYER_BUDGET lines of code per layer) keeps each layer readable in one sitting and
vendorable as one folder; a layer that outgrows it should split along a line of ownership, not
squeeze. The layers still over it are held at a ceiling that only comes down (OVER_BUDGET).
``forge-parallel`` (packages/forge: the composition and its commands) is reported, not budgeted.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import layer_sizes  # noqa: E402 - tools/ is not a package

SAMPLE = '''"""Module docstring,

over three lines."""

import os  # a trailing comment keeps the line code

# a comment line


def f(x):
    """One line."""
    return os.sep * x


class C:
    """Two

    paragraphs."""

    y = """a string that is not a docstring
    counts as code"""
'''


def test_the_counter_skips_blanks_comments_and_docstrings(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text(SAMPLE)
    size = layer_sizes.file_size(path)
    assert size.lines == len(SAMPLE.splitlines())
    # import, def, return, class, y = (two lines)
    assert size.code == 6


def test_every_layer_keeps_to_the_budget():
    rows = layer_sizes.sizes()
    assert {
        "forge-parallel-core",
        "forge-parallel-kernels",
        "forge-parallel-tp-plans",
        layer_sizes.COMPOSITION,
    } <= set(rows)
    over = {
        dist: (size.code, layer_sizes.budget(dist))
        for dist, size in rows.items()
        if dist != layer_sizes.COMPOSITION
        and not dist.endswith("(testing)")
        and size.code > layer_sizes.budget(dist)
    }
    assert not over, f"lines of code over the budget (size, budget): {over}"


def test_a_ceiling_is_only_for_a_layer_still_over_the_budget():
    """A layer that came under the budget loses its ceiling (so it cannot grow back over)."""
    rows = layer_sizes.sizes()
    for dist, ceiling in layer_sizes.OVER_BUDGET.items():
        assert ceiling > layer_sizes.LAYER_BUDGET, dist
        assert rows[dist].code > layer_sizes.LAYER_BUDGET, (
            f"{dist} is under budget: drop its ceiling"
        )

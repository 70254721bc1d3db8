"""tools/bench_hf_load.py's measurement on its tiny setting (1 and 2 ranks: seconds).

Every rank count gives a row after the from_pretrained baseline; a rank's shard halves from one
rank to two (FSDP2 over dp_shard), and the tables and verdicts render. No timing or memory
assertions (a shared machine: the page records them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_hf_load  # noqa: E402 - tools/ is not a package

#: What the rank functions import inside the function (the forkserver imports it once).
RANK_PRELOAD = ["transformers"]


def test_every_rank_count_has_a_row_and_the_shard_shrinks(run_on_ranks) -> None:
    settings = bench_hf_load.QUICK
    rows = bench_hf_load.measure(settings, run_on_ranks)
    assert [(r["who"], r["ranks"]) for r in rows] == [
        ("from_pretrained", 1),
        *[("forge", n) for n in settings.worlds],
    ]
    one, two = rows[1]["shard_bytes"], rows[2]["shard_bytes"]
    assert rows[0]["shard_bytes"] == one and 0.45 * one <= two <= 0.55 * one
    assert all(r["files"] > 1 and r["seconds"] > 0 for r in rows)  # an index with several files
    assert len(bench_hf_load.table(rows)) == 2 + len(rows)
    assert len(bench_hf_load.verdicts(rows)) == 2

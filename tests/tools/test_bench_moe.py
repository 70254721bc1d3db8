"""tools/bench_moe.py's weight copy into torchtitan's MoE gives the same layer as forge's.

Tiny shapes, one process, a few seconds: the same check the benchmark prints per row (top-k
choices, outputs, input and parameter gradients), so a torchtitan upgrade that changes its
layout or routing fails here rather than as an odd benchmark table. Skipped without torchtitan
(`uv sync --group bench`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import bench_moe  # noqa: E402 - tools/ is not a package

pytestmark = pytest.mark.skipif(
    bench_moe.torchtitan_missing() is not None,
    reason=f"torchtitan not importable ({bench_moe.torchtitan_missing()}); "
    "`uv sync --group bench` installs it",
)

SOFTMAX = bench_moe.Shape("softmax, no shared", 32, 16, 8, 2, 0, "softmax")
SIGMOID = bench_moe.Shape("sigmoid, 1 shared", 32, 16, 8, 2, 1, "sigmoid")


@pytest.mark.parametrize("shape", [SOFTMAX, SIGMOID], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_torchtitan_matches_forge(shape: bench_moe.Shape, dtype: str) -> None:
    torch.set_num_threads(1)
    res = bench_moe.run_point(bench_moe.Point(shape, 2, 16, dtype), 1, 1, 0, with_titan=True)
    assert res["topk_agree"] == 1.0
    # fp32: both sides do the same fp32 arithmetic (torchtitan's bf16 expert cast is patched
    # out); bf16: only rounding at different points.
    tol = 1e-6 if dtype == "fp32" else 2e-2 * max(res["out_scale"], 1e-3)
    assert res["out_diff"] <= tol
    assert res["dx_diff"] <= tol
    assert res["dw_diff"] <= (1e-5 if dtype == "fp32" else 5e-2)
    assert res["syncs"] == {bench_moe.DROPLESS: 0, bench_moe.TITAN: 0, bench_moe.CAPACITY: 0}
    assert set(res["ms"]) == {
        f"{v}|{p}"
        for v in (bench_moe.DROPLESS, bench_moe.TITAN, bench_moe.CAPACITY)
        for p in bench_moe.PASSES
    }


def test_bfloat16_patch_is_restored() -> None:
    """The fp32 rows' no-op ``Tensor.bfloat16`` lives only inside torchtitan's experts."""
    bench_moe.run_point(bench_moe.Point(SOFTMAX, 1, 8, "fp32"), 1, 1, 0, with_titan=True)
    assert torch.ones(1).bfloat16().dtype == torch.bfloat16

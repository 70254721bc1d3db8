"""tools/sweep_grouped_gemm.py's dry run: every launch configuration it would time on a GPU,
the warp-specialized experiments included, runs under the Triton interpreter and matches the
float64 reference (the GPU run needs a lease; its plumbing is checked here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.heavy  # NOTE: ~20 s of the interpreter
def test_every_config_runs_and_matches_the_reference_under_the_interpreter():
    sys.path.insert(0, str(ROOT / "tools"))
    import sweep_grouped_gemm as sweep

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    argv = [sys.executable, "tools/sweep_grouped_gemm.py", "--quick", "--no-write"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| toy |")]
    configs = sweep.experiments()
    for kernel, passed in (("rows", "fwd"), ("ragged_k", "dW")):
        labels = [row.split(" | ")[2] for row in rows if row.split(" | ")[1] == passed]
        assert labels[0] == "torch._grouped_mm"
        assert labels[1:] == [sweep._label(c) for c in configs[kernel]]
        assert any(label.endswith(" ws") for label in labels)
    assert not any("failed" in row for row in rows)

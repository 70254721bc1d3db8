"""tools/gpu_check's command line on this Python (3.11 in the main lane, 3.12 in the GPU-image
lane): no phase means both, an unknown phase or benchmark is one line and exit 2. Python 3.11's
argparse refused the empty phase list when the phases were argparse choices."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # no phase given: parsing gets past the phases to the benchmark check
        (["--cpu-dry-run", "--benches", "nope"], "unknown benchmark(s) ['nope']"),
        (["nope"], "unknown phase(s) ['nope']; choose from ['tests', 'bench', 'fetch-wheels']"),
        (["fetch-wheels", "--cpu-dry-run"], "fetch-wheels runs alone"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], message: str):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("tools/gpu_check: error: ") and message in last, out.stderr


def test_steps_known_to_be_skipped_keep_no_time_back(tmp_path: Path):
    """The third H200 lease: six skipped smokes (argv None) each kept 25 s back, so the tests
    step got 120 s of a 330 s budget and timed out."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    phase = gpu_check.Phase("t", True, 100.0, tmp_path / "log", {})
    run = gpu_check.Step("run", [sys.executable, "-c", "pass"], 90, 5)
    skipped = [gpu_check.Step(f"smoke {i}", None, 90, 25, skip_note="-") for i in range(6)]
    kept = gpu_check.Step("nccl", [sys.executable, "-c", "pass"], 90, 30)
    phase.run([run, *skipped, kept])
    first, *_, last = phase.results
    assert first.status == "ok" and last.status == "ok"
    assert first.timeout_s is not None and 60 < first.timeout_s <= 70  # 100 s less nccl's 30

"""Faults during a checkpoint save, on real ranks started by ``forge train``'s launcher.

A rank of a 2-rank run fails while the checkpoint of step 4 is written (the fault comes from
``faults/sitecustomize.py``): SIGKILLed after rank 0's shard is written and before its own (a
save killed between shards), or its write fails with ENOSPC (a full disk). Either way the user
reads one line naming the rank and the cause, and the checkpoint of step 2 stays the newest
intact one; running the same command again resumes from it and reproduces the interrupted run's
steps 3 and 4 bit for bit. (The other phases of a save, killed in one process: test_train.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from forge_checkpoint.files import latest_intact

ROOT = Path(__file__).resolve().parents[2]
FAULTS = Path(__file__).with_name("faults")


def _forge_train(out: Path, fault: str | None) -> subprocess.CompletedProcess:
    path = [str(ROOT), str(FAULTS), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    env.pop("FORGE_FAULT", None)
    if fault:
        env["FORGE_FAULT"] = fault
    sets = {
        "training.steps": "4",
        "training.seq_len": "16",
        "training.out_dir": f"'{out}'",
        "parallelism.tp": "1",
        "checkpoint.every": "2",
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    return subprocess.run(
        [sys.executable, "-m", "forge.cli", "train", "--nproc", "2", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=out.parent,
        timeout=300,
    )


def _steps(out: Path) -> list[tuple[int, float, float]]:
    """(step, loss, grad norm) of every step record in metrics.jsonl, in the order written."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]


@pytest.mark.lifecycle  # NOTE: a whole forge train killed or starved of disk: the process lane
@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ("kill:1:4", "rank 1 was killed by SIGKILL (its log: "),
        ("enospc:1:4", "No space left on device"),
    ],
)
def test_a_rank_failing_mid_save_is_one_line_and_resume_reproduces_the_run(
    tmp_path: Path, fault: str, says: str
):
    out = tmp_path / "run"
    failed = _forge_train(out, fault)
    assert failed.returncode == 1, failed.stderr[-3000:]
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert lines[0].startswith("forge train: FAIL: rank ") and says in lines[0], lines[0]
    root = out / "checkpoints"
    tmp = root / ".tmp-step-00000004"
    assert (tmp / "__0_0.distcp").is_file() and not (tmp / "__1_0.distcp").exists()
    assert latest_intact(root) == (root / "step-00000002", [])
    interrupted = _steps(out)
    assert [s[0] for s in interrupted] == [1, 2, 3, 4]
    print(lines[0])
    if fault.startswith("enospc"):
        return  # resuming after a fault is the same either way: proven once, below

    resumed = _forge_train(out, None)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {root / 'step-00000002'}" in resumed.stderr
    again = _steps(out)[len(interrupted) :]  # the resumed run's records
    assert again == interrupted[2:]  # steps 3 and 4, loss and grad norm bit for bit
    assert latest_intact(root) == (root / "step-00000004", []) and not tmp.exists()

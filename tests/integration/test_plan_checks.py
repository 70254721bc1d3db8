"""A tp.plan whose import is allowed but whose content is wrong is refused before any rank
starts, with one line (job.check_config imports it and checks it on a meta-device model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from forge.job import check_config
from forge_core import ForgeConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = "tests.tp_plans.plan_fixtures"


def _cfg(plan: str):
    return load_config(None, [f"tp.plan='{plan}'", "tp.allow_import=['tests.tp_plans']"])


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (f"{FIXTURES}:MISSING", f"module '{FIXTURES}' has no name 'MISSING'"),
        (f"{FIXTURES}:A_NUMBER", "gave a int; it must be a dict"),
        (f"{FIXTURES}:NOT_A_PLAN", "gave a list; it must be a dict"),
        (f"{FIXTURES}:returns_none", "gave a NoneType; it must be a dict"),
        (f"{FIXTURES}:one_argument", "a function of one argument"),
        (f"{FIXTURES}:raises_inside", "raised RuntimeError: the plan function broke"),
        (f"{FIXTURES}:UNKNOWN_STYLE", "colwize"),
        (f"{FIXTURES}:MATCHES_NOTHING", "'layers.*.mlp.up_proj' matches no module"),
        (f"{FIXTURES}:COLWISE_ON_A_NORM", "gives ColwiseParallel to a RMSNorm"),
        (
            "tests.tp_plans.plan_raises_at_import:PLAN",
            "failed: RuntimeError: this module does something at import",
        ),
    ],
)
def test_a_wrong_plan_is_refused_before_launch(plan: str, message: str):
    with pytest.raises(ForgeConfigError) as err:
        check_config(_cfg(plan), 4)
    text = str(err.value)
    assert text.startswith("tp.plan: ") and message in text, text
    assert "\n" not in text


def test_a_good_imported_plan_passes_the_check():
    check_config(_cfg(f"{FIXTURES}:ffn_only_plan"), 4)
    check_config(_cfg(f"{FIXTURES}:FFN_ONLY"), 4)


def test_the_cli_refuses_a_wrong_plan_with_exit_2_and_one_line(tmp_path: Path):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "forge.cli", "build"]
        + ["--set", f"tp.plan='{FIXTURES}:returns_none'"]
        + ["--set", "tp.allow_import=['tests.tp_plans']"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "gave a NoneType" in proc.stderr, proc.stderr

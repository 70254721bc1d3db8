"""A tp.plan whose import is granted but whose content is wrong is refused before any rank
starts, with one line (job.check_config imports it and checks a plan dict on a meta-device
model); a plan function is never called there, only on the ranks. Imports are granted by the
person (--allow-import, $FORGE_ALLOW_IMPORT), never by the config file that names the plan."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forge.checks import import_problems
from forge.cli import EXIT_CONFIG, _prepare, main
from forge.config import load_config
from forge.job import check_config
from forge_core import ForgeConfigError, Transformer
from forge_core.model_config import ModelConfig
from forge_tp_plans import check_tensor_parallel

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = "tp_plan_fixtures"
#: The plan modules of forge-tp-plans' tests, granted by name (they are top-level modules there)
ALLOW = ["tp_plan_fixtures", "tp_plan_raises_at_import"]
TP_TESTS = ROOT / "packages" / "forge-tp-plans" / "tests"


def _cfg(plan: str):
    return load_config(None, [f"tp.plan='{plan}'", f"tp.allow_import={ALLOW}"])


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (f"{FIXTURES}:MISSING", f"module '{FIXTURES}' has no name 'MISSING'"),
        (f"{FIXTURES}:A_NUMBER", "is a int; a plan is a dict"),
        (f"{FIXTURES}:NOT_A_PLAN", "is a list; a plan is a dict"),
        (f"{FIXTURES}:one_argument", "a function of 1 argument(s)"),
        (f"{FIXTURES}:UNKNOWN_STYLE", "colwize"),
        (f"{FIXTURES}:MATCHES_NOTHING", "'layers.*.mlp.up_proj' matches no module"),
        (f"{FIXTURES}:COLWISE_ON_A_NORM", "gives ColwiseParallel to a RMSNorm"),
        (
            "tp_plan_raises_at_import:PLAN",
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


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (f"{FIXTURES}:returns_none", "gave a NoneType; it must be a dict"),
        (f"{FIXTURES}:raises_inside", "raised RuntimeError: the plan function broke"),
    ],
)
def test_a_plan_function_runs_only_on_the_ranks_and_its_failure_is_one_line(plan, message):
    check_config(_cfg(plan), 4)  # the launcher's check does not call it
    with torch.device("meta"):
        model = Transformer(ModelConfig.preset("debug"))
    with pytest.raises(ForgeConfigError) as err:  # what a rank's apply_tensor_parallel runs
        check_tensor_parallel(model, 2, plan=plan, allow_import=ALLOW)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_launcher_check_imports_a_plan_but_calls_nothing(tmp_path, monkeypatch):
    mark = tmp_path / "called"
    monkeypatch.setenv("FORGE_TEST_CALLED_MARK", str(mark))
    assert import_problems(_cfg(f"{FIXTURES}:records_its_call"), 4) == []
    assert not mark.exists(), "the pre-launch check called the plan function"
    # os.abort takes no argument: a check that calls zero-argument plans would end this process
    cfg = load_config(None, ["tp.plan='os:abort'", "tp.allow_import=['os']"])
    (line,) = import_problems(cfg, 4)
    assert "is a builtin_function_or_method; a plan is a dict" in line, line


def test_the_vlm_encoder_plan_is_import_checked_before_launch():
    overrides = ["model.preset=debug_vlm", "vlm.encoder_tp=true"]
    cfg = load_config(None, [*overrides, f"vlm.encoder_tp_plan='{FIXTURES}:MISSING'"])
    problems = import_problems(cfg, 4)
    assert any("--allow-import tp_plan_fixtures" in p for p in problems), problems
    granted = load_config(
        None,
        [
            *overrides,
            f"vlm.encoder_tp_plan='{FIXTURES}:MISSING'",
            f"tp.allow_import={ALLOW}",
        ],
    )
    (line,) = import_problems(granted, 4)
    assert line.startswith("vlm.encoder_tp_plan: ") and "has no name 'MISSING'" in line, line


def _args(*sets: str, allow: tuple[str, ...] = ()) -> argparse.Namespace:
    return argparse.Namespace(
        config=None, set=list(sets), nproc=4, device="cpu", allow_import=list(allow)
    )


def test_a_config_file_cannot_grant_itself_an_import(tmp_path, monkeypatch, capsys):
    (tmp_path / "evil_plan_mod.py").write_text(
        "import pathlib\npathlib.Path('imported').write_text('ran')\nPLAN = {}\n"
    )
    (tmp_path / "job.toml").write_text(
        '[parallelism]\ntp = 2\n[tp]\nplan = "evil_plan_mod:PLAN"\nallow_import = ["evil_plan_mod"]\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["build", "job.toml"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tp.allow_import" in err and "--allow-import" in err, err
    assert not (tmp_path / "imported").exists()


def test_imports_are_granted_on_the_command_line_or_in_the_environment(tmp_path, monkeypatch):
    """A plan module in the working directory, granted by --allow-import or
    $FORGE_ALLOW_IMPORT, passes the launcher's checks without PYTHONPATH=."""
    (tmp_path / "cwd_plans_mod.py").write_text(
        "PLAN = {'layers.*.feed_forward.w1': 'colwise', 'layers.*.feed_forward.w3': 'colwise',"
        " 'layers.*.feed_forward.w2': 'rowwise'}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delenv("FORGE_ALLOW_IMPORT", raising=False)
    plan = "tp.plan='cwd_plans_mod:PLAN'"
    refused = _prepare(_args(plan), "build")
    assert refused == EXIT_CONFIG
    prepared = _prepare(_args(plan, allow=("cwd_plans_mod",)), "build")
    assert isinstance(prepared, tuple), prepared
    assert prepared[0]["tp"]["allow_import"] == ("cwd_plans_mod",)
    monkeypatch.setenv("FORGE_ALLOW_IMPORT", "other,cwd_plans_mod")
    prepared = _prepare(_args(plan), "build")
    assert isinstance(prepared, tuple), prepared


def test_a_good_imported_plan_passes_the_check():
    check_config(_cfg(f"{FIXTURES}:ffn_only_plan"), 4)
    check_config(_cfg(f"{FIXTURES}:FFN_ONLY"), 4)


def test_the_cli_refuses_a_wrong_plan_with_exit_2_and_one_line(tmp_path: Path):
    path = os.pathsep.join(p for p in (str(TP_TESTS), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "forge.cli", "build"]
        + ["--set", f"tp.plan='{FIXTURES}:A_NUMBER'"]
        + ["--allow-import", FIXTURES],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "is a int" in proc.stderr, proc.stderr

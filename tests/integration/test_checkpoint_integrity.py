"""Checkpoint integrity: a manifest written last, verified before a resume or an export.

One real checkpoint directory (2 ranks, FSDP2, steps 1-3 saved) is made once; each case copies
it, damages step 3 one way, and checks the refusal names the file, that ``resume = "latest"``
falls back to step 2 saying why, and that the CLI exits 3 with one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from forge.cli import EXIT_CONFIG, EXIT_DAMAGED, _checked_resume, _failure_line
from forge.export import export_checkpoint
from forge.train import run_train
from forge_checkpoint.files import (
    MANIFEST,
    CheckpointDamaged,
    checkpoint_lock,
    latest_intact,
    verify_checkpoint,
)
from forge_core import ForgeConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
FORGE = [sys.executable, "-m", "forge.cli"]


def _train(cfg: dict) -> int:
    return len(run_train(cfg, "cpu").steps)


@pytest.fixture(scope="module")
def saved(run_on_ranks, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("saved")
    cfg = {
        "model": {"preset": "debug"},
        "parallelism": {"tp": 1},
        "training": {"steps": 3, "out_dir": str(out), "seq_len": 16},
        "checkpoint": {"every": 1, "keep": 10, "resume": "none", "save_at_end": False},
    }
    assert run_on_ranks(2, _train, cfg) == [3, 0]
    return out / "checkpoints"


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    return root


def _shard(step_dir: Path) -> Path:
    return sorted(step_dir.glob("*.distcp"))[0]


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside tensor data: the file still parses
    f.write_bytes(bytes(data))


DAMAGE = {
    "truncated shard": (lambda d: _truncate(_shard(d)), lambda d: _shard(d).name),
    "flipped bit in a shard": (lambda d: _flip(_shard(d)), lambda d: _shard(d).name),
    "deleted shard": (lambda d: _shard(d).unlink(), lambda d: "distcp is missing"),
    "truncated .metadata": (lambda d: _truncate(d / ".metadata"), lambda d: ".metadata"),
    "corrupt train_state.json": (
        lambda d: (d / "train_state.json").write_text('{"step": 3, '),
        lambda d: "train_state.json",
    ),
    "deleted rng file": (
        lambda d: (d / "rng" / "rank00001.pt").unlink(),
        lambda d: "rng/rank00001.pt is missing",
    ),
    "unreadable manifest": (lambda d: (d / MANIFEST).write_text("{"), lambda d: MANIFEST),
}


def test_every_checkpoint_has_a_manifest_of_all_its_files(saved: Path):
    for step_dir in sorted(saved.iterdir()):
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
        on_disk = {
            f.relative_to(step_dir).as_posix()
            for f in step_dir.rglob("*")
            if f.is_file() and f.name != MANIFEST
        }
        assert set(files) == on_disk and {".metadata", "train_state.json"} <= on_disk
        assert verify_checkpoint(step_dir) is True


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_named_and_latest_falls_back_to_the_newest_intact(copy: Path, kind: str):
    step3 = copy / "step-00000003"
    damage, names = DAMAGE[kind]
    expected = names(step3)
    damage(step3)
    with pytest.raises(CheckpointDamaged) as err:
        verify_checkpoint(step3)
    assert str(err.value).startswith("step-00000003: ") and expected in str(err.value)
    chosen, skipped = latest_intact(copy)
    assert chosen == copy / "step-00000002"
    assert len(skipped) == 1 and expected in skipped[0]


def test_junk_step_directories_are_skipped_or_ignored(copy: Path):
    (copy / "step-abc").mkdir()  # not step-<digits>: ignored
    (copy / "step-00000099").mkdir()  # looks newest, holds nothing
    (copy / "step-00000099" / "notes.txt").write_text("x")
    chosen, skipped = latest_intact(copy)
    assert chosen == copy / "step-00000003"
    assert skipped == ["step-00000099: train_state.json is missing (not a complete checkpoint)"]


def test_resume_latest_picks_the_intact_checkpoint_for_every_rank(copy: Path, capsys):
    _flip(_shard(copy / "step-00000003"))
    cfg = load_config({"checkpoint": {"dir": str(copy)}})
    resumed = _checked_resume(cfg)
    assert resumed.checkpoint.resume == str(copy / "step-00000002")  # a path: ranks agree
    err = capsys.readouterr().err
    assert "skipping damaged checkpoint step-00000003" in err and "resuming from" in err


def test_resume_with_every_checkpoint_damaged_is_refused(copy: Path):
    for step_dir in copy.iterdir():
        _truncate(step_dir / ".metadata")
    with pytest.raises(CheckpointDamaged, match=r"no intact checkpoint .*3 damaged"):
        _checked_resume(load_config({"checkpoint": {"dir": str(copy)}}))


def test_resume_into_another_model_shape_is_refused_before_launch(saved: Path):
    cfg = load_config(
        {"model": {"dim": 128}, "checkpoint": {"resume": str(saved / "step-00000002")}}
    )
    with pytest.raises(ForgeConfigError, match=r"saved for another model \(dim=64 there, 128 here"):
        _checked_resume(cfg)


def test_export_verifies_the_checkpoint(copy: Path, tmp_path: Path):
    _flip(_shard(copy / "step-00000003"))
    with pytest.raises(CheckpointDamaged, match="changed since it was written"):
        export_checkpoint(copy / "step-00000003", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _forge(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m forge.cli *args`` with this checkout first on the import path."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [*FORGE, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )


@pytest.mark.parametrize("command", ["train", "export"])
def test_the_cli_exits_3_with_one_line_naming_the_file(copy: Path, tmp_path: Path, command):
    step3 = copy / "step-00000003"
    _truncate(_shard(step3))
    args = (
        ["train", "--nproc", "2", "--set", f"checkpoint.resume='{step3}'"]
        if command == "train"
        else ["export", str(step3), "--out", str(tmp_path / "out")]
    )
    proc = _forge(args, tmp_path)
    assert proc.returncode == EXIT_DAMAGED, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{_shard(step3).name} has" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


#: ``forge.cli.main`` that reports on stdout whether torch was imported before it returned.
_MAIN_REPORTING_TORCH = (
    "import sys\n"
    "from forge.cli import main\n"
    "status = main(sys.argv[1:])\n"
    "print('torch imported:', 'torch' in sys.modules)\n"
    "sys.exit(status)\n"
)


@pytest.mark.parametrize(
    "case", ["train, damaged", "export, damaged", "train, bad value", "plan, bad value"]
)
def test_refusals_come_before_torch_is_imported(copy: Path, tmp_path: Path, case: str):
    step3 = copy / "step-00000003"
    _flip(_shard(step3))
    args, status = {
        "train, damaged": (["train", "--set", f"checkpoint.dir='{copy}'"], EXIT_DAMAGED),
        "export, damaged": (["export", str(step3), "--out", str(tmp_path / "o")], EXIT_DAMAGED),
        "train, bad value": (["train", "--set", "float8.enabled=maybe"], EXIT_CONFIG),
        "plan, bad value": (
            ["plan", "--world-size", "8", "--set", "model.preset=nope"],
            EXIT_CONFIG,
        ),
    }[case]
    if case == "train, damaged":  # every checkpoint damaged: nothing to fall back to
        for step_dir in copy.iterdir():
            if step_dir != step3:
                _flip(_shard(step_dir))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _MAIN_REPORTING_TORCH, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == status, proc.stderr[-2000:]
    assert proc.stdout.strip() == "torch imported: False"
    assert "Traceback" not in proc.stderr


def _resume_on_ranks(cfg: dict) -> tuple[str, str, int]:
    """run_train on this rank, counting the files this rank checksums; (outcome, message,
    files read)."""
    import forge_checkpoint.files as files

    reads = []
    crc32 = files._crc32
    files._crc32 = lambda path: reads.append(path) or crc32(path)
    try:
        summary = run_train(cfg, "cpu")
        return "trained", str(summary.resumed_from), len(reads)
    except ForgeConfigError as e:  # CheckpointDamaged is one
        return type(e).__name__, str(e), len(reads)
    finally:
        files._crc32 = crc32


def test_under_torchrun_rank_0_verifies_and_every_rank_gets_its_verdict(
    run_on_ranks, copy: Path, tmp_path: Path
):
    """Without forge's launcher (torchrun, the Python API) the ranks pick the checkpoint: rank
    0 reads it once, the others hear the outcome, and a refusal is the same error on all."""
    base = {
        "model": {"preset": "debug"},
        "parallelism": {"tp": 1},
        "training": {"steps": 4, "out_dir": str(tmp_path / "run"), "seq_len": 16},
        "checkpoint": {"dir": str(copy), "save_at_end": False},
    }
    _flip(_shard(copy / "step-00000003"))
    (rank0, rank1) = run_on_ranks(2, _resume_on_ranks, base)
    assert rank0[:2] == rank1[:2] == ("trained", str(copy / "step-00000002"))
    assert rank0[2] > 0 and rank1[2] == 0, "only rank 0 reads the checkpoint"

    damaged = {**base, "checkpoint": {**base["checkpoint"], "resume": str(copy / "step-00000003")}}
    outcomes = run_on_ranks(2, _resume_on_ranks, damaged)
    assert {o[:2] for o in outcomes} == {
        ("CheckpointDamaged", outcomes[0][1])
    } and "changed since it was written" in outcomes[0][1]
    assert [o[2] > 0 for o in outcomes] == [True, False]

    other_model = {**base, "model": {"preset": "debug", "dim": 128}}
    outcomes = run_on_ranks(2, _resume_on_ranks, other_model)
    assert {o[:2] for o in outcomes} == {("ForgeConfigError", outcomes[0][1])}
    assert "saved for another model" in outcomes[0][1]


def test_a_second_run_on_a_locked_checkpoint_directory_is_refused(tmp_path: Path):
    root = tmp_path / "checkpoints"
    with checkpoint_lock(root):
        with (
            pytest.raises(
                ForgeConfigError, match=rf"in use by another forge train \(pid {os.getpid()}\)"
            ),
            checkpoint_lock(root),
        ):
            pass  # NOTE: flock is per open file: a second open conflicts even in-process
        proc = _forge(["train", "--nproc", "2", "--set", f"checkpoint.dir='{root}'"], tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.count("\n") == 1 and "in use by another forge train" in proc.stderr
    with checkpoint_lock(root):  # released at the end of the first run
        pass


@pytest.mark.slow
def test_a_failed_rank_is_one_line_with_its_reason_and_log(tmp_path: Path):
    overrides = {
        "training.lr": "1e36",
        "training.max_grad_norm": "0",
        "training.warmup_steps": "0",
        "training.steps": "4",
        "training.out_dir": f"'{tmp_path / 'run'}'",
    }
    sets = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
    proc = _forge(["train", "--nproc", "2", *sets], tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = lines[0]
    assert line.startswith("forge train: FAIL: rank ") and "exited with code 1: Floating" in line
    assert "loss is nan at step 2" in line
    where = Path(line.rsplit(": ", 1)[1].split(")")[0].split(";")[0])
    assert where.is_file() and where.is_relative_to(tmp_path / "run" / "logs")


def test_a_killed_rank_names_the_signal_and_its_log(tmp_path: Path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    log = tmp_path / "forge-x_abc" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("...")
    killed = ProcessFailure(local_rank=1, pid=123, exitcode=-9, error_file="<N/A>")
    line = _failure_line({1: killed}, tmp_path)
    assert line == f"rank 1 was killed by SIGKILL (its log: {log})"


def _failure(exitcode: int, message: str, timestamp: int) -> SimpleNamespace:
    """What _failure_line reads of torch's ProcessFailure."""
    return SimpleNamespace(
        exitcode=exitcode,
        message={"message": message},
        timestamp=timestamp,
        error_file="<N/A>",
        signal_name=lambda: "SIGKILL",
    )


def test_the_failure_line_names_the_cause_not_its_echo(tmp_path: Path):
    lost = "RuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:5778. GLHF"
    cause = "CheckpointIOError: writing checkpoint step-00000004 failed on rank 1: OSError: full"
    # the rank that lost its peer exited first, yet the one with the real error is named
    line = _failure_line({0: _failure(1, lost, 10), 1: _failure(1, cause, 11)}, tmp_path)
    assert line.startswith(f"rank 1 exited with code 1: {cause} (")
    # a rank killed by a signal is the cause of the others' errors
    line = _failure_line({0: _failure(1, cause, 10), 1: _failure(-9, "", 12)}, tmp_path)
    assert line.startswith("rank 1 was killed by SIGKILL (")
    # a message holding a traceback (torch's CheckpointException) stays on one line
    tb = "Boom ranks:[1]\nTraceback (most recent call last):\n  File 'x.py'\nOSError: full\n"
    line = _failure_line({2: _failure(1, tb, 1)}, tmp_path)
    assert (
        line == "rank 2 exited with code 1: Boom ranks:[1] ... OSError: full (its output is above)"
    )


def test_a_failed_checkpoint_write_is_one_plain_error():
    from forge_checkpoint.dcp import CheckpointIOError, _plain_errors
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(28, "No space left on device")
    with pytest.raises(CheckpointIOError) as err, _plain_errors("writing checkpoint step-4"):
        raise CheckpointException("failed", {3: (full, None), 1: (full, None)})
    assert str(err.value) == (
        "writing checkpoint step-4 failed on rank 1 (and on rank(s) [3]): "
        "OSError: [Errno 28] No space left on device"
    )
    assert isinstance(err.value, Exception)  # torch's is a BaseException: handlers missed it

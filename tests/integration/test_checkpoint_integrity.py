"""Checkpoint integrity: a manifest written last, verified before a resume or an export, with
what a recomputed manifest cannot hide (each shard bound to its checkpoint, the train state's
fields), no code run from a checkpoint's index, and no directory forge did not write touched.

One real checkpoint directory (2 ranks, FSDP2, steps 1-3 saved) is made once; each case copies
it, damages step 3 one way, and checks the refusal names the file, that ``resume = "latest"``
falls back to step 2 saying why, and that the CLI exits 3 with one line.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from forge import load_config
from forge.cli import EXIT_CONFIG, EXIT_DAMAGED, _checked_resume, _failure_line, main
from forge.export import export_checkpoint
from forge.train import run_train
from forge_checkpoint.files import (
    MANIFEST,
    CheckpointDamaged,
    checkpoint_lock,
    foreign_dirs,
    latest_intact,
    verify_checkpoint,
    write_manifest,
)
from forge_checkpoint.lock import rank_lock, run_lock
from forge_core import ForgeConfigError

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
    "deleted manifest": (lambda d: (d / MANIFEST).unlink(), lambda d: f"{MANIFEST} is missing"),
    "emptied manifest": (
        lambda d: (d / MANIFEST).write_text('{"format": 1, "algorithm": "crc32", "files": {}}'),
        lambda d: f"{MANIFEST} does not list",
    ),
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


def test_junk_step_directories_are_told_apart_from_damaged_checkpoints(copy: Path):
    (copy / "step-abc").mkdir()  # not step-<digits>: ignored
    (copy / "step-00000098").mkdir()  # empty: nothing to skip, nothing to lose
    (copy / "step-00000099").mkdir()  # looks newest, holds someone's file
    (copy / "step-00000099" / "notes.txt").write_text("x")
    chosen, skipped = latest_intact(copy)
    assert chosen == copy / "step-00000003"
    assert skipped == [
        "step-00000099: not written by forge (no valid .forge-checkpoint); left alone"
    ]
    assert foreign_dirs(copy) == [copy / "step-00000099"]
    (copy / "step-00000003" / MANIFEST).unlink()  # a forge checkpoint, damaged: said as such
    chosen, skipped = latest_intact(copy)
    assert chosen == copy / "step-00000002" and skipped[1].startswith(
        "step-00000003: manifest.json is missing"
    )


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


# ---- what a recomputed manifest cannot hide ------------------------------------------------------


def _payload(marker: Path) -> bytes:
    """A DCP index naming ``torch.distributed.checkpoint.metadata.os.system`` (pickle protocol 4
    resolves the dotted name as an attribute chain), called to create ``marker``."""
    module, name, command = (
        b"torch.distributed.checkpoint.metadata",
        b"os.system",
        f"touch {marker}".encode(),
    )
    out = b"\x80\x04"
    for raw in (module, name):
        out += b"X" + len(raw).to_bytes(4, "little") + raw
    return out + b"\x93" + pickle.dumps(command.decode(), protocol=3)[2:-1] + b"\x85R."


def _plant(step_dir: Path, marker: Path, manifest: str) -> None:
    (step_dir / ".metadata").write_bytes(_payload(marker))
    if manifest == "recomputed":
        write_manifest(step_dir)
    else:
        (step_dir / MANIFEST).unlink()


@pytest.mark.parametrize("manifest", ["recomputed", "deleted"])
def test_code_planted_in_the_index_never_runs_on_resume_or_export(
    copy: Path, tmp_path: Path, manifest: str, capsys
):
    marker, step3 = tmp_path / "pwned", copy / "step-00000003"
    pickle.loads(_payload(marker))  # the payload works: unrestricted, it runs
    assert marker.exists()
    marker.unlink()
    _plant(step3, marker, manifest)
    refused = {"recomputed": "metadata refers to", "deleted": f"{MANIFEST} is missing"}[manifest]
    resume = load_config({"checkpoint": {"dir": str(copy), "resume": str(step3)}})
    with pytest.raises(CheckpointDamaged, match=rf"^step-00000003: .*{refused}"):
        _checked_resume(resume)  # forge train's launcher, before any rank starts
    latest = _checked_resume(load_config({"checkpoint": {"dir": str(copy)}}))
    assert latest.checkpoint.resume == str(copy / "step-00000002")  # step 3 skipped, said why
    assert "skipping damaged checkpoint step-00000003: " in capsys.readouterr().err
    for verify in (True, False):
        with pytest.raises(CheckpointDamaged, match="step-00000003: "):
            export_checkpoint(step3, tmp_path / "out.safetensors", verify=verify)
    assert main(["export", str(step3), "--out", str(tmp_path / "o.safetensors")]) == EXIT_DAMAGED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("forge export: damaged checkpoint: step-00000003")
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def test_code_planted_in_the_index_never_runs_on_the_ranks(run_on_ranks, copy: Path, tmp_path):
    """Without forge's launcher (torchrun): rank 0 picks the checkpoint, and with
    ``checkpoint.verify = false`` (what the launcher passes) every rank's load reads the index."""
    marker, step3 = tmp_path / "pwned", copy / "step-00000003"
    _plant(step3, marker, "recomputed")
    base = {
        "model": {"preset": "debug"},
        "parallelism": {"tp": 1},
        "training": {"steps": 4, "out_dir": str(tmp_path / "run"), "seq_len": 16},
        "checkpoint": {"dir": str(copy), "save_at_end": False},
    }
    unverified = {**base, "checkpoint": {**base["checkpoint"], "resume": str(step3)}}
    unverified["checkpoint"]["verify"] = False
    for cfg in (base, unverified):
        outcomes = run_on_ranks(2, _resume_on_ranks, cfg)
        if cfg is base:  # rank 0 verified: step 3 skipped, step 2 resumed
            assert [o[:2] for o in outcomes] == [("trained", str(copy / "step-00000002"))] * 2
        else:
            assert {o[0] for o in outcomes} == {"CheckpointDamaged"}, outcomes
            assert outcomes[0][1].startswith("step-00000003: ") and "metadata" in outcomes[0][1]
    assert not marker.exists()


def test_a_truncated_index_is_one_line_in_resume_load_and_export(
    run_on_ranks, copy: Path, tmp_path: Path
):
    step3 = copy / "step-00000003"
    _truncate(step3 / ".metadata")
    write_manifest(step3)
    expected = "step-00000003: .metadata is not a readable DCP index"
    with pytest.raises(CheckpointDamaged, match=expected):
        _checked_resume(load_config({"checkpoint": {"dir": str(copy), "resume": str(step3)}}))
    with pytest.raises(CheckpointDamaged, match=expected):
        export_checkpoint(step3, tmp_path / "out")
    cfg = {
        "model": {"preset": "debug"},
        "parallelism": {"tp": 1},
        "training": {"steps": 4, "out_dir": str(tmp_path / "run"), "seq_len": 16},
        "checkpoint": {"dir": str(copy), "resume": str(step3), "verify": False},
    }
    outcomes = run_on_ranks(2, _resume_on_ranks, cfg)
    assert {o[0] for o in outcomes} == {"CheckpointDamaged"}
    assert all(o[1].startswith(expected) and "\n" not in o[1] for o in outcomes), outcomes


def test_a_shard_copied_from_another_checkpoint_is_refused(
    run_on_ranks, copy: Path, tmp_path: Path, capsys
):
    step2, step3 = copy / "step-00000002", copy / "step-00000003"
    shard = _shard(step3).name
    shutil.copy(step2 / shard, step3 / shard)  # same run, same layout: the same offsets
    write_manifest(step3)  # with its manifest entry
    verify_checkpoint(step3)  # every CRC matches
    copied = rf"^step-00000003: {shard} belongs to another checkpoint"
    with pytest.raises(CheckpointDamaged, match=copied):
        _checked_resume(load_config({"checkpoint": {"dir": str(copy), "resume": str(step3)}}))
    latest = _checked_resume(load_config({"checkpoint": {"dir": str(copy)}}))
    assert latest.checkpoint.resume == str(step2)
    assert f"skipping damaged checkpoint step-00000003: {shard} belongs" in capsys.readouterr().err
    with pytest.raises(CheckpointDamaged, match=copied):
        export_checkpoint(step3, tmp_path / "out")
    cfg = {  # the ranks' own load, as the launcher passes it (verified: not again)
        "model": {"preset": "debug"},
        "parallelism": {"tp": 1},
        "training": {"steps": 4, "out_dir": str(tmp_path / "run"), "seq_len": 16},
        "checkpoint": {"dir": str(copy), "resume": str(step3), "verify": False},
    }
    outcomes = run_on_ranks(2, _resume_on_ranks, cfg)
    assert {o[0] for o in outcomes} == {"CheckpointDamaged"}, outcomes
    assert outcomes[0][1] == outcomes[1][1] and f"{shard} belongs to" in outcomes[0][1]


def _edit(step_dir: Path, edit) -> None:
    state = json.loads((step_dir / "train_state.json").read_text())
    edit(state)
    (step_dir / "train_state.json").write_text(json.dumps(state, indent=1))
    write_manifest(step_dir)  # recomputed: every CRC matches


@pytest.mark.parametrize(
    ("field", "edit", "says"),
    [
        ("step", lambda s: s.update(step=5), "has step=5, but the checkpoint is step 3"),
        (
            "scheduler.base_lrs",
            lambda s: s["scheduler"].update(base_lrs=[0.01]),
            "scheduler.base_lrs=[0.01], but the param groups' initial_lr are [0.001]",
        ),
        (
            "data_position",
            lambda s: s.update(data_position=0),
            "data_position=0, but step=3",
        ),
        (
            "scheduler.last_epoch",
            lambda s: s["scheduler"].update(last_epoch=1),
            "scheduler.last_epoch=1, but step=3",
        ),
        ("mesh", lambda s: s.update(mesh={"dp_shard": 4}), "mesh={'dp_shard': 4}, not a layout"),
    ],
)
def test_an_edited_train_state_is_refused_naming_the_field(
    copy: Path, field: str, edit, says: str, capsys
):
    step3 = copy / "step-00000003"
    _edit(step3, edit)
    with pytest.raises(CheckpointDamaged) as err:
        _checked_resume(load_config({"checkpoint": {"dir": str(copy), "resume": str(step3)}}))
    assert str(err.value).startswith("step-00000003: ") and says in str(err.value), err.value
    latest = _checked_resume(load_config({"checkpoint": {"dir": str(copy)}}))
    assert latest.checkpoint.resume == str(copy / "step-00000002")
    assert f"skipping damaged checkpoint {err.value}" in capsys.readouterr().err


def _foreign(root: Path) -> Path:
    (root / "step-00000002").mkdir(parents=True)
    thesis = root / "step-00000002" / "thesis.tex"
    thesis.write_text("\\chapter{Five years}")
    return thesis


@pytest.mark.parametrize("resume", ["latest", "none"])
def test_a_directory_forge_did_not_write_is_refused_before_launch_and_kept(
    tmp_path: Path, resume: str, capsys
):
    mydata = tmp_path / "mydata"
    thesis = _foreign(mydata)
    sets = ["--set", f"checkpoint.dir='{mydata}'", "--set", f"checkpoint.resume='{resume}'"]
    sets += ["--set", f"training.out_dir='{tmp_path / 'run'}'"]
    assert main(["train", "--nproc", "2", *sets]) == EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("forge train: config error: checkpoint.dir=") and (
        "step-00000002, not written by forge" in err[0]
    )
    assert "move it out of" in err[0] and "resume=none" not in err[0]
    assert thesis.read_text() == "\\chapter{Five years}"


def test_a_directory_forge_did_not_write_is_refused_on_the_ranks(run_on_ranks, tmp_path: Path):
    """Under torchrun rank 0 checks the directory, whatever checkpoint.resume says."""
    mydata = tmp_path / "mydata"
    thesis = _foreign(mydata)
    cfg = {
        "model": {"preset": "debug"},
        "parallelism": {"tp": 1},
        "training": {"steps": 2, "out_dir": str(tmp_path / "run"), "seq_len": 16},
        "checkpoint": {"dir": str(mydata), "resume": "none", "every": 1},
    }
    outcomes = run_on_ranks(2, _resume_on_ranks, cfg)
    assert {o[0] for o in outcomes} == {"ForgeConfigError"}
    assert "not written by forge" in outcomes[0][1] and outcomes[0][1] == outcomes[1][1]
    assert thesis.is_file() and sorted(p.name for p in mydata.iterdir()) == ["step-00000002"]


@pytest.fixture(scope="module")
def moe_saved(run_on_ranks, tmp_path_factory) -> Path:
    """A checkpoint of an MoE model whose router has a bias (``moe.router_bias = true``)."""
    out = tmp_path_factory.mktemp("moe")
    cfg = {
        "model": {"preset": "debug_moe"},
        "moe": {"router_bias": True},
        "parallelism": {"tp": 1},
        "training": {"steps": 1, "out_dir": str(out), "seq_len": 16},
        "checkpoint": {"every": 1, "resume": "none", "save_at_end": False},
    }
    assert run_on_ranks(2, _train, cfg) == [1, 0]
    return out / "checkpoints" / "step-00000001"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"router_bias": False}, "router_bias=True there, False here"),
        ({"expert_linear_bias": True}, "it lacks 6 tensor(s) of this model"),
        ({"shared_expert_gate": True}, "shared_expert_gate=False there, True here"),
    ],
)
def test_resume_into_a_model_with_other_tensors_is_refused_before_launch(
    moe_saved: Path, change: dict, says: str
):
    model, resume = {"preset": "debug_moe"}, {"resume": str(moe_saved)}
    moe = {"router_bias": True, **change}
    cfg = load_config({"model": model, "moe": moe, "checkpoint": resume})
    with pytest.raises(ForgeConfigError, match="was saved for another model") as err:
        _checked_resume(cfg)
    assert says in str(err.value), err.value
    same_cfg = load_config({"model": model, "moe": {"router_bias": True}, "checkpoint": resume})
    assert _checked_resume(same_cfg).checkpoint.resume == str(moe_saved)


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


def _refusal(dirs: dict, **kwargs: bool) -> str:
    """The message of the ForgeConfigError that ``run_lock(dirs)`` raises at once."""
    with pytest.raises(ForgeConfigError) as refused, run_lock(dirs, **kwargs):
        pass
    return str(refused.value)


def test_a_run_holds_its_directories_until_its_last_process_ends(tmp_path: Path):
    out, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    dirs = {"training.out_dir": out, "checkpoint.dir": ckpt}
    pid = os.getpid()  # NOTE: flock is per open file: a second open conflicts even in-process
    in_use = f"is in use by another forge train (pid {pid}); wait for it to finish, or give"
    with run_lock(dirs):  # a launcher
        refused = _refusal({"training.out_dir": out, "checkpoint.dir": tmp_path / "other"})
        assert refused == f"training.out_dir '{out}' {in_use} this run its own training.out_dir"
        refused = _refusal({"training.out_dir": tmp_path / "b", "checkpoint.dir": ckpt})
        assert refused == f"checkpoint.dir '{ckpt}' {in_use} this run its own checkpoint.dir"
    with rank_lock([out, ckpt]):  # a rank that outlived its launcher
        assert _refusal(dirs) == (
            f"training.out_dir '{out}' is still in use by rank(s) of an earlier forge train "
            f"whose launcher is gone (pid {pid}); wait for them to exit, or kill {pid}"
        )
        with run_lock(dirs, check_ranks=False), rank_lock([out, ckpt]):
            pass  # torchrun's rank 0 beside its own ranks, which share the ranks' lock
    with run_lock(dirs), checkpoint_lock(tmp_path / "b"):
        pass  # free again once every process of the run has let go


def test_the_run_lock_opens_only_forges_own_files(tmp_path: Path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / ".lock").write_text("the user's own notes\n")
    with checkpoint_lock(root), rank_lock([root]):
        pass
    assert (root / ".lock").read_text() == "the user's own notes\n"  # never truncated
    assert sorted(p.name for p in root.iterdir()) == [
        ".forge-ranks.lock",
        ".forge-run.lock",
        ".lock",
    ]
    assert (root / ".forge-run.lock").read_bytes() == b""  # the holders come from /proc/locks


def test_forge_train_refuses_a_directory_in_use_before_any_rank_starts(
    tmp_path, capsys, monkeypatch
):
    from forge import cli

    monkeypatch.setattr(cli, "_launch_local", lambda *a, **k: pytest.fail("a rank was started"))
    out, mine = tmp_path / "run", tmp_path / "mine"
    train = ["train", "--nproc", "2", "--set", f"training.out_dir='{out}'"]
    train += ["--set", f"checkpoint.dir='{mine}'"]
    with run_lock({"training.out_dir": out}):  # another run writes there, to its own checkpoints
        assert cli.main(train) == EXIT_CONFIG
    assert capsys.readouterr().err.splitlines() == [
        f"forge train: config error: training.out_dir '{out}' is in use by another forge train "
        f"(pid {os.getpid()}); wait for it to finish, or give this run its own training.out_dir"
    ]
    with rank_lock([mine]):  # a rank of an earlier run that outlived its launcher
        assert cli.main(train) == EXIT_CONFIG
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"forge train: config error: checkpoint.dir '{mine}' is still in use")


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

"""``forge export --out``: a path that cannot take the export is one line and exit 2, before the
checkpoint is read; a file forge did not write is never overwritten, and an HF export leaves
the other files of its folder alone.

One real checkpoint (2 ranks, 1 step) is saved once for the module; every case calls
``forge.cli.main`` in this process (a subprocess per case would cost 20-40 s here).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import forge.export
import forge_checkpoint.files
import pytest
from checkpoint_places import read_only_dir
from forge.cli import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, main
from forge.train import run_train
from forge_checkpoint.export import load_safetensors

transformers = pytest.importorskip("transformers")


def _train(cfg: dict) -> int:
    return len(run_train(cfg, "cpu").steps)


@pytest.fixture(scope="module")
def step(run_on_ranks, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("saved")
    cfg = {
        "model": {"preset": "debug"},
        "parallelism": {"tp": 1},
        "training": {"steps": 1, "out_dir": str(out), "seq_len": 16},
        "checkpoint": {"every": 1, "resume": "none", "save_at_end": False},
    }
    assert run_on_ranks(2, _train, cfg) == [1, 0]
    return out / "checkpoints" / "step-00000001"


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The checkpoints ``forge export`` opened (its first read is the train state)."""
    opened: list[str] = []
    real = forge_checkpoint.files.read_train_state

    def spy(path):
        opened.append(str(path))
        return real(path)

    monkeypatch.setattr(forge_checkpoint.files, "read_train_state", spy)
    return opened


def _export(capsys, step: Path, out: str | Path, *extra: str) -> tuple[int, list[str]]:
    """``forge export STEP --out OUT *extra``: (exit status, stderr lines)."""
    status = main(["export", str(step), "--out", str(out), *extra])
    return status, capsys.readouterr().err.strip().splitlines()


CASES = {
    # case: (--out under tmp_path, extra arguments, what the one line says)
    "existing folder": ("a-folder", [], "is a folder, but the export is one file"),
    "existing foreign file": ("theirs.safetensors", [], "exists and forge did not write it"),
    "existing file, --format hf": ("theirs.safetensors", ["--format", "hf"], "is a file, but"),
    "foreign file in the hf folder": ("hf-theirs", ["--format", "hf"], "holds 'config.json'"),
    "NUL in the path": ("m\0.safetensors", [], "contains a NUL byte"),
    "overlong name": ("m" * 300 + ".safetensors", [], "over this filesystem's limit of"),
    "a file as a folder": ("theirs.safetensors/m.safetensors", [], "is a file, not a folder"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_out_is_one_line_and_exit_2_before_the_checkpoint_is_read(
    step, tmp_path, capsys, reads, case
):
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "theirs.safetensors").write_bytes(b"someone else's")
    (tmp_path / "hf-theirs").mkdir()
    (tmp_path / "hf-theirs" / "config.json").write_text("{}")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    out, extra, said = CASES[case]
    status, lines = _export(capsys, step, f"{tmp_path}/{out}", *extra)
    assert status == EXIT_CONFIG, lines
    assert len(lines) == 1 and lines[0].startswith("forge export: --out ") and said in lines[0]
    assert reads == []
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_read_only_location_is_one_line_and_exit_2(step, tmp_path, capsys, reads):
    folder = read_only_dir(tmp_path)
    for out, extra in [(folder / "m.safetensors", []), (folder / "hf", ["--format", "hf"])]:
        status, lines = _export(capsys, step, out, *extra)
        assert status == EXIT_CONFIG, lines
        assert len(lines) == 1 and "cannot write in" in lines[0], lines
    assert reads == []


def test_an_export_overwrites_its_own_file_and_keeps_the_hf_folders_other_files(
    step, tmp_path, capsys
):
    out = tmp_path / "new" / "model.safetensors"
    assert _export(capsys, step, out) == (EXIT_OK, [])
    assert _export(capsys, step, out) == (EXIT_OK, [])  # forge's own file: re-exported
    assert "layers.0.attention.wq.weight" in load_safetensors(out)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "README.md").write_text("the user's")
    for _ in range(2):
        assert _export(capsys, step, hf, "--format", "hf") == (EXIT_OK, [])
    assert sorted(p.name for p in hf.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (hf / "README.md").read_text() == "the user's"
    transformers.LlamaForCausalLM.from_pretrained(hf, local_files_only=True)


def test_a_write_that_fails_after_the_checks_is_one_line_and_exit_1(
    step, tmp_path, capsys, monkeypatch
):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(forge.export, "save_safetensors", disk_full)
    status, lines = _export(capsys, step, tmp_path / "m.safetensors")
    assert status == EXIT_FAILED
    assert len(lines) == 1 and "could not write --out" in lines[0] and "No space" in lines[0]
    assert list(tmp_path.iterdir()) == []

"""forge-checkpoint on its own: a checkpoint is verified whole, holds only finite numbers, and
nothing forge did not write is ever removed or replaced.

One process, no process group: a small model with a buffer (BatchNorm) and AdamW.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from forge_checkpoint.binding import verify_shards
from forge_checkpoint.dcp import Checkpointer, load_model_weights
from forge_checkpoint.files import (
    MANIFEST,
    MARKER,
    STATE_FILE,
    CheckpointDamaged,
    foreign_dirs,
    latest_intact,
    verify_checkpoint,
    write_manifest,
    write_marker,
)
from forge_core import ForgeConfigError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(6, 4)).sum().backward()  # BatchNorm's running stats: buffers
    optimizer.step()
    return model, optimizer


def _save(root: Path, step: int, seed: int = 0, **state) -> Path:
    model, optimizer = _model(seed)
    return Checkpointer(root, keep=10).save(step, model, optimizer, {"mine": 1, **state})


def test_a_saved_checkpoint_verifies_whole(tmp_path):
    path = _save(tmp_path, 3)
    marker = json.loads((path / MARKER).read_text())
    state = json.loads((path / STATE_FILE).read_text())
    assert marker["step"] == 3 and marker["checkpoint_id"] == state["checkpoint_id"]
    assert MARKER in json.loads((path / MANIFEST).read_text())["files"]
    assert verify_checkpoint(path) is True
    verify_shards(path)
    model, optimizer = _model(1)
    Checkpointer(tmp_path).load(path, model, optimizer)
    load_model_weights(path, _model(1)[0])


@pytest.mark.parametrize("manifest", ["deleted", "emptied"])
def test_a_missing_or_empty_manifest_is_damage(tmp_path, manifest):
    path = _save(tmp_path, 3)
    if manifest == "deleted":
        (path / MANIFEST).unlink()
    else:  # a manifest that lists no file vouches for none
        (path / MANIFEST).write_text('{"format": 1, "algorithm": "crc32", "files": {}}')
    with pytest.raises(CheckpointDamaged, match=rf"^step-00000003: {MANIFEST} "):
        verify_checkpoint(path)
    assert latest_intact(tmp_path)[0] is None


def _edit_state(path: Path, **fields) -> None:
    state = json.loads((path / STATE_FILE).read_text())
    (path / STATE_FILE).write_text(json.dumps({**state, **fields}, indent=1))
    write_manifest(path)  # recomputed: the CRCs cannot show it


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("step", 2, "has step=2, but the checkpoint is step 3"),
        ("world_size", 4, "rng/ holds 1 file(s), but world_size=4"),
        ("checkpoint_id", "0" * 32, f"its {MARKER} says"),
        ("param_groups", "x", "param_groups='x'"),
        ("mine", float("nan"), "non-finite number at mine"),
    ],
)
def test_an_edited_train_state_is_damage_despite_a_recomputed_manifest(
    tmp_path, field, value, says
):
    path = _save(tmp_path, 3)
    _edit_state(path, **{field: value})
    with pytest.raises(CheckpointDamaged, match=rf"^step-00000003: .*{re.escape(says)}"):
        verify_checkpoint(path)


def test_any_other_edit_of_the_train_state_shows_in_the_shards(tmp_path):
    path = _save(tmp_path, 3)
    _edit_state(path, mine=2)
    verify_checkpoint(path)  # every field the layer knows is consistent
    changed = "train_state.json was changed after the shards were written"
    with pytest.raises(CheckpointDamaged, match=changed):
        verify_shards(path)
    with pytest.raises(CheckpointDamaged, match=changed):
        Checkpointer(tmp_path).load(path, *_model(1))


@pytest.mark.parametrize("file", ["__0_0.distcp", "rng/rank00000.pt"])
def test_a_file_copied_from_another_checkpoint_is_damage(tmp_path, file):
    ours, theirs = _save(tmp_path / "a", 3, seed=0), _save(tmp_path / "b", 3, seed=1)
    shutil.copy(theirs / file, ours / file)
    write_manifest(ours)  # with its manifest entry
    verify_checkpoint(ours)
    copied = rf"^step-00000003: {file} belongs to another checkpoint"
    with pytest.raises(CheckpointDamaged, match=copied):
        verify_shards(ours)
    model, optimizer = _model(2)
    with pytest.raises(CheckpointDamaged, match=copied):
        Checkpointer(tmp_path / "a").load(ours, model, optimizer)
    if file.endswith(".distcp"):
        with pytest.raises(CheckpointDamaged, match=copied):
            load_model_weights(ours, _model(2)[0])


@pytest.mark.parametrize("cut", ["truncated", "garbage"])
def test_a_damaged_index_is_one_line_on_load(tmp_path, cut):
    path = _save(tmp_path, 3)
    index = path / ".metadata"
    raw = index.read_bytes()
    index.write_bytes(raw[: len(raw) // 3] if cut == "truncated" else b"garbage" * 50)
    write_manifest(path)
    for load in (
        lambda: Checkpointer(tmp_path).load(path, *_model(1)),
        lambda: load_model_weights(path, _model(1)[0]),
        lambda: verify_shards(path),
    ):
        with pytest.raises(CheckpointDamaged) as err:
            load()
        assert str(err.value).startswith("step-00000003: .metadata is not a readable DCP index")
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("where", ["parameter", "buffer", "optimizer state", "train state"])
def test_nothing_non_finite_is_saved(tmp_path, where):
    model, optimizer = _model()
    state: dict = {"scheduler": {"base_lrs": [1e-3]}}
    with torch.no_grad():
        if where == "parameter":
            model[0].weight[0, 0] = float("nan")
        elif where == "buffer":
            model[1].running_mean[3] = float("inf")
        elif where == "optimizer state":
            optimizer.state[model[2].bias]["exp_avg"][0] = float("nan")
        else:
            state["scheduler"]["base_lrs"] = [float("nan")]
    first = {
        "parameter": "model.0.weight",
        "buffer": "model.1.running_mean",
        "optimizer state": "optim.2.bias.exp_avg",
        "train state": "train_state.scheduler.base_lrs[0]",
    }[where]
    with pytest.raises(
        FloatingPointError, match=re.escape(f"(first: {first}); checkpoint step-00000002")
    ):
        Checkpointer(tmp_path).save(2, model, optimizer, state)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing written


def _thesis(root: Path, name: str = "step-00000002") -> Path:
    (root / name).mkdir(parents=True)
    thesis = root / name / "thesis.tex"
    thesis.write_text("\\chapter{Five years}")
    return thesis


def test_a_save_never_replaces_a_directory_forge_did_not_write(tmp_path):
    thesis = _thesis(tmp_path)
    model, optimizer = _model()
    with pytest.raises(ForgeConfigError, match="step-00000002' was not written by forge"):
        Checkpointer(tmp_path).save(2, model, optimizer, {})
    assert thesis.read_text() == "\\chapter{Five years}"
    assert foreign_dirs(tmp_path) == [thesis.parent]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]  # no .tmp left


def test_keep_prunes_only_checkpoints_forge_wrote(tmp_path):
    thesis = _thesis(tmp_path, "step-00000001")
    (tmp_path / "step-00000000").mkdir()
    (tmp_path / "step-00000000" / MANIFEST).write_text("{}")  # looks like one: not marked
    model, optimizer = _model()
    checkpointer = Checkpointer(tmp_path, keep=1)
    for step in (2, 3, 4):
        checkpointer.save(step, model, optimizer, {})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-00000000", "step-00000001", "step-00000004"]
    assert thesis.is_file()


def test_cleanup_of_killed_saves_removes_only_what_forge_marked(tmp_path):
    killed = tmp_path / ".tmp-step-00000005"  # a save killed half-way: marked first
    killed.mkdir(parents=True)
    write_marker(killed, "a" * 32, 5)
    (killed / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / ".tmp-step-00000006").mkdir()  # killed before its marker: empty
    foreign = _thesis(tmp_path, ".tmp-step-00000007")
    _save(tmp_path, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step-00000007", "step-00000008"]
    assert foreign.is_file()
    model, optimizer = _model()
    with pytest.raises(ForgeConfigError, match="tmp-step-00000007' was not written by forge"):
        Checkpointer(tmp_path).save(7, model, optimizer, {})  # its own name: refused, kept
    assert foreign.is_file()

"""A checkpoint directory on disk: names, marker, manifest, verification, lock.

No torch import (a launcher verifies a checkpoint before any rank starts, and before it pays
for torch's import); :mod:`forge_checkpoint.dcp` writes and loads the tensors.

- ``.forge-checkpoint`` (:data:`MARKER`) is the first file of every checkpoint: the random
  checkpoint id and the step. It says forge wrote the directory: forge removes or replaces a
  ``step-N`` or ``.tmp-step-N`` directory only when it holds a valid marker (or nothing at all),
  and :func:`foreign_dirs` names the others so that a run can refuse them before it starts.
- ``manifest.json`` is written last, after every rank's files are complete: the size and CRC-32
  of every other file. :func:`verify_checkpoint` re-reads every file against it (a missing,
  added or truncated file, a flipped byte) and then checks what a recomputed manifest cannot
  hide (:func:`check_train_state`: the step against the directory's name, the checkpoint id
  against the marker, one RNG file per saved rank, finite numbers). A checkpoint without a
  manifest, or with an empty one, is damaged: it is never loaded unverified.
- :func:`latest_intact` skips damaged checkpoints and says why, and tells directories forge did
  not write apart from them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forge_core.errors import ForgeConfigError

from .lock import checkpoint_lock

__all__ = [
    "MANIFEST",
    "MARKER",
    "PREFIX",
    "STATE_FILE",
    "TMP_PREFIX",
    "CheckpointDamaged",
    "check_train_state",
    "checkpoint_lock",
    "find_latest",
    "foreign_dirs",
    "forge_written",
    "fsync_dir",
    "is_checkpoint_id",
    "latest_intact",
    "marker_id",
    "nonfinite_at",
    "read_train_state",
    "remove_forge_dir",
    "saved_param_groups",
    "saved_world",
    "step_dir",
    "step_dirs",
    "verify_checkpoint",
    "write_manifest",
    "write_marker",
]


STATE_FILE = "train_state.json"


MANIFEST = "manifest.json"


#: The first file forge writes into every checkpoint directory: its id and step (JSON).
MARKER = ".forge-checkpoint"


PREFIX = "step-"


#: A save in progress: ``.tmp-step-N``, renamed to ``step-N`` once complete.
TMP_PREFIX = f".tmp-{PREFIX}"


#: The most ranks a saved world may have had (2**20: more accelerators than any machine has).
_MAX_WORLD = 2**20


class CheckpointDamaged(ForgeConfigError):
    """A checkpoint whose files are missing, cut short or changed since they were written."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def _step_of(path: Path) -> int | None:
    """N of a ``step-N`` directory name; None for any other name (``step-abc``, ``.tmp-*``)."""
    digits = path.name[len(PREFIX) :]
    return int(digits) if path.name.startswith(PREFIX) and digits.isdigit() else None


def step_dirs(root: Path) -> list[Path]:
    """``step-N`` directories under ``root``, newest first (other names ignored)."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None]
    return sorted(dirs, key=lambda p: _step_of(p) or 0, reverse=True)


def find_latest(root: str | Path) -> Path | None:
    """The newest complete ``step-N`` checkpoint forge wrote under ``root`` (None if there is
    none).

    Complete means its marker, state file and DCP index exist; :func:`latest_intact` also
    verifies it.
    """
    for p in step_dirs(Path(root)):
        if forge_written(p) and (p / STATE_FILE).is_file() and (p / ".metadata").is_file():
            return p
    return None


def _read_json(file: Path) -> Any:
    """The value of a JSON file; None when it is missing, unreadable or not JSON."""
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def is_checkpoint_id(value: object) -> bool:
    """A checkpoint id: 32 lowercase hex digits (``uuid.uuid4().hex``)."""
    return isinstance(value, str) and len(value) == 32 and set(value) <= set("0123456789abcdef")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def marker_id(path: str | os.PathLike[str]) -> str | None:
    """The checkpoint id in the marker of directory ``path``; None without a valid marker."""
    marker = _read_json(Path(path) / MARKER)
    ident = marker.get("checkpoint_id") if isinstance(marker, dict) else None
    return ident if is_checkpoint_id(ident) else None


def forge_written(path: str | os.PathLike[str]) -> bool:
    """Whether forge wrote directory ``path``: a real directory (not a link) with a valid
    marker. Only such directories are ever removed or replaced by forge."""
    path = Path(path)
    return path.is_dir() and not path.is_symlink() and marker_id(path) is not None


def write_marker(path: Path, checkpoint_id: str, step: int) -> None:
    """Write the marker into the new checkpoint directory ``path`` (its first file, fsynced):
    from then on the directory is forge's to remove, should the save be cut off."""
    with open(path / MARKER, "x") as out:
        json.dump({"format": 1, "checkpoint_id": checkpoint_id, "step": step}, out)
        out.flush()
        os.fsync(out.fileno())


def _empty_dir(path: Path) -> bool:
    """A real, empty directory (removing it loses nothing)."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def foreign_dirs(root: str | Path) -> list[Path]:
    """Entries of ``root`` named like checkpoints (``step-N``, ``.tmp-step-*``) that forge did
    not write: anything but a directory with a valid marker or an empty directory. forge never
    removes, replaces or loads them; ``forge train`` refuses to start beside them."""
    root = Path(root)
    if not root.is_dir():
        return []
    named = [p for p in root.iterdir() if _step_of(p) is not None or p.name.startswith(TMP_PREFIX)]
    return sorted(p for p in named if not forge_written(p) and not _empty_dir(p))


def remove_forge_dir(path: Path) -> bool:
    """Remove ``path`` when forge wrote it (:func:`forge_written`) or it is an empty directory;
    anything else is left alone. True when nothing is left at ``path``."""
    if forge_written(path):
        shutil.rmtree(path)
    elif _empty_dir(path):
        path.rmdir()
    return not path.exists() and not path.is_symlink()


def _crc32(path: Path) -> tuple[int, str]:
    """(size, CRC-32 as 8 hex digits) of a file, read in 1 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return size, f"{crc:08x}"


def _files(path: Path) -> list[Path]:
    """Every file of checkpoint ``path`` but its manifest."""
    return sorted(f for f in path.rglob("*") if f.is_file() and f != path / MANIFEST)


def write_manifest(path: Path) -> None:
    """Checksum and fsync every file of the checkpoint at ``path``, then write and fsync the
    manifest (rank 0, after every rank's files are complete)."""
    files = {}
    for f in _files(path):
        size, crc = _crc32(f)
        files[f.relative_to(path).as_posix()] = {"size": size, "crc32": crc}
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # NOTE: DCP fsyncs its shards; the JSON and RNG files are ours
        finally:
            os.close(fd)
    with open(path / MANIFEST, "w") as out:
        json.dump({"format": 1, "algorithm": "crc32", "files": files}, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    for d in {path, *(f.parent for f in _files(path))}:
        fsync_dir(d)


def _manifest(path: Path) -> dict[str, tuple[int, str]]:
    """The manifest of checkpoint ``path``: relative file name -> (size, CRC-32)."""
    name, file = path.name, path / MANIFEST
    if not file.is_file():
        raise CheckpointDamaged(
            f"{name}: {MANIFEST} is missing (every forge checkpoint ends with one; without it "
            "its files cannot be verified)"
        )
    try:
        files = json.loads(file.read_text())["files"]
        expected = {str(k): (int(v["size"]), str(v["crc32"])) for k, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointDamaged(f"{name}: {MANIFEST} is unreadable") from None
    for rel in expected:
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts or rel == MANIFEST:
            raise CheckpointDamaged(f"{name}: {MANIFEST} names {rel!r}, not a checkpoint file")
    for required in (MARKER, STATE_FILE, ".metadata"):
        if required not in expected:
            raise CheckpointDamaged(f"{name}: {MANIFEST} does not list {required}")
    return expected


def verify_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Check every file of checkpoint ``path`` against its manifest, then its train state
    (:func:`check_train_state`). Returns True; raises :class:`CheckpointDamaged` naming the
    first damaged file or field (a missing or empty manifest is damage too)."""
    path = Path(path)
    name = path.name
    if not path.is_dir():
        raise CheckpointDamaged(f"checkpoint {str(path)!r} does not exist")
    expected = _manifest(path)
    for rel, (size, crc) in expected.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointDamaged(f"{name}: {rel} is missing")
        try:
            got_size, got_crc = _crc32(f)
        except OSError as e:
            raise CheckpointDamaged(f"{name}: {rel} cannot be read ({e.strerror})") from None
        if got_size != size:
            raise CheckpointDamaged(f"{name}: {rel} has {got_size} bytes, {size} were written")
        if got_crc != crc:
            raise CheckpointDamaged(
                f"{name}: {rel} changed since it was written (CRC-32 {got_crc}, expected {crc})"
            )
    added = sorted({f.relative_to(path).as_posix() for f in _files(path)} - set(expected))
    if added:
        raise CheckpointDamaged(
            f"{name}: {added[0]} is not in its {MANIFEST} (added after the checkpoint was written)"
        )
    check_train_state(path)
    return True


def nonfinite_at(value: Any, where: str = "") -> str | None:
    """Where the first NaN or infinity in a JSON value is (``scheduler._last_lr[0]``), or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else where or "the top level"
    if isinstance(value, dict):
        children = [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
    elif isinstance(value, list):
        children = [(f"{where}[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    return next((found for key, v in children if (found := nonfinite_at(v, key))), None)


def check_train_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The train state of checkpoint ``path``, checked for what a recomputed manifest cannot
    hide; raises :class:`CheckpointDamaged` naming the field.

    Its ``checkpoint_id`` is the marker's, its ``step`` the marker's and the directory's
    (``step-N``), ``world_size`` a number of ranks with one ``rng/rankNNNNN.pt`` each,
    ``param_groups`` a list of settings, and every number finite. (The shards carry the id
    too: :func:`forge_checkpoint.binding.verify_shards` compares them, with torch.)
    """
    path = Path(path)
    name, state = path.name, read_train_state(path)
    ident, marker = state.get("checkpoint_id"), _read_json(path / MARKER)
    if not is_checkpoint_id(ident):
        raise CheckpointDamaged(f"{name}: {STATE_FILE} has no valid checkpoint_id ({ident!r})")
    theirs = marker.get("checkpoint_id") if isinstance(marker, dict) else None
    if theirs != ident:
        raise CheckpointDamaged(
            f"{name}: {STATE_FILE} is checkpoint {ident}, its {MARKER} says {theirs!r} (a file "
            "from another checkpoint)"
        )
    step = state["step"]
    if not _is_count(step):
        raise CheckpointDamaged(f"{name}: {STATE_FILE} has step={step!r}, not a step number")
    if _step_of(path) not in (None, step) or marker.get("step") != step:
        raise CheckpointDamaged(
            f"{name}: {STATE_FILE} has step={step}, but the checkpoint is step "
            f"{marker.get('step')!r} (its directory name and {MARKER}): edited after it was written"
        )
    world = saved_world(state, path)
    rng = sorted(p.name for p in (path / "rng").iterdir()) if (path / "rng").is_dir() else []
    if len(rng) != world or rng != [f"rank{r:05d}.pt" for r in range(world)]:
        raise CheckpointDamaged(
            f"{name}: rng/ holds {len(rng)} file(s), but world_size={world} ranks saved one each "
            "(rng/rank00000.pt ...)"
        )
    saved_param_groups(state, path)
    where = nonfinite_at(state)
    if where is not None:
        raise CheckpointDamaged(f"{name}: {STATE_FILE} has a non-finite number at {where}")
    return state


def saved_world(state: dict[str, Any], path: Path) -> int:
    """The number of ranks that saved checkpoint ``path`` (train state ``state``)."""
    world = state.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= _MAX_WORLD:
        raise CheckpointDamaged(
            f"{path.name}: {STATE_FILE} has world_size={world!r}, not a number of ranks"
        )
    return world


def saved_param_groups(state: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """The optimizer's param-group settings saved in checkpoint ``path`` (train state
    ``state``): a non-empty list of dicts."""
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise CheckpointDamaged(
            f"{path.name}: {STATE_FILE} has param_groups={groups!r}, not a list of settings"
        )
    return groups


def latest_intact(
    root: str | Path, check: Callable[[Path], object] | None = None
) -> tuple[Path | None, list[str]]:
    """The newest ``step-N`` checkpoint under ``root`` that verifies, and a line for each newer
    one skipped (why). Directories that are not ``step-<digits>`` are ignored; a ``step-N`` that
    forge did not write (no valid marker) is skipped as such, never as damaged.

    ``check``: more checks of a candidate that verified (raising :class:`CheckpointDamaged`),
    e.g. the caller's own train-state fields or the shards' ids.
    """
    skipped = []
    for p in step_dirs(Path(root)):
        if not forge_written(p):
            if not _empty_dir(p):
                skipped.append(f"{p.name}: not written by forge (no valid {MARKER}); left alone")
            continue
        try:
            verify_checkpoint(p)
            if check is not None:
                check(p)
        except CheckpointDamaged as err:
            skipped.append(str(err))
            continue
        return p, skipped
    return None, skipped


def read_train_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON part of a checkpoint: step, scheduler, layout, config."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise ForgeConfigError(
            f"{str(path)!r} is not a forge checkpoint (no {STATE_FILE}); point at a step-N "
            "directory written by forge train"
        )
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        raise CheckpointDamaged(f"{Path(path).name}: {STATE_FILE} is not valid JSON") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointDamaged(f"{Path(path).name}: {STATE_FILE} has no step")
    return state


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

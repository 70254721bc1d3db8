"""A checkpoint directory on disk: names, manifest, verification, lock.

No torch import (a launcher verifies a checkpoint before any rank starts, and before it pays
for torch's import); :mod:`forge_checkpoint.dcp` writes and loads the tensors.

``manifest.json`` is written last in every checkpoint, after every rank's files are complete:
the size and CRC-32 of every other file. :func:`verify_checkpoint` re-reads every file against
it (a missing or truncated file, a flipped byte) and raises :class:`CheckpointDamaged` naming
the file; :func:`latest_intact` skips damaged checkpoints and says why. A checkpoint without a
manifest (written before forge had them) loads unverified.
"""

from __future__ import annotations

import fcntl
import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from forge_core.errors import ForgeConfigError

__all__ = [
    "MANIFEST",
    "PREFIX",
    "STATE_FILE",
    "CheckpointDamaged",
    "checkpoint_lock",
    "find_latest",
    "fsync_dir",
    "latest_intact",
    "read_train_state",
    "step_dir",
    "step_dirs",
    "verify_checkpoint",
    "write_manifest",
]


STATE_FILE = "train_state.json"


MANIFEST = "manifest.json"


PREFIX = "step-"


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
    """The newest complete ``step-N`` checkpoint under ``root`` (None if there is none).

    Complete means its state file and DCP index exist; :func:`latest_intact` also verifies it.
    """
    for p in step_dirs(Path(root)):
        if (p / STATE_FILE).is_file() and (p / ".metadata").is_file():
            return p
    return None


def _crc32(path: Path) -> tuple[int, str]:
    """(size, CRC-32 as 8 hex digits) of a file, read in 1 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return size, f"{crc:08x}"


def _files(path: Path) -> list[Path]:
    return sorted(f for f in path.rglob("*") if f.is_file() and f.name != MANIFEST)


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


def verify_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Check every file of checkpoint ``path`` against its manifest.

    Returns True when verified, False for a checkpoint without a manifest (older forge: not
    verifiable). Raises :class:`CheckpointDamaged` naming the first damaged file.
    """
    path = Path(path)
    name = path.name
    if not path.is_dir():
        raise CheckpointDamaged(f"checkpoint {str(path)!r} does not exist")
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        if not (path / STATE_FILE).is_file() or not (path / ".metadata").is_file():
            missing = STATE_FILE if not (path / STATE_FILE).is_file() else ".metadata"
            raise CheckpointDamaged(f"{name}: {missing} is missing (not a complete checkpoint)")
        return False
    try:
        files = json.loads(manifest_file.read_text())["files"]
        expected = {str(k): (int(v["size"]), str(v["crc32"])) for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointDamaged(f"{name}: {MANIFEST} is unreadable") from None
    for rel, (size, crc) in expected.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointDamaged(f"{name}: {rel} is missing")
        got_size, got_crc = _crc32(f)
        if got_size != size:
            raise CheckpointDamaged(f"{name}: {rel} has {got_size} bytes, {size} were written")
        if got_crc != crc:
            raise CheckpointDamaged(
                f"{name}: {rel} changed since it was written (CRC-32 {got_crc}, expected {crc})"
            )
    return True


def latest_intact(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest ``step-N`` checkpoint under ``root`` that verifies, and a line for each newer
    one skipped (why). Directories that are not ``step-<digits>`` are ignored."""
    skipped = []
    for p in step_dirs(Path(root)):
        try:
            verify_checkpoint(p)
        except CheckpointDamaged as err:
            skipped.append(str(err))
            continue
        return p, skipped
    return None, skipped


@contextmanager
def checkpoint_lock(root: str | Path) -> Iterator[None]:
    """Hold ``<root>/.lock`` exclusively for a run (``flock``: released when the process ends,
    even by ``kill -9``). Raises :class:`ForgeConfigError` at once when another process holds
    it: two runs writing one checkpoint directory would resume from each other's steps."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ForgeConfigError(
            f"checkpoint directory {str(root)!r} is in use by another forge train (pid "
            f"{holder}); wait for it to finish, or give this run its own checkpoint.dir "
            "(or training.out_dir)"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


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
    except (ValueError, UnicodeDecodeError):
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

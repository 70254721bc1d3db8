"""Run locks: one run per directory, held while any process of the run lives.

No torch import: a launcher takes the locks before it starts any rank.

Each locked directory holds two empty files that only forge creates (the names are forge's own,
so no file a user keeps there is ever opened, truncated or deleted; the files stay after the run,
as removing a lock file that another process may be opening would break the lock):

- :data:`RUN_LOCK`: the run's owner (forge's launcher, or rank 0 under torchrun) holds an
  exclusive ``flock`` for the whole run (:func:`run_lock`);
- :data:`RANKS_LOCK`: every rank holds a shared ``flock`` while it lives (:func:`rank_lock`).

A new run needs both free, so it is refused while the old launcher lives and, should the
launcher be gone, while any of its ranks still does. ``flock`` locks belong to an open file and
the kernel drops them when the last process holding it ends, however it ends (``kill -9``
included): a lock is never left behind by a dead run. The refusal names the holders' pids, read
from ``/proc/locks`` (nothing is written into the lock files, so a full disk cannot break them).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

from forge_core.errors import ForgeConfigError

__all__ = ["RANKS_LOCK", "RUN_LOCK", "checkpoint_lock", "lock_holders", "rank_lock", "run_lock"]

RUN_LOCK = ".forge-run.lock"
RANKS_LOCK = ".forge-ranks.lock"


def lock_holders(fd: int) -> list[int]:
    """Pids holding a ``flock`` on the open file ``fd`` (from ``/proc/locks``; Linux).

    Empty when unknown (no ``/proc``). Waiters (``->`` lines) are not holders.
    """
    st = os.fstat(fd)
    me = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    holders = []
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":  # "N: -> FLOCK ..." is a waiter
            continue
        major, minor, inode = fields[5].split(":")
        if (int(major, 16), int(minor, 16), int(inode)) == me:
            holders.append(int(fields[4]))
    return sorted(set(holders))


def _open(directory: Path, name: str, what: str) -> int:
    """``directory/name`` opened for locking (created empty if missing, never truncated)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return os.open(directory / name, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise ForgeConfigError(
            f"{what} {str(directory)!r} cannot be locked for the run: {err.strerror} "
            f"({directory / name}); give this run a directory it can write"
        ) from None


def _pids(fd: int) -> str:
    return ", ".join(map(str, lock_holders(fd))) or "unknown"


@contextmanager
def run_lock(
    dirs: Mapping[str, str | os.PathLike[str]], *, check_ranks: bool = True
) -> Iterator[None]:
    """Hold every directory of ``dirs`` (``{what: path}``, e.g. ``{"training.out_dir": ...}``;
    ``what`` names it in the refusal) for one run.

    Raises :class:`ForgeConfigError` at once, naming the holders' pids and the fix, when another
    run owns a directory or, with ``check_ranks``, when ranks of an earlier run still live there
    (their launcher gone). Under torchrun rank 0 passes ``check_ranks=False``: its own sibling
    ranks may already hold :data:`RANKS_LOCK`. A directory named twice (the same resolved path)
    is locked once.
    """
    with ExitStack() as held:
        seen: set[Path] = set()
        for what, path in dirs.items():
            directory = Path(path)
            if directory.resolve() in seen:
                continue
            seen.add(directory.resolve())
            fd = _open(directory, RUN_LOCK, what)
            held.callback(os.close, fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ForgeConfigError(
                    f"{what} {str(directory)!r} is in use by another forge train (pid "
                    f"{_pids(fd)}); wait for it to finish, or give this run its own {what}"
                ) from None
            if check_ranks:
                _check_no_ranks(directory, what)
        yield


def _check_no_ranks(directory: Path, what: str) -> None:
    """Refuse ``directory`` while a process holds its :data:`RANKS_LOCK` (ranks of a run whose
    owner is gone: the caller holds :data:`RUN_LOCK`, so no live run's ranks can start meanwhile)."""
    fd = _open(directory, RANKS_LOCK, what)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pids = lock_holders(fd)
        listed = ", ".join(map(str, pids)) or "unknown"
        end = f"kill {' '.join(map(str, pids))}" if pids else "end them"
        raise ForgeConfigError(
            f"{what} {str(directory)!r} is still in use by rank(s) of an earlier forge train "
            f"whose launcher is gone (pid {listed}); wait for them to exit, or {end}"
        ) from None
    finally:
        os.close(fd)  # closing drops the test lock


@contextmanager
def rank_lock(dirs: Iterable[str | os.PathLike[str]]) -> Iterator[None]:
    """Hold :data:`RANKS_LOCK` shared in each of ``dirs`` while this rank runs (any number of
    ranks share it; only a new run's exclusive check conflicts with it)."""
    with ExitStack() as held:
        for path in dict.fromkeys(Path(p).resolve() for p in dirs):
            fd = _open(path, RANKS_LOCK, "directory")
            held.callback(os.close, fd)
            # NOTE: blocking: a new launcher holds it exclusively only for its check
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield


@contextmanager
def checkpoint_lock(root: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the checkpoint directory ``root`` for one run (:func:`run_lock`): two runs writing
    one checkpoint directory would resume from each other's steps."""
    with run_lock({"checkpoint.dir": root}):
        yield

"""What forge reads and writes on disk, checked before any rank starts (no torch import).

- :func:`read_toml`: the config file's tables: UTF-8 with or without a byte-order mark; a file
  that is not a readable regular file, not UTF-8, not TOML, or that grants itself imports
  (``tp.allow_import``) is one ``ForgeConfigError`` line;
- :func:`regular_file_problem`: a file forge reads (``data.path``), decided from ``os.stat``
  alone (a FIFO is never opened);
- :func:`dir_problems`: a directory a run creates and writes (``training.out_dir``,
  ``checkpoint.dir``).

:func:`forge.checks.path_problems` composes them for a config; :func:`forge.config.load_config`
reads the file with :func:`read_toml`.
"""

from __future__ import annotations

import codecs
import os
import stat
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from forge_core.errors import ForgeConfigError

__all__ = ["dir_problems", "file_kind", "read_toml", "regular_file_problem"]


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a FIFO (named pipe)"``)."""
    kinds = (
        (stat.S_ISREG, "a file"),
        (stat.S_ISLNK, "a symbolic link to nothing"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


def regular_file_problem(what: str, path: str | Path) -> str | None:
    """One line when ``path`` is not a regular file this process can read (``what`` names it:
    ``"data.path='x'"``); None when it is one.

    NOTE: decided from ``os.stat`` alone: opening a FIFO to look would block until a writer
    comes, and reading a device need never end.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"{what} does not exist"
    except ValueError:  # NOTE: os.stat's "embedded null byte"
        return f"{what} holds a NUL character, which no file name can; fix the path"
    except OSError as e:
        return f"{what} cannot be read: {e.strerror}"
    if not stat.S_ISREG(mode):
        return f"{what} is {file_kind(mode)}, not a regular file; give the path of a file"
    if not os.access(path, os.R_OK):
        return f"{what} cannot be read: permission denied"
    return None


def read_toml(path: Path) -> dict[str, Any]:
    """The tables of TOML file ``path``: UTF-8 with or without a byte-order mark. A file that
    is not a readable regular file, not UTF-8 or not TOML is one ForgeConfigError line; so is a
    file that sets ``tp.allow_import`` (importing runs code: the grant is the command line's)."""
    name = str(path)
    problem = regular_file_problem(f"config file {name!r}", path)
    if problem:
        raise ForgeConfigError(problem)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ForgeConfigError(f"config file {name!r} cannot be read: {e.strerror}") from None
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[start:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = start + e.start
        line = data.count(b"\n", 0, at) + 1
        raise ForgeConfigError(
            f"config file {name!r} is not UTF-8 text: byte 0x{data[at]:02x} at offset {at} "
            f"(line {line}); save the file as UTF-8"
        ) from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ForgeConfigError(f"config file {name!r} is not valid TOML: {e}") from None
    tp = raw.get("tp")
    if isinstance(tp, Mapping) and "allow_import" in tp:
        raise ForgeConfigError(
            f"tp.allow_import cannot be set in a config file ({name}): a file cannot grant "
            "itself imports; pass --allow-import MODULE on the command line or set "
            "FORGE_ALLOW_IMPORT"
        )
    return raw


def dir_problems(key: str, path: str) -> list[str]:
    """What is wrong with directory ``path`` (config field ``key``) that a run creates if
    missing and writes into: no NUL, each missing name within the file system's limit
    (``PC_NAME_MAX``), no file in the way, writable. One line, or none.

    NOTE: writable is proved by creating and removing an empty directory of forge's own in the
    nearest existing directory: ``os.access`` says yes to root on a read-only file system.
    Nothing else is created, and nothing that was there is touched.
    """
    what = f"{key}={path!r}"
    if "\0" in path:
        return [f"{what} holds a NUL character, which no path can; fix the path"]
    target = Path(path).absolute()
    existing = target
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
        path_max = os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096  # NOTE: Linux's limits, where the file system says none
    missing = target.parts[len(existing.parts) :]
    for name in missing:
        if len(os.fsencode(name)) > name_max:
            return [
                f"{what}: the name {name[:24] + '...'!r} is {len(os.fsencode(name))} bytes, more "
                f"than the {name_max} this file system allows for one name; shorten it"
            ]
    if len(os.fsencode(str(target))) >= path_max:
        return [f"{what} is longer than the {path_max - 1} bytes a path may have; shorten it"]
    if not os.path.isdir(existing):
        try:
            kind = file_kind(os.stat(existing).st_mode)
        except OSError:  # NOTE: a symbolic link to nothing (lexists, but stat cannot follow it)
            kind = file_kind(os.lstat(existing).st_mode)
        if existing == target:
            return [f"{what} is {kind}, not a directory; choose another path"]
        return [f"{what} cannot be created: {str(existing)!r} is {kind}, not a directory"]
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".forge-write-probe-", dir=existing))
    except OSError as e:
        at = "" if existing == target else f" in {str(existing)!r}"
        return [f"{what} cannot be written: {e.strerror}{at}; choose a directory you can write to"]
    return []


def importable_problems(key: str, path: str, allow_import: tuple[str, ...]) -> list[str]:
    """What is wrong with ``key=path`` (``module:name``) as something to import: not granted by
    ``allow_import`` (forge_tp_plans' rule), or its top-level module not findable from here.
    Nothing is imported."""
    import importlib.util

    from forge_tp_plans.checks import plan_import_problems

    problems = plan_import_problems(path, allow_import)
    module_name = path.partition(":")[0]
    if not problems and importlib.util.find_spec(module_name.split(".")[0]) is None:
        problems.append(
            f"{key}={path!r}: module '{module_name}' is not importable from here (the working "
            f"directory {os.getcwd()!r} and PYTHONPATH are searched); run forge where it lives "
            "or add its folder to PYTHONPATH"
        )
    return problems

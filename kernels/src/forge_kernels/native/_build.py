"""Lazy CMake build of the forge native library, cached by content (private: see ``native``).

Provides:

- :class:`BuildConfig` / :func:`resolve_config`: what to build (sources, cache, CUDA or not, arches,
  tools), read from the environment once per load.
- :func:`cache_key`: sha256 of the sources (``CMakeLists.txt`` + ``kernels/csrc/*``), the torch
  version and the configuration. A different key is a different directory, so editing a source
  or upgrading torch rebuilds; nothing else does.
- :func:`build_library`: returns the path of ``libforge_kernels_native.so``, building it first if
  this key has none yet.
- :class:`NativeBuildError`: anything that stops the build, with the missing tool or the tail of
  the build log in its message.

Notable choices:

- Layout: ``<cache>/<key>/libforge_kernels_native.so`` plus ``build.log``; the CMake tree in
  ``<cache>/<key>/build`` is deleted after a successful build. ``<cache>`` is
  ``$FORGE_KERNELS_CACHE_DIR``, else ``$XDG_CACHE_HOME/forge-kernels``, else
  ``~/.cache/forge-kernels``.
- Concurrency: builders of one key serialize on ``<cache>/<key>.lock`` (``fcntl.flock``, released
  by the kernel if a builder dies); the library is published with an atomic rename, so a reader
  that sees the file sees all of it and never needs the lock.
- CUDA (``FORGE_KERNELS_CUDA``: ``auto`` (default) / ``1`` / ``0``): ``auto`` compiles the CUDA
  kernels only when torch is a CUDA build, a GPU is visible and nvcc is found; arches come from
  ``TORCH_CUDA_ARCH_LIST``, else the visible GPUs, else ``8.0;9.0``. A CPU-only machine therefore
  builds (and caches) the small CPU library even with a CUDA torch and nvcc installed.
- Tools: cmake and ninja from this environment's scripts directory (the ``cmake``/``ninja`` PyPI
  packages) before ``PATH``; the C++ compiler from ``$CXX``, else ``c++``/``g++``/``clang++``.
  ``MAX_JOBS`` bounds the parallel compile jobs (default: the CPU count).
- Sources come from a checkout (editable install): ``CMakeLists.txt`` at the repository root,
  overridable with ``FORGE_KERNELS_SOURCE_DIR``. A wheel without them cannot build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

LIBRARY_NAME = "libforge_kernels_native.so"
# Bump when the build recipe in this file changes in a way the key would not see.
_RECIPE_VERSION = "1"
_DEFAULT_CUDA_ARCHS = "8.0;9.0"
_LOCK_TIMEOUT_S = 1800.0


class NativeBuildError(RuntimeError):
    """The native library could not be built or loaded; the message says why."""


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """What to build and where; ``cuda`` and ``cuda_archs`` enter the cache key with the sources."""

    source_dir: Path
    cache_root: Path
    cuda: bool
    cuda_archs: str  # TORCH_CUDA_ARCH_LIST format, "" when cuda is False
    jobs: int


def default_source_dir() -> Path:
    """Repository root of this checkout (holds ``CMakeLists.txt`` and ``kernels/csrc``)."""
    if env := os.environ.get("FORGE_KERNELS_SOURCE_DIR"):
        return Path(env)
    return Path(__file__).resolve().parents[4]  # kernels/src/forge_kernels/native/_build.py


def default_cache_root() -> Path:
    if env := os.environ.get("FORGE_KERNELS_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "forge-kernels"


def source_files(source_dir: Path) -> list[Path]:
    """The files the build reads: ``CMakeLists.txt`` and everything under ``kernels/csrc``."""
    cmake_lists = source_dir / "CMakeLists.txt"
    csrc = source_dir / "kernels" / "csrc"
    if not cmake_lists.is_file() or not csrc.is_dir():
        raise NativeBuildError(
            f"forge native sources not found under {source_dir} (need CMakeLists.txt and "
            "kernels/csrc/): install forge-kernels from a checkout (editable) or set "
            "FORGE_KERNELS_SOURCE_DIR to the repository root"
        )
    return [cmake_lists, *sorted(p for p in csrc.rglob("*") if p.is_file())]


def find_nvcc() -> Path | None:
    """nvcc from ``$CUDA_HOME``/``$CUDA_PATH``, ``PATH`` or ``/usr/local/cuda``; None if absent."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return Path(root) / "bin" / "nvcc"
    if found := shutil.which("nvcc"):
        return Path(found)
    fallback = Path("/usr/local/cuda/bin/nvcc")
    return fallback if fallback.is_file() else None


def _visible_gpu_archs() -> str:
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" for major, minor in caps)


def resolve_config(env: Mapping[str, str] | None = None) -> BuildConfig:
    """Read the build configuration from the environment (see the module docstring)."""
    env = os.environ if env is None else env
    mode = env.get("FORGE_KERNELS_CUDA", "auto").strip().lower()
    if mode not in {"auto", "0", "1"}:
        raise ValueError(f"FORGE_KERNELS_CUDA={mode!r}: use auto, 0 or 1")
    cuda_torch = torch.version.cuda is not None
    if mode == "auto":
        cuda = cuda_torch and torch.cuda.is_available() and find_nvcc() is not None
    else:
        cuda = mode == "1"
    if cuda and not cuda_torch:
        raise NativeBuildError(
            "FORGE_KERNELS_CUDA=1 but this torch was built without CUDA; unset it or use 0"
        )
    archs = ""
    if cuda:
        archs = env.get("TORCH_CUDA_ARCH_LIST", "").strip()
        if not archs:
            archs = _visible_gpu_archs() if torch.cuda.is_available() else _DEFAULT_CUDA_ARCHS
    jobs = int(env.get("MAX_JOBS", "0") or 0) or (os.cpu_count() or 1)
    return BuildConfig(
        source_dir=default_source_dir(),
        cache_root=default_cache_root(),
        cuda=cuda,
        cuda_archs=archs,
        jobs=jobs,
    )


def cache_key(config: BuildConfig) -> str:
    """Hex digest of the sources' contents, torch's version and the configuration."""
    digest = hashlib.sha256()
    header = (
        f"recipe={_RECIPE_VERSION};torch={torch.__version__};torch_cuda={torch.version.cuda};"
        f"cuda={config.cuda};archs={config.cuda_archs};platform={sys.platform};"
        f"python_abi={sysconfig.get_config_var('SOABI')}"
    )
    digest.update(header.encode())
    for path in source_files(config.source_dir):
        rel = path.relative_to(config.source_dir).as_posix()
        content = path.read_bytes()
        digest.update(f"\0{rel}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()[:20]


def library_path(config: BuildConfig) -> Path:
    """Where the library for this configuration is (or will be) cached."""
    return config.cache_root / cache_key(config) / LIBRARY_NAME


def _find_tool(names: tuple[str, ...], search_dirs: list[Path]) -> Path | None:
    for name in names:
        for directory in search_dirs:
            candidate = directory / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
        if found := shutil.which(name):
            return Path(found)
    return None


def find_tools(search_dirs: list[Path] | None = None) -> dict[str, Path]:
    """cmake, ninja and a C++ compiler, or a NativeBuildError naming the one that is missing."""
    if search_dirs is None:
        search_dirs = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    cxx_env = os.environ.get("CXX", "").split()
    cxx_names = (cxx_env[0],) if cxx_env else ("c++", "g++", "clang++")
    hints = {
        "cmake": "install forge-parallel-kernels[native] (or `uv pip install cmake`)",
        "ninja": "install forge-parallel-kernels[native] (or `uv pip install ninja`)",
        "c++ compiler": "install g++ (e.g. `apt-get install g++`) or point $CXX at a compiler",
    }
    tools = {
        "cmake": _find_tool(("cmake",), search_dirs),
        "ninja": _find_tool(("ninja",), search_dirs),
        "c++ compiler": _find_tool(cxx_names, [] if cxx_env else search_dirs),
    }
    for name, path in tools.items():
        if path is None:
            where = ", ".join(str(d) for d in search_dirs) + ", PATH"
            raise NativeBuildError(
                f"cannot build the forge native ops: no {name} found (looked in {where}); "
                f"{hints[name]}"
            )
    return {name: path for name, path in tools.items() if path is not None}


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float = _LOCK_TIMEOUT_S) -> Iterator[None]:
    import fcntl  # POSIX only, like the rest of the build

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NativeBuildError(
                        f"timed out after {timeout_s:.0f} s waiting for another process's "
                        f"build (lock {path})"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _run(cmd: list[str], log: Path, env: Mapping[str, str]) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(env))
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise NativeBuildError(
            f"building the forge native ops failed ({Path(cmd[0]).name} exited with "
            f"{proc.returncode}); full log: {log}\n{tail}"
        )


def _cmake_build(config: BuildConfig, key_dir: Path) -> Path:
    tools = find_tools()
    build_dir = key_dir / "build"
    out_dir = build_dir / "out"
    log = key_dir / "build.log"
    # Anything here is left over from a build that died: start clean.
    shutil.rmtree(build_dir, ignore_errors=True)
    build_dir.mkdir(parents=True)
    log.write_text("")

    torch_prefix = Path(torch.utils.cmake_prefix_path)
    defines = {
        "CMAKE_MAKE_PROGRAM": tools["ninja"],
        "CMAKE_CXX_COMPILER": tools["c++ compiler"],
        "CMAKE_BUILD_TYPE": "Release",
        "CMAKE_PREFIX_PATH": torch_prefix,
        "Torch_DIR": torch_prefix / "Torch",
        "FORGE_KERNELS_CUDA": "ON" if config.cuda else "OFF",
        "FORGE_KERNELS_OUTPUT_DIR": out_dir,
    }
    env = dict(os.environ)
    if config.cuda:
        nvcc = find_nvcc()
        if nvcc is None:
            raise NativeBuildError(
                "FORGE_KERNELS_CUDA asks for the CUDA kernels but no nvcc was found; set "
                "CUDA_HOME or FORGE_KERNELS_CUDA=0"
            )
        defines["CMAKE_CUDA_COMPILER"] = nvcc
        env["TORCH_CUDA_ARCH_LIST"] = config.cuda_archs
    configure = [str(tools["cmake"]), "-S", str(config.source_dir), "-B", str(build_dir)]
    configure += ["-G", "Ninja", *(f"-D{name}={value}" for name, value in defines.items())]
    _run(configure, log, env)
    _run([str(tools["cmake"]), "--build", str(build_dir), "-j", str(config.jobs)], log, env)
    built = out_dir / LIBRARY_NAME
    if not built.is_file():
        raise NativeBuildError(f"the build finished but {built} is missing; see {log}")
    return built


def build_library(config: BuildConfig | None = None) -> Path:
    """Path of the native library for ``config``; builds it (under a file lock) if not cached."""
    config = resolve_config() if config is None else config
    target = library_path(config)
    if target.is_file():
        return target
    key_dir = target.parent
    with _file_lock(key_dir.with_suffix(".lock")):
        if target.is_file():  # another process built it while we waited
            return target
        key_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        built = _cmake_build(config, key_dir)
        staged = key_dir / f".{LIBRARY_NAME}.{os.getpid()}.tmp"
        shutil.copy2(built, staged)
        os.replace(staged, target)
        with open(key_dir / "build.log", "a") as log:
            log.write(f"# built in {time.perf_counter() - start:.1f} s\n")
        shutil.rmtree(key_dir / "build", ignore_errors=True)
    return target

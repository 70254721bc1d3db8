"""The dependency rule: each layer installs alone and loads no other forge layer but forge_core."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: layer (its directory's name) -> its directory; forge-kernels lives in kernels/ and may import
#: no forge layer.
DIST_DIRS = {
    p.name: p
    for p in (ROOT / "packages").iterdir()
    if (p / "pyproject.toml").exists() and p.name != "forge"
} | {"forge-kernels": ROOT / "kernels"}
LAYERS = sorted(DIST_DIRS)
FORGE_IMPORTS = {d.replace("-", "_") for d in LAYERS} | {"forge"}


def _distribution(directory: Path) -> str:
    """The distribution name in ``directory``'s pyproject.toml (not the layer's name: see
    tests/test_distribution_names.py), normalized as installers list it."""
    name = tomllib.loads((directory / "pyproject.toml").read_text())["project"]["name"]
    return name.lower().replace("_", "-")


#: import name -> the distribution that installs it
DISTRIBUTION_OF = {d.replace("-", "_"): _distribution(path) for d, path in DIST_DIRS.items()}


def _allowed(dist: str) -> set[str]:
    """Import names a distribution may load: itself, plus forge_core for the layers."""
    own = _import_name(dist)
    if dist == "forge-kernels":
        return {own}
    # forge-moe-ep runs its experts and dispatch on forge-kernels (ARCHITECTURE: triton via
    # forge_kernels for moe-ep).
    return {own, "forge_core", "forge_kernels"} if dist == "forge-moe-ep" else {own, "forge_core"}


def _import_name(dist: str) -> str:
    return dist.replace("-", "_")


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    assert uv, "the dependency-rule test needs uv on PATH (README: python3 -m pip install uv)"
    return uv


def test_there_are_layers_to_check():
    assert {
        "forge-core",
        "forge-mesh",
        "forge-fsdp-wrap",
        "forge-tp-plans",
        "forge-kernels",
        "forge-moe-ep",
        "forge-float8",
        "forge-vlm",
        "forge-domain",
    } <= set(LAYERS)


@pytest.mark.parametrize("dist", LAYERS)
def test_layer_sources_import_only_forge_core(dist):
    allowed = _allowed(dist)
    for path in (DIST_DIRS[dist] / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for name in names:
                top = name.split(".")[0]
                assert top not in FORGE_IMPORTS - allowed, (
                    f"{path.relative_to(ROOT)} imports {name}"
                )


@pytest.mark.parametrize("dist", LAYERS)
def test_layer_installs_alone_and_loads_no_other_layer(dist, tmp_path):
    uv, venv = _uv(), tmp_path / "venv"
    env = {
        k: v
        for k, v in os.environ.items()
        # NOTE: no PYTHONPATH: the GPU-image lane puts every layer's sources there
        if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "PYTHONPATH")
    }
    # NOTE: this interpreter and this torch: the GPU-image lane proves the layers install on
    # Python 3.12 with torch 2.11, the main lane on 3.11 with the locked torch (from uv's cache).
    subprocess.run(
        [uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=env, cwd=tmp_path
    )
    env["VIRTUAL_ENV"] = str(venv)
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    subprocess.run(
        [uv, "pip", "install", "-q", str(DIST_DIRS[dist]), torch_pin],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    listed = subprocess.run(
        [uv, "pip", "list", "--format", "freeze"],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    ).stdout
    installed = {line.split("==")[0].split(" @ ")[0].lower() for line in listed.splitlines()}
    forge_dists = {d.replace("_", "-") for d in installed if d.startswith("forge")}
    allowed_dists = {DISTRIBUTION_OF[name] for name in _allowed(dist)}
    assert forge_dists <= allowed_dists, forge_dists
    assert DISTRIBUTION_OF[_import_name(dist)] in forge_dists
    code = (
        "import sys, warnings; warnings.filterwarnings('ignore'); "
        f"import {_import_name(dist)}; "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules if m.startswith('forge')})))"
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        check=True,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert set(out) <= _allowed(dist), out


def test_the_workspace_installs_the_kernels_native_extra():
    """forge-kernels needs cmake and ninja only for its native ops (an extra, kernels/tests
    checks); forge's development install asks for that extra, so the native ops build in
    development and CI."""
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]["dev"]
    assert "forge-parallel-kernels[native]" in dev

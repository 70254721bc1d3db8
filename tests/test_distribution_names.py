"""Distribution names: installing one layer with plain pip gets forge's own distributions and
the third-party packages forge declares, never the package registry's unrelated projects.

The layers' own names (`forge`, `forge-core`, ...) are taken on the registry by other projects,
so every pyproject.toml names its distribution `forge-parallel-*` (docs/architecture.md, "The
layers"); the import names and the `forge` command are unchanged. The install is checked
without an index: the 13 wheels are built from the checkout (pure Python, uv's own backend, no
compiler), the third-party requirements are tiny stub wheels made here, and pip (>= 23) resolves
each layer with `--dry-run --report`, so nothing is downloaded or installed. pip is given the
layer's wheel, built from packages/<layer> by its own backend, rather than the directory: the
dependencies are the same, and building the directory would make pip fetch uv_build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
#: Names other projects hold on the package registry: no forge distribution may be called so.
TAKEN = {"forge", "forge-core"}
#: Every forge distribution's directory: the layers and the composition under packages/, the
#: kernels in kernels/.
PROJECT_DIRS = [p.parent for p in sorted((ROOT / "packages").glob("*/pyproject.toml"))] + [
    ROOT / "kernels"
]


def _canonical(name: str) -> str:
    """The registry's form of a distribution name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject(directory: Path) -> dict:
    return tomllib.loads((directory / "pyproject.toml").read_text())


def _dist(directory: Path) -> str:
    return _canonical(_pyproject(directory)["project"]["name"])


FORGE_DISTS = {_dist(d): d for d in PROJECT_DIRS}


def _requirements(directory: Path) -> list[Requirement]:
    """The distribution's requirements, its extras' included."""
    project = _pyproject(directory)["project"]
    extras = project.get("optional-dependencies", {}).values()
    return [Requirement(r) for r in [*project["dependencies"], *(r for e in extras for r in e)]]


def _third_party() -> dict[str, SpecifierSet]:
    """Each third-party distribution forge requires -> every specifier put on it."""
    found: dict[str, SpecifierSet] = {}
    for directory in PROJECT_DIRS:
        for req in _requirements(directory):
            name = _canonical(req.name)
            if name not in FORGE_DISTS:
                found[name] = found.get(name, SpecifierSet()) & req.specifier
    return found


def _stub_version(spec: SpecifierSet) -> str:
    """A version inside ``spec``: the highest of 9999 and the versions the specifiers name."""
    candidates = [Version("9999"), *(Version(s.version) for s in spec)]
    fitting = sorted(v for v in candidates if v in spec)
    assert fitting, f"no stub version fits {spec}"
    return str(fitting[-1])


def _write_stub_wheel(out: Path, name: str, version: str) -> None:
    """A wheel with metadata only: enough for pip to resolve ``name`` without an index."""
    stem = f"{name.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: forge-tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(out / f"{stem}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """forge's 13 wheels built from this checkout, and a stub wheel per third-party name."""
    uv = os.environ.get("UV") or shutil.which("uv")
    assert uv, "this test needs uv on PATH (README: python3 -m pip install uv)"
    out = tmp_path_factory.mktemp("wheels")
    # NOTE: --offline: uv builds its own backend (uv_build) in-process, so nothing is fetched.
    subprocess.run(
        [uv, "build", "--offline", "--quiet", "--wheel", "--all-packages", "--out-dir", str(out)],
        check=True,
        cwd=ROOT,
    )
    for name, spec in _third_party().items():
        _write_stub_wheel(out, name, _stub_version(spec))
    return out


@pytest.fixture(scope="session")
def fresh_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv's python with the pip that Python bundles (no index needed) and nothing else."""
    where = tmp_path_factory.mktemp("fresh-venv")
    venv.create(where, with_pip=True, symlinks=True)
    return where / "bin" / "python"


def _wheel_of(wheels: Path, dist: str) -> Path:
    (wheel,) = wheels.glob(f"{dist.replace('-', '_')}-*.whl")
    return wheel


def _would_install(python: Path, wheels: Path, requirement: Path) -> set[str]:
    """The distributions ``pip install --no-index --find-links wheels requirement`` would install."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    args = ["--dry-run", "--quiet", "--report", "-", "--no-index", "--find-links", str(wheels)]
    done = subprocess.run(
        [str(python), "-m", "pip", "--isolated", "install", *args, str(requirement)],
        check=True,
        env=env | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        capture_output=True,
        text=True,
    )
    return {_canonical(item["metadata"]["name"]) for item in json.loads(done.stdout)["install"]}


def _forge_closure(dist: str) -> set[str]:
    """``dist`` and the forge distributions it requires, transitively (extras left out)."""
    closure, todo = set(), [dist]
    while todo:
        name = todo.pop()
        if name not in closure:
            closure.add(name)
            todo += [
                _canonical(r.name)
                for r in _requirements(FORGE_DISTS[name])
                if _canonical(r.name) in FORGE_DISTS and r.marker is None
            ]
    return closure


def test_every_distribution_is_named_forge_parallel_and_none_takes_another_projects_name():
    assert len(FORGE_DISTS) == len(PROJECT_DIRS) == 13
    assert not set(FORGE_DISTS) & TAKEN
    for dist, directory in FORGE_DISTS.items():
        layer = directory.name if directory.name != "kernels" else "forge-kernels"
        assert dist == "forge-parallel" + layer.removeprefix("forge"), (dist, directory)
        for req in _requirements(directory):
            assert _canonical(req.name) not in TAKEN, f"{dist} requires {req.name}"


def test_wheels_keep_the_import_names_and_the_forge_command(wheels):
    for dist, directory in FORGE_DISTS.items():
        (package,) = [p.name for p in (directory / "src").iterdir() if p.name.startswith("forge")]
        with zipfile.ZipFile(_wheel_of(wheels, dist)) as wheel:
            tops = {n.split("/")[0] for n in wheel.namelist() if ".dist-info/" not in n}
            assert tops == {package}, (dist, tops)
            assert f"{package}/__init__.py" in wheel.namelist()
            if dist == "forge-parallel":
                scripts = wheel.read("forge_parallel-0.1.0.dist-info/entry_points.txt").decode()
                assert "forge = forge.cli:main" in scripts


@pytest.mark.parametrize("layer", ["forge-tp-plans", "forge-checkpoint", "forge-moe-ep", "forge"])
def test_pip_install_of_a_layer_gets_only_forge_and_its_declared_dependencies(
    layer, wheels, fresh_python
):
    dist = _dist(ROOT / "packages" / layer)
    installed = _would_install(fresh_python, wheels, _wheel_of(wheels, dist))
    assert not installed & TAKEN, f"pip would install other projects' {installed & TAKEN}"
    assert installed <= set(FORGE_DISTS) | set(_third_party()), installed
    assert installed & set(FORGE_DISTS) == _forge_closure(dist)
    assert "torch" in installed

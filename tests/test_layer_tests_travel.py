"""The layer tests travel with their layer: each layer's tests live in its own folder
(``packages/forge-<name>/tests/``, ``kernels/tests/`` for forge-kernels), which a vendored copy of
the layer takes along, and a test there imports, directly or through a test helper it imports,
neither the composition package ``forge`` nor a ``forge_*`` layer package other than its own,
the layers its pyproject declares, ``forge_core`` and ``forge_mesh``.

A layer is vendored on its own (forge-core, forge-cp, ... install without ``forge``), so its
tests must run without ``forge`` too; a test that needs ``forge`` (``forge.build.ParallelPlan``,
``build_parallel_model``, ``forge.config.load_config``, ``forge.checks``, ``forge.plan``,
``forge.train``, ``forge.job``, ``forge.cli``) is a cross-layer test and lives in
``tests/integration/`` (``tests/integration/<layer>/`` for one layer's composed tests).

For the same reason the ``forge_*`` packages a layer's test files may import are: the layer's
own package (``packages/forge-moe-ep/tests/`` -> ``forge_moe_ep``), the layers its pyproject
declares in ``[project].dependencies`` (``forge-parallel-<name>`` is imported as
``forge_<name>``: forge-moe-ep declares forge-parallel-kernels, so its tests may import
``forge_kernels``), and ``forge_core`` and ``forge_mesh`` (the harness and the device meshes
every layer's tests run on). A test that composes its layer with another lives in
``tests/integration/<layer>/``. And a layer's test imports no test helper outside its folder:
a helper two layers share goes to ``forge_core.testing``.

A layer's test folder is not a package (no ``__init__.py``: every folder named ``tests`` would
be the same package ``tests``); pytest puts it on ``sys.path`` and its modules are top-level
(``cp_jobs``, ``test_cp_units``), so their names must be unique across the layers' folders.

What counts as an import, anywhere in a file (module level or inside a function): ``import`` and
``from ... import`` statements (relative ones resolved); ``importlib.import_module``,
``__import__`` and ``pytest.importorskip`` of a constant name; and a string constant naming a
module of this checkout (``"tests.integration.parity_jobs"``, ``"tp_plan_fixtures:PLAN"``): the
form in which tests hand a module to a child interpreter or to a plan import, which imports it
(a dict's keys excepted: looked up, not imported). A module of the checkout (``tests.*``,
``tools.*`` and the layers' test modules) is followed transitively, its package ``__init__``
files with it. For the first rule only ``forge`` itself and its submodules (``forge.build``)
count: ``forge_core``, ``forge_cp``, ... are other top-level names, which the second rule checks
by their top-level name (``forge_fsdp_wrap.ac`` is ``forge_fsdp_wrap``).
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Subfolders of tests/ (forge's own and the cross-layer tests), each with what it holds: a
#: new one must be listed, so that a layer's tests do not creep back here.
NOT_LAYERS = {
    "integration": "tests of forge, the composition package, and of layers composed by it",
    "zoo": "the Hugging Face zoo lane, run through tests/zoo/hf_zoo.py and forge",
    "docs": "the docs lane: the pages' code blocks",
    "tools": "tests of the scripts in tools/",
}

#: The forge_* packages every layer's tests may import besides their layer's own.
SHARED_LAYERS = frozenset({"forge_core", "forge_mesh"})
_DISTRIBUTION_PREFIX = "forge-parallel-"
_MODULE_STRING = re.compile(r"^\w+(?:\.\w+)*(?::[\w.]+)?$")
_IMPORT_CALLS = {"import_module", "__import__", "importorskip"}


def layer_dirs() -> dict[str, Path]:
    """Each layer's folder name (``moe_ep`` for packages/forge-moe-ep, ``kernels``) -> the layer
    folder (holding its pyproject.toml)."""
    found = {
        p.name.removeprefix("forge-").replace("-", "_"): p
        for p in (ROOT / "packages").iterdir()
        if p.name.startswith("forge-") and (p / "pyproject.toml").exists()
    }
    return {**found, "kernels": ROOT / "kernels"}


LAYERS = layer_dirs()
LAYER_NAMES = sorted(LAYERS)


def layer_test_folders() -> dict[str, Path]:
    """Each layer's folder name -> its tests folder (for every layer that has one)."""
    return {name: d / "tests" for name, d in LAYERS.items() if (d / "tests").is_dir()}


def _is_forge(name: str) -> bool:
    return name == "forge" or name.startswith("forge.")


def _layer_test_module(name: str) -> Path | None:
    """The file of a layer's test module ``name`` (``cp_jobs``): a top-level name only."""
    if "." in name:
        return None
    for folder in layer_test_folders().values():
        candidate = folder / f"{name}.py"
        if candidate.is_file():
            return candidate
    return None


def _local_file(name: str) -> Path | None:
    """The file of checkout module ``name`` (``tests.integration.parity_jobs``, ``cp_jobs``), or
    None if it is not one of this checkout's test or tool modules."""
    if name.split(".")[0] not in ("tests", "tools"):
        return _layer_test_module(name)
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package(path: Path) -> list[str]:
    """The package a file of the checkout is in (``tests/integration/x.py`` -> ``tests``,
    ``integration``); a layer's test folder is no package (``[]``)."""
    rel = path.relative_to(ROOT)
    return list(rel.parent.parts) if rel.parts[0] == "tests" else []


def _packages(name: str) -> Iterator[str]:
    """``tests.integration.parity_jobs`` -> ``tests``, ``tests.integration``."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


def imported_names(path: Path) -> list[tuple[str, int]]:
    """Every module name ``path`` imports (see the module docstring), with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _package(path)
    names: list[tuple[str, int]] = []
    keys = {id(k) for d in ast.walk(tree) if isinstance(d, ast.Dict) for k in d.keys if k}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names.append((module, node.lineno))
            if _local_file(module) is not None:  # ``from tests.zoo import hf_zoo``: a submodule
                names += [(f"{module}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0] if node.args else None
            if called in _IMPORT_CALLS and isinstance(arg, ast.Constant):
                names.append((str(arg.value), node.lineno))
        elif (
            isinstance(node, ast.Constant) and id(node) not in keys and isinstance(node.value, str)
        ):
            module = node.value.split(":")[0]
            if _MODULE_STRING.match(node.value) and _local_file(module) is not None:
                names.append((module, node.lineno))
    return names


def offending_paths(start: Path, offends: Callable[[str], bool]) -> list[str]:
    """Each way ``start`` reaches a module ``offends`` flags: ``"a.py:3 -> x/cp_jobs.py:8
    imports forge.build"`` (one chain per such import found, through checkout modules, each file
    followed once)."""
    found: list[str] = []
    seen: set[Path] = set()
    todo: list[tuple[Path, str]] = [(start, "")]
    while todo:
        path, via = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        here = path.relative_to(ROOT).as_posix()
        for name, line in imported_names(path):
            if offends(name):
                found.append(f"{via}{here}:{line} imports {name}")
            for module in (*_packages(name), name):
                local = _local_file(module)
                if local is not None and local not in seen:
                    todo.append((local, f"{via}{here}:{line} -> "))
    return sorted(set(found))


def forge_paths(start: Path) -> list[str]:
    """Each way ``start`` reaches the composition package ``forge``."""
    return offending_paths(start, _is_forge)


def _import_name(distribution: str) -> str:
    """``forge-parallel-moe-ep`` -> ``forge_moe_ep``; any other distribution -> ``""``."""
    if not distribution.startswith(_DISTRIBUTION_PREFIX):
        return ""
    return "forge_" + distribution.removeprefix(_DISTRIBUTION_PREFIX).replace("-", "_")


def allowed_layers(folder: str) -> frozenset[str]:
    """The forge_* packages the tests of layer ``folder`` may import: its own, the layers its
    pyproject declares, forge_core and forge_mesh."""
    project = tomllib.loads((LAYERS[folder] / "pyproject.toml").read_text())["project"]
    requirements = project.get("dependencies", [])
    # a requirement's name ends at its first specifier, extra, marker or space (PEP 508)
    declared = {_import_name(re.split(r"[\s\[<>=!~;@(]", r, maxsplit=1)[0]) for r in requirements}
    return frozenset({f"forge_{folder}", *SHARED_LAYERS, *declared} - {""})


def other_layer_paths(start: Path, allowed: frozenset[str]) -> list[str]:
    """Each way ``start`` reaches a ``forge_*`` package not in ``allowed``."""

    def offends(name: str) -> bool:
        top = name.split(".")[0]
        return top.startswith("forge_") and top not in allowed

    return offending_paths(start, offends)


def foreign_test_modules(folder: Path, start: Path) -> list[str]:
    """Each import by ``start`` (a file of the test folder ``folder``) of a test or tool module
    of this checkout outside ``folder``."""

    def offends(name: str) -> bool:
        local = _local_file(name)
        return local is not None and local.parent != folder

    return [line for line in offending_paths(start, offends) if " -> " not in line]


FOLDERS = layer_test_folders()
LAYER_FOLDERS = sorted(FOLDERS)


def _layer_files(folder: str) -> list[Path]:
    return sorted(FOLDERS[folder].rglob("*.py"))


def test_every_layer_but_the_composition_has_its_tests_folder():
    missing = [name for name in LAYER_NAMES if name not in FOLDERS]
    assert not missing, f"layers without a tests/ folder of their own: {missing}"
    assert {"core", "cp", "pp", "vlm", "moe_ep", "mesh", "kernels"} <= set(LAYER_FOLDERS)
    assert not (ROOT / "packages" / "forge" / "tests").exists(), (
        "forge's own tests are cross-layer tests: tests/integration/"
    )


def test_tests_holds_no_layer_folder():
    here = sorted(p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name[0] != "_")
    unknown = [name for name in here if name not in NOT_LAYERS]
    assert not unknown, (
        f"tests/{unknown[0]}/ is not listed in NOT_LAYERS: a layer's tests live in its own "
        "folder (packages/forge-<name>/tests/); list it there with the reason otherwise"
    )


def test_layer_test_folders_are_no_packages_and_their_names_are_unique():
    """Every folder named tests with an ``__init__.py`` would be one package ``tests``; without
    one, pytest imports each module by its file name, which must then be unique."""
    seen: dict[str, Path] = {}
    for folder in FOLDERS.values():
        assert not (folder / "__init__.py").exists(), f"{folder} must not be a package"
        for path in folder.rglob("*.py"):
            if path.name == "conftest.py":
                continue
            assert path.stem not in seen, f"{path} and {seen[path.stem]} share a module name"
            seen[path.stem] = path


def test_every_layer_test_folder_is_on_pytests_paths():
    """The README suite collects each layer's tests, and a cross-layer test or a rank worker
    imports their modules by name."""
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    for folder in FOLDERS.values():
        rel = folder.relative_to(ROOT).as_posix()
        assert rel in ini["testpaths"] and rel in ini["pythonpath"], rel


def _fake_layer_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty layer ``lay`` (``packages/forge-lay/tests/``) in a checkout at ``tmp_path``."""
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "ROOT", tmp_path)
    layer = tmp_path / "packages" / "forge-lay"
    (layer / "tests").mkdir(parents=True)
    (layer / "pyproject.toml").write_text("[project]\nname = 'forge-parallel-lay'\n")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    monkeypatch.setattr(module, "LAYERS", layer_dirs())
    return layer / "tests"


def test_the_rule_sees_forge_through_a_helper_and_inside_a_function(tmp_path, monkeypatch):
    """The check itself: a forge import inside a function, one in a helper the test imports,
    and a helper named by a module string are found; forge_core is not forge."""
    folder = _fake_layer_folder(tmp_path, monkeypatch)
    (folder / "lay_jobs.py").write_text("def f():\n    from forge.build import ParallelPlan\n")
    (folder / "lay_child.py").write_text("import forge\n")
    (folder / "lay_clean.py").write_text("import forge_core\nfrom forge_cp import shard\n")
    (folder / "test_a.py").write_text("from lay_jobs import f\n")
    (folder / "test_b.py").write_text("X = 'lay_child:main'\n")
    (folder / "test_c.py").write_text("def g():\n    import lay_clean\n")
    tests = "packages/forge-lay/tests"
    assert forge_paths(folder / "test_a.py") == [
        f"{tests}/test_a.py:1 -> {tests}/lay_jobs.py:2 imports forge.build"
    ]
    assert forge_paths(folder / "test_b.py") == [
        f"{tests}/test_b.py:1 -> {tests}/lay_child.py:1 imports forge"
    ]
    assert forge_paths(folder / "test_c.py") == []


def test_the_shared_conftest_does_not_import_forge():
    """tests/conftest.py names forge's modules only as the forkserver's preload strings."""
    assert forge_paths(ROOT / "tests" / "conftest.py") == []


@pytest.mark.parametrize("folder", LAYER_FOLDERS)
def test_a_layers_tests_import_no_forge(folder):
    """A test that needs forge goes to tests/integration/<folder>/ (split out of its file if
    the rest of the file tests the layer alone)."""
    files = _layer_files(folder)
    assert files, f"{FOLDERS[folder]} has no Python file"
    problems = [chain for path in files for chain in forge_paths(path)]
    assert not problems, (
        f"{folder}'s tests reach the composition package forge (move those tests to "
        "tests/integration/" + folder + "/):\n  " + "\n  ".join(problems)
    )


def test_the_layer_rule_sees_another_layer_through_a_helper(tmp_path, monkeypatch):
    """The second check itself: another layer imported inside a helper's function is found,
    reported by its full name; the allowed ones and ``forge`` (the first check's) are not."""
    folder = _fake_layer_folder(tmp_path, monkeypatch)
    (folder / "lay_jobs.py").write_text("def f():\n    from forge_tp_plans.plans import x\n")
    (folder / "test_a.py").write_text(
        "from lay_jobs import f\nimport forge_core.stages\nimport forge_lay\nimport forge\n"
    )
    allowed = frozenset({"forge_lay", *SHARED_LAYERS})
    tests = "packages/forge-lay/tests"
    assert other_layer_paths(folder / "test_a.py", allowed) == [
        f"{tests}/test_a.py:1 -> {tests}/lay_jobs.py:2 imports forge_tp_plans.plans"
    ]


def test_the_allowed_layers_come_from_the_pyproject():
    """moe_ep declares forge-parallel-kernels; kernels declares no layer and gets only the shared
    two; a layer declaring forge-parallel-core gets nothing more than the shared two."""
    assert allowed_layers("moe_ep") == {"forge_moe_ep", "forge_kernels", *SHARED_LAYERS}
    assert allowed_layers("kernels") == {"forge_kernels", *SHARED_LAYERS}
    assert allowed_layers("tp_plans") == {"forge_tp_plans", *SHARED_LAYERS}


@pytest.mark.parametrize("folder", LAYER_FOLDERS)
def test_a_layers_tests_import_no_other_layer(folder):
    """A test that composes its layer with a layer it does not declare goes to
    tests/integration/<folder>/ (split out of its file if the rest of the file tests the layer
    alone)."""
    files = _layer_files(folder)
    allowed = allowed_layers(folder)
    problems = [chain for path in files for chain in other_layer_paths(path, allowed)]
    assert not problems, (
        f"{folder}'s tests import a forge layer other than {sorted(allowed)} (move those tests "
        "to tests/integration/" + folder + "/):\n  " + "\n  ".join(problems)
    )


def test_the_own_folder_rule_sees_a_shared_helper_and_another_layers(tmp_path, monkeypatch):
    folder = _fake_layer_folder(tmp_path, monkeypatch)
    other = tmp_path / "kernels" / "tests"
    other.mkdir()
    (other / "kern_jobs.py").write_text("Z = 3\n")
    (tmp_path / "tests" / "shared.py").write_text("X = 1\n")
    (folder / "lay_jobs.py").write_text("Y = 2\n")
    (folder / "test_a.py").write_text(
        "from tests.shared import X\nfrom lay_jobs import Y\nimport kern_jobs\n"
    )
    assert foreign_test_modules(folder, folder / "test_a.py") == [
        "packages/forge-lay/tests/test_a.py:1 imports tests.shared",
        "packages/forge-lay/tests/test_a.py:3 imports kern_jobs",
    ]


@pytest.mark.parametrize("folder", LAYER_FOLDERS)
def test_a_layers_tests_import_only_their_own_folders_helpers(folder):
    """A helper two layers' tests share goes to forge_core.testing (which every layer's tests
    may import), or to the one layer folder it belongs to."""
    problems = [
        line
        for path in _layer_files(folder)
        for line in foreign_test_modules(FOLDERS[folder], path)
    ]
    assert not problems, (
        f"{folder}'s tests import test modules outside their folder:\n  " + "\n  ".join(problems)
    )


def test_a_vendored_layer_runs_its_own_tests(tmp_path):
    """forge-mesh copied alone (as a project vendoring it would) runs its tests, rank tests
    included, with neither forge's checkout nor its pytest settings around it."""
    copy = tmp_path / "forge-mesh"
    shutil.copytree(LAYERS["mesh"], copy, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider"],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.search(r"\b\d+ passed", proc.stdout) and "rootdir: " + str(copy) in proc.stdout

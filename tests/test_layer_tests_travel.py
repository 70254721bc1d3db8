"""The layer tests travel with their layer: a test in a layer's folder ``tests/<layer>/`` imports,
directly or through a test helper it imports, neither the composition package ``forge`` nor a
``forge_*`` layer package other than its own, the layers its pyproject declares, ``forge_core``
and ``forge_mesh``.

A layer is vendored on its own (forge-core, forge-cp, ... install without ``forge``), so its
tests must run without ``forge`` too; a test that needs ``forge`` (``forge.build.ParallelPlan``,
``build_parallel_model``, ``forge.config.load_config``, ``forge.checks``, ``forge.plan``,
``forge.train``, ``forge.job``, ``forge.cli``) is a cross-layer test and lives in
``tests/integration/`` (``tests/integration/<layer>/`` for one layer's composed tests).

For the same reason the ``forge_*`` packages a layer folder's files may import are: the layer's
own package (``tests/moe_ep/`` -> ``forge_moe_ep``), the layers its pyproject declares in
``[project].dependencies`` (``forge-parallel-<name>`` is imported as ``forge_<name>``: forge-moe-ep
declares forge-parallel-kernels, so ``tests/moe_ep/`` may import ``forge_kernels``), and
``forge_core`` and ``forge_mesh`` (the harness and the device meshes every layer's tests run on).
A test that composes its layer with another (``forge_fsdp_wrap.apply_fsdp2`` around a TP plan,
``forge_fsdp_wrap.apply_ac`` around a Float8 block) lives in ``tests/integration/<layer>/``.

Layer folders: every subfolder of ``tests/`` named after a layer (``core`` for forge-core,
``moe_ep`` for forge-moe-ep, ``kernels`` for forge-kernels, ...). Every other subfolder must be
listed in ``NOT_LAYERS`` with the reason, so that a new folder is classified, not skipped.

What counts as an import, anywhere in a file (module level or inside a function): ``import`` and
``from ... import`` statements (relative ones resolved); ``importlib.import_module``,
``__import__`` and ``pytest.importorskip`` of a constant name; and a string constant naming a
module of this checkout (``"tests.pp.test_pp_plan"``, ``"tests.tp_plans.plan_fixtures:PLAN"``):
the form in which tests hand a module to a child interpreter or to a plan import, which imports
it (a dict's keys excepted: looked up, not imported). A module of the checkout (``tests.*``,
``tools.*``) is followed transitively, its package ``__init__`` files with it; a layer folder's
own ``conftest.py`` is one of its files, and ``tests/conftest.py``, which pytest loads for every
test, is checked on its own. For the first rule only ``forge`` itself and its submodules
(``forge.build``) count: ``forge_core``, ``forge_cp``, ... are other top-level names, which the
second rule checks by their top-level name (``forge_fsdp_wrap.ac`` is ``forge_fsdp_wrap``).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

#: Subfolders of tests/ that are not a layer's tests, and why.
NOT_LAYERS = {
    # the composed package's tests and the cross-layer tests moved out of the layer folders
    "integration": "tests of forge, the composition package, and of layers composed by it",
    # tests/zoo/hf_zoo.py builds every family through forge; its own CI lane (marker zoo)
    "zoo": "the Hugging Face zoo lane, run through tests/zoo/hf_zoo.py and forge",
    # runs the Python blocks of README.md, docs/ and the layer READMEs (which use forge)
    "docs": "the docs lane: the pages' code blocks",
    # tests of tools/ (benchmarks, code measures, the GPU check's arguments)
    "tools": "tests of the scripts in tools/",
}

#: Where a layer's folder name comes from: packages/forge-<name> and kernels/ (forge-kernels).
LAYER_NAMES = {
    p.name.removeprefix("forge-").replace("-", "_")
    for p in (ROOT / "packages").iterdir()
    if p.name.startswith("forge-") and (p / "pyproject.toml").exists()
} | {"kernels"}

#: The forge_* packages every layer folder's tests may import besides their layer's own.
SHARED_LAYERS = frozenset({"forge_core", "forge_mesh"})
_DISTRIBUTION_PREFIX = "forge-parallel-"

#: Top-level names of this checkout's own modules that an import is followed into.
LOCAL_TOPS = ("tests", "tools")
_MODULE_STRING = re.compile(r"^(?:tests|tools)(?:\.\w+)+(?::[\w.]+)?$")
_IMPORT_CALLS = {"import_module", "__import__", "importorskip"}


def _is_forge(name: str) -> bool:
    return name == "forge" or name.startswith("forge.")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _local_file(name: str) -> Path | None:
    """The file of checkout module ``name`` (``tests.cp.jobs``), or None if it is not one."""
    if name.split(".")[0] not in LOCAL_TOPS:
        return None
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _packages(name: str) -> Iterator[str]:
    """``tests.cp.jobs`` -> ``tests``, ``tests.cp``: the packages importing it imports first."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])


def imported_names(path: Path) -> list[tuple[str, int]]:
    """Every module name ``path`` imports (see the module docstring), with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parts = _module_name(path).split(".")
    package = parts if path.name == "__init__.py" else parts[:-1]
    names: list[tuple[str, int]] = []
    # a dict's keys are looked up, not imported (tests/conftest.py's ``_LAZY_IMPORTS``)
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
            if module.split(".")[0] in LOCAL_TOPS:  # ``from tests.cp import jobs``: a submodule
                names += [(f"{module}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0] if node.args else None
            if called in _IMPORT_CALLS and isinstance(arg, ast.Constant):
                names.append((str(arg.value), node.lineno))
        elif (
            isinstance(node, ast.Constant)
            and id(node) not in keys
            and _MODULE_STRING.match(str(node.value))
        ):
            names.append((str(node.value).split(":")[0], node.lineno))
    return names


def offending_paths(start: Path, offends: Callable[[str], bool]) -> list[str]:
    """Each way ``start`` reaches a module ``offends`` flags: ``"a.py:3 -> tests/x/jobs.py:8
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
    """The forge_* packages ``tests/<folder>/`` may import: its own, the layers its pyproject
    declares, forge_core and forge_mesh."""
    name = folder.replace("_", "-")  # tests/moe_ep/ -> packages/forge-moe-ep
    directory = ROOT / "kernels" if folder == "kernels" else ROOT / "packages" / f"forge-{name}"
    project = tomllib.loads((directory / "pyproject.toml").read_text())["project"]
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


def _subfolders() -> list[str]:
    return sorted(p.name for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").exists())


LAYER_FOLDERS = [name for name in _subfolders() if name not in NOT_LAYERS]
CONFTEST = TESTS / "conftest.py"


def _layer_files(folder: str) -> list[Path]:
    return sorted((TESTS / folder).rglob("*.py"))


def test_every_tests_subfolder_is_a_layer_or_listed_as_none():
    unknown = [name for name in LAYER_FOLDERS if name not in LAYER_NAMES]
    assert not unknown, (
        f"tests/{unknown[0]}/ is neither a layer's folder (layers: {sorted(LAYER_NAMES)}) nor "
        "listed in NOT_LAYERS; add it there with the reason if it is not a layer's tests"
    )
    assert {"core", "cp", "pp", "vlm", "moe_ep", "mesh", "kernels"} <= set(LAYER_FOLDERS)


def _fake_layer_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty layer folder ``tests/lay/`` in a checkout rooted at ``tmp_path``."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    pkg = tmp_path / "tests" / "lay"
    pkg.mkdir(parents=True)
    for init in (tmp_path / "tests" / "__init__.py", pkg / "__init__.py"):
        init.write_text("")
    return pkg


def test_the_rule_sees_forge_through_a_helper_and_inside_a_function(tmp_path, monkeypatch):
    """The check itself: a forge import inside a function, one in a checkout helper the test
    imports, and a helper named by a module string are found; forge_core is not forge."""
    pkg = _fake_layer_folder(tmp_path, monkeypatch)
    (pkg / "jobs.py").write_text("def f():\n    from forge.build import ParallelPlan\n")
    (pkg / "child.py").write_text("import forge\n")
    (pkg / "clean.py").write_text("import forge_core\nfrom forge_cp import shard_sequence\n")
    (pkg / "test_a.py").write_text("from tests.lay.jobs import f\n")
    (pkg / "test_b.py").write_text("X = 'tests.lay.child:main'\n")
    (pkg / "test_c.py").write_text("def g():\n    from tests.lay import clean\n")
    assert forge_paths(pkg / "test_a.py") == [
        "tests/lay/test_a.py:1 -> tests/lay/jobs.py:2 imports forge.build"
    ]
    assert forge_paths(pkg / "test_b.py") == [
        "tests/lay/test_b.py:1 -> tests/lay/child.py:1 imports forge"
    ]
    assert forge_paths(pkg / "test_c.py") == []


def test_the_shared_conftest_does_not_import_forge():
    assert forge_paths(CONFTEST) == []


@pytest.mark.parametrize("folder", LAYER_FOLDERS)
def test_a_layers_tests_import_no_forge(folder):
    """A test that needs forge goes to tests/integration/<folder>/ (split out of its file if
    the rest of the file tests the layer alone)."""
    files = _layer_files(folder)
    assert files, f"tests/{folder}/ has no Python file"
    problems = [chain for path in files for chain in forge_paths(path)]
    assert not problems, (
        f"tests/{folder}/ reaches the composition package forge (move those tests to "
        "tests/integration/" + folder + "/):\n  " + "\n  ".join(problems)
    )


def test_the_layer_rule_sees_another_layer_through_a_helper(tmp_path, monkeypatch):
    """The second check itself: another layer imported inside a helper's function is found,
    reported by its full name; the allowed ones and ``forge`` (the first check's) are not."""
    pkg = _fake_layer_folder(tmp_path, monkeypatch)
    (pkg / "jobs.py").write_text("def f():\n    from forge_tp_plans.plans import x\n")
    (pkg / "test_a.py").write_text(
        "from tests.lay.jobs import f\nimport forge_core.stages\nimport forge_lay\nimport forge\n"
    )
    allowed = frozenset({"forge_lay", *SHARED_LAYERS})
    assert other_layer_paths(pkg / "test_a.py", allowed) == [
        "tests/lay/test_a.py:1 -> tests/lay/jobs.py:2 imports forge_tp_plans.plans"
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
    assert files, f"tests/{folder}/ has no Python file"
    allowed = allowed_layers(folder)
    problems = [chain for path in files for chain in other_layer_paths(path, allowed)]
    assert not problems, (
        f"tests/{folder}/ imports a forge layer other than {sorted(allowed)} (move those tests "
        "to tests/integration/" + folder + "/):\n  " + "\n  ".join(problems)
    )


def foreign_test_modules(folder: str, start: Path) -> list[str]:
    """Each import by ``start`` (a file of ``tests/<folder>/``) of a ``tests.*`` module outside
    ``tests/<folder>/`` (the shared ``tests`` package itself aside)."""

    def offends(name: str) -> bool:
        parts = name.split(".")
        outside = parts[0] == "tests" and len(parts) > 1 and parts[1] != folder
        return outside and _local_file(name) is not None  # a module, not a name in one

    return [line for line in offending_paths(start, offends) if " -> " not in line]


def test_the_own_folder_rule_sees_a_shared_helper(tmp_path, monkeypatch):
    pkg = _fake_layer_folder(tmp_path, monkeypatch)
    (tmp_path / "tests" / "shared.py").write_text("X = 1\n")
    (pkg / "jobs.py").write_text("Y = 2\n")
    (pkg / "test_a.py").write_text("from tests.shared import X\nfrom tests.lay.jobs import Y\n")
    assert foreign_test_modules("lay", pkg / "test_a.py") == [
        "tests/lay/test_a.py:1 imports tests.shared"
    ]


@pytest.mark.parametrize("folder", LAYER_FOLDERS)
def test_a_layers_tests_import_only_their_own_folders_helpers(folder):
    """A helper two layer folders share goes to forge_core.testing (which every layer's tests
    may import), or to the one layer folder it belongs to."""
    problems = [
        line for path in _layer_files(folder) for line in foreign_test_modules(folder, path)
    ]
    assert not problems, (
        f"tests/{folder}/ imports test modules outside its folder:\n  " + "\n  ".join(problems)
    )

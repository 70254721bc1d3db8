"""The layer tests travel with their layer: no test in a layer's folder ``tests/<layer>/`` imports
the composition package ``forge``, directly or through a test helper it imports.

A layer is vendored on its own (forge-core, forge-cp, ... install without ``forge``), so its
tests must run without ``forge`` too; a test that needs ``forge`` (``forge.build.ParallelPlan``,
``build_parallel_model``, ``forge.config.load_config``, ``forge.checks``, ``forge.plan``,
``forge.train``, ``forge.job``, ``forge.cli``) is a cross-layer test and lives in
``tests/integration/`` (``tests/integration/<layer>/`` for one layer's composed tests).

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
test, is checked on its own. Only ``forge`` itself and its submodules (``forge.build``) break the
rule: ``forge_core``, ``forge_cp``, ... are other top-level names.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

#: Subfolders of tests/ that are not a layer's tests, and why.
NOT_LAYERS = {
    # the composed package's tests and the cross-layer tests moved out of the layer folders
    "integration": "tests of forge, the composition package, and of layers composed by it",
    # tools/hf_zoo.py builds every family through forge; its own CI lane (marker zoo)
    "zoo": "the Hugging Face zoo lane, run through tools/hf_zoo.py and forge",
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


def forge_paths(start: Path) -> list[str]:
    """Each way ``start`` reaches ``forge``: ``"a.py:3 -> tests/x/jobs.py:8 imports forge.build"``
    (one chain per forge import found, through checkout modules, each file followed once)."""
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
            if _is_forge(name):
                found.append(f"{via}{here}:{line} imports {name}")
            for module in (*_packages(name), name):
                local = _local_file(module)
                if local is not None and local not in seen:
                    todo.append((local, f"{via}{here}:{line} -> "))
    return sorted(set(found))


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


def test_the_rule_sees_forge_through_a_helper_and_inside_a_function(tmp_path, monkeypatch):
    """The check itself: a forge import inside a function, one in a checkout helper the test
    imports, and a helper named by a module string are found; forge_core is not forge."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    pkg = tmp_path / "tests" / "lay"
    pkg.mkdir(parents=True)
    for init in (tmp_path / "tests" / "__init__.py", pkg / "__init__.py"):
        init.write_text("")
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

"""forge's size and structure measures: modules over 500 lines, functions over cyclomatic
complexity 15, import cycles between forge's modules, model-kind branches in the composition.

    uv run python tools/code_measures.py

What it counts, and why:
- **module lines**: ``wc -l`` of every source module (``packages/*/src`` and ``kernels/src``), so
  that a module can be read in one sitting (``MODULE_LINES``). Modules still over it are held
  by tests/tools/test_code_measures.py at ceilings that only come down (``OVER_LINES``).
- **complexity**: McCabe's count as ruff computes it (C901); ``pyproject.toml`` sets the bound
  (15) and ``ruff check`` holds it everywhere, so this tool only reports it.
- **import cycles**: modules that import each other, directly or through others, at any depth
  (imports inside functions count: they are the same dependency, paid later; imports under
  ``if TYPE_CHECKING`` do not). One strongly connected group of modules is one cycle.
- **model-kind branches**: ``if``, conditional expressions and comprehension filters of the
  ``forge`` package whose test asks what kind of model it has (a VLM, a field model, an MoE, a
  Hugging Face model: :data:`KIND_ATTRS`, :data:`KIND_CALLS`, :data:`KIND_TYPES`), outside the
  modules that exist to tell the kinds apart (:data:`SPEC_MODULES`). Held by the test at a
  ceiling that only comes down (``KIND_BRANCHES``); the goal is 0.

The upward-import rule (no layer imports ``forge`` or another layer) is tests/test_dependency_rule.py's.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES = 500
#: Modules still over MODULE_LINES, each held at its length when the measure came in (issue 32):
#: lower a ceiling when its module shrinks; remove it once the module is under the bound.
OVER_LINES: dict[str, int] = {}

#: Attribute names, called names and types whose use in a test asks for the model's kind.
KIND_ATTRS = frozenset(
    {"is_vlm", "is_field", "vlm", "field", "vision", "adapter", "moe", "moe_layers"}
    | {"custom_ffn_layers", "routed_experts", "kind"}
)
KIND_NAMES = frozenset({"vlm", "vision", "adapter", "field"})
KIND_CALLS = frozenset({"is_hf_model", "is_hf_pretrained", "vlm_sections", "field_section"})
KIND_TYPES = frozenset({"VLMWrapper", "FieldNet", "FieldBatch", "MoE", "PreTrainedModel"})
#: The modules whose job is to tell the model kinds apart: the specs (the Hugging Face spec's
#: preparation and process patches included) and the config's sections.
SPEC_MODULES = frozenset(
    {"forge.model_spec", "forge.models", "forge.config"} | {"forge.hf_prepare", "forge.hf_patches"}
)
#: The packages of one module per kind (:mod:`forge.kinds`).
SPEC_PACKAGES = ("forge.kinds",)
#: Model-kind branches outside SPEC_MODULES when the measure came in (issue 32): lower it as
#: they move into the specs.
KIND_BRANCHES = 0


def source_roots() -> list[Path]:
    """Every distribution's ``src`` folder."""
    return sorted((ROOT / "packages").glob("*/src")) + [ROOT / "kernels" / "src"]


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every source module."""
    found = {}
    for src in source_roots():
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def module_lines() -> dict[str, int]:
    """Repository-relative path -> number of lines, for every source module."""
    return {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for path in modules().values()
    }


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, package: str) -> set[str]:
    """Every module or ``module.name`` that ``tree`` imports, relative imports resolved against
    ``package``, outside ``if TYPE_CHECKING`` blocks."""
    names: set[str] = set()
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                pending.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - child.level + 1]
                module = (
                    ".".join([*base, *([child.module] if child.module else [])])
                    if child.level
                    else child.module or ""
                )
                names.add(module)
                names.update(f"{module}.{alias.name}" for alias in child.names)
            pending.append(child)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the forge modules it imports (the longest known prefix of each import)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for imported in _imported_names(ast.parse(path.read_text()), package):
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def import_cycles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """The groups of modules that import each other (strongly connected, more than one)."""
    graph = import_graph() if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            group.append(v)
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _asks_kind(test: ast.AST) -> bool:
    """Whether the expression ``test`` asks what kind of model it has."""
    for node in ast.walk(test):
        if isinstance(node, ast.Attribute) and node.attr in KIND_ATTRS:
            return True
        if isinstance(node, ast.Name) and node.id in KIND_TYPES | KIND_NAMES:
            return True  # a type, or a local named after a kind's section (``vlm = cfg.vlm``)
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if name in KIND_CALLS:
                return True
    return False


def kind_branches_in(tree: ast.AST) -> list[int]:
    """Lines of the branches of ``tree`` that ask for the model's kind."""
    lines = []
    for node in ast.walk(tree):
        tests: list[ast.AST] = []
        if isinstance(node, ast.If | ast.IfExp | ast.While):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = list(node.ifs)
        lines += [
            node.lineno if hasattr(node, "lineno") else t.lineno for t in tests if _asks_kind(t)
        ]
    return sorted(lines)


def kind_branches() -> dict[str, list[int]]:
    """``forge`` module -> the lines of its model-kind branches, outside :data:`SPEC_MODULES`."""
    found = {}
    for name, path in modules().items():
        if (
            name.partition(".")[0] != "forge"
            or name in SPEC_MODULES
            or name.startswith(SPEC_PACKAGES)
        ):
            continue
        lines = kind_branches_in(ast.parse(path.read_text()))
        if lines:
            found[name] = lines
    return found


def complexity_over(limit: int = 15) -> list[str]:
    """Functions over ``limit`` (ruff's C901), as ``path:line name (n)``."""
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "C901", "--output-format", "json"]
        + ["--config", f"lint.mccabe.max-complexity={limit}", "packages", "kernels"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode not in (0, 1):  # 1: findings; anything else: ruff did not run
        raise RuntimeError(f"ruff failed ({out.returncode}): {out.stderr.strip()}")
    return [
        f"{Path(d['filename']).relative_to(ROOT)}:{d['location']['row']} {d['message']}"
        for d in json.loads(out.stdout or "[]")
    ]


def main() -> int:
    lines = module_lines()
    over = {p: n for p, n in sorted(lines.items(), key=lambda kv: -kv[1]) if n > MODULE_LINES}
    print(f"source modules: {len(lines)}; over {MODULE_LINES} lines: {len(over)}")
    for path, n in over.items():
        print(f"  {n:5d}  {path}")
    complex_ = complexity_over()
    print(f"functions over cyclomatic complexity 15 (ruff C901): {len(complex_)}")
    for row in complex_:
        print(f"  {row}")
    cycles = import_cycles()
    print(f"import cycles: {len(cycles)}")
    for group in cycles:
        print("  " + " <-> ".join(group))
    kinds = kind_branches()
    print(f"model-kind branches outside the spec modules: {sum(map(len, kinds.values()))}")
    for name, at in kinds.items():
        print(f"  {len(at):3d}  {name} (lines {', '.join(map(str, at))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One reader per raw config field: the decisions a layout makes are read from the Layout.

``resolve_layout`` (forge/layout.py) reads the raw fields whose meaning depends on the rest of
the config (``tp.sequence_parallel`` "auto", ``tp.loss_parallel`` on pipeline stages,
``parallelism.ep`` carved out of the data-parallel ranks, ``float8.enabled``) and decides once;
every other module of the ``forge`` package reads the resolved ``Layout``. This test walks the
package's syntax trees for reads of those fields through a config (``<cfg>.<section>.<field>``,
any name but ``self``: a ``ParallelPlan``'s own ``float8`` is its parameter, not the file) and
allows them only in layout.py and in the places listed in ``HELD`` with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import forge

RAW = {
    ("float8", "enabled"),
    ("tp", "sequence_parallel"),
    ("tp", "sequence_parallel_flag"),
    ("tp", "loss_parallel"),
    ("parallelism", "ep"),
}
DECIDER = "layout.py"
#: (module, section, field) -> why that module reads the raw field.
HELD = {
    ("config_fields.py", "tp", "sequence_parallel_flag"): (
        "ParallelPlan.from_config hands the TP layer the ask: its plan may parallelize a "
        "Hugging Face model, for which forge_tp_plans decides 'auto' per model"
    ),
}


def _raw_reads(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(section, field, line) of every ``<name>.<section>.<field>`` read, name not ``self``."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)):
            continue
        section, field = node.value.attr, node.attr
        root = node.value.value
        if (section, field) in RAW and not (isinstance(root, ast.Name) and root.id == "self"):
            found.append((section, field, node.lineno))
    return found


def reads_outside_the_layout(package: Path) -> list[str]:
    """``module:line section.field`` for each raw read that is neither in layout.py nor held."""
    out = []
    for path in sorted(package.rglob("*.py")):
        if path.name == DECIDER:
            continue
        for section, field, line in _raw_reads(ast.parse(path.read_text())):
            if (path.name, section, field) not in HELD:
                out.append(f"{path.name}:{line} {section}.{field}")
    return out


def test_raw_layout_fields_are_read_by_resolve_layout_alone():
    package = Path(forge.__file__).parent
    assert reads_outside_the_layout(package) == []
    # the decider itself reads them, so the walk sees what it looks for
    layout = _raw_reads(ast.parse((package / DECIDER).read_text()))
    assert {(s, f) for s, f, _ in layout} >= {("float8", "enabled"), ("tp", "loss_parallel")}


def test_the_walk_finds_a_raw_read_and_ignores_a_plans_own_field(tmp_path: Path):
    (tmp_path / "job.py").write_text(
        "def f(cfg, layout):\n    return cfg.float8.enabled, layout.float8\n"
    )
    (tmp_path / "build.py").write_text(
        "class P:\n    def g(self):\n        return self.float8.enabled\n"
    )
    assert reads_outside_the_layout(tmp_path) == ["job.py:2 float8.enabled"]

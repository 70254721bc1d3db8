"""No layer reads or writes private torch state outside ``forge_core/torch_compat.py``.

Why: forge runs on torch 2.11 through 2.15; a private attribute (a module's ``_forward_hooks``
dicts, ``DeviceMesh._flatten``, a ``torch.x._y`` module) may change in any release and then
breaks silently deep in a layer. ``torch_compat.py`` is the one place allowed to touch them,
tested by ``packages/forge-core/tests/test_torch_compat.py``. (Float8 + TP was the last user of the
forward-hook dicts.)

A source scan (``ast``) of ``packages/*/src``:

1. no name of ``nn.Module``'s private state or methods (``_forward_hooks``, ``_parameters``,
   ``_call_impl``, ...) as an attribute or a string (``getattr(m, "_forward_pre_hooks")``);
2. no import from a private torch module (``torch.distributed.tensor._utils``) or of a private
   torch name, and no ``torch._x`` attribute chain;
3. no other underscore attribute that forge does not define itself (a private attribute of a
   torch object such as ``OpOverload._overloadname``), except the small allowlists below:
   names of other libraries, and the torch-private uses that predate this test, each pinned to
   its file so it cannot spread (move them into ``torch_compat.py``, then drop them here).
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
COMPAT = Path("packages/forge-core/src/forge_core/torch_compat.py")

#: Private names of nn.Module (instance state and methods), e.g. the forward-hook dicts.
MODULE_PRIVATE = frozenset(
    n for n in dir(nn.Module()) if n.startswith("_") and not n.startswith("__")
)
#: Underscore attributes of other libraries than torch, allowed anywhere.
NOT_TORCH = frozenset(
    {
        "_getframe",  # sys
        "_exit",  # os
        "_attn_implementation",  # transformers' PretrainedConfig
        "_init_weights",  # transformers' PreTrainedModel: its per-module init (forge.hf_prepare)
        "_SubParsersAction",  # argparse's type of add_subparsers() (forge.plot's CLI hook)
        "_Hash",  # hashlib's type of a running digest (forge's text cache keys)
    }
)
#: Torch-private uses outside torch_compat.py allowed by (file, name): none (each earlier one moved
#: into torch_compat.py).
KNOWN: frozenset[tuple[str, str]] = frozenset()


def _sources() -> list[Path]:
    files = sorted(ROOT.glob("packages/*/src/**/*.py"))
    return [f for f in files if f.relative_to(ROOT) != COMPAT]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_by_forge(trees: list[ast.Module]) -> set[str]:
    """Underscore names forge defines itself: functions, classes, assigned names and
    attributes, arguments and import aliases (and, by convention, every ``_forge*`` name: the
    marks forge keeps in a module's ``__dict__``)."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return {n for n in names if _private(n)} - MODULE_PRIVATE


def _ours(name: str, forge_names: set[str]) -> bool:
    """Whether ``name`` is forge's own or another library's (allowlisted)."""
    return name in forge_names or name in NOT_TORCH or name.startswith("_forge")


def _torch_chain(node: ast.Attribute) -> list[str] | None:
    """``["torch", "a", "_b"]`` for ``torch.a._b`` (None when the chain is not rooted at torch)."""
    parts = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    if isinstance(value, ast.Name) and value.id == "torch":
        return ["torch", *reversed(parts)]
    return None


def _findings(path: Path, tree: ast.Module, forge_names: set[str]) -> list[tuple[str, str, int]]:
    """``(file, name, line)`` for each private torch use in ``tree``."""
    rel = str(path.relative_to(ROOT))
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _torch_chain(node)
            if chain is not None and any(_private(p) for p in chain):
                name = ".".join(chain)
            elif node.attr in MODULE_PRIVATE or not _ours(node.attr, forge_names):
                name = node.attr
        elif isinstance(node, ast.Constant) and node.value in MODULE_PRIVATE:
            name = str(node.value)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            if any(_private(p) for p in module.split(".")):
                name = module
            else:
                name = next((a.name for a in node.names if _private(a.name)), None)
        elif isinstance(node, ast.Import):
            name = next(
                (
                    a.name
                    for a in node.names
                    if a.name.split(".")[0] == "torch"
                    and any(_private(p) for p in a.name.split("."))
                ),
                None,
            )
        if name is not None and (rel, name) not in KNOWN:
            found.append((rel, name, getattr(node, "lineno", 0)))
    return found


def test_the_scan_sees_the_hook_dicts_it_forbids():
    assert {"_forward_hooks", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"} <= (
        MODULE_PRIVATE
    )
    planted = ast.parse(
        "m._forward_hooks.pop(1)\n"
        "getattr(m, '_forward_pre_hooks')\n"
        "from torch.distributed._tools import x\n"
        "torch.nn.modules.module._global_forward_hooks\n"
        "mesh._flatten('dp')\n"
    )
    names = sorted(name for _, name, _ in _findings(ROOT / "planted.py", planted, set()))
    assert names == [
        "_flatten",
        "_forward_hooks",
        "_forward_pre_hooks",
        "torch.distributed._tools",
        "torch.nn.modules.module._global_forward_hooks",
    ]


def test_no_private_torch_attribute_outside_torch_compat():
    files = _sources()
    assert files, "no sources under packages/*/src"
    trees = {f: ast.parse(f.read_text(), filename=str(f)) for f in files}
    forge_names = _defined_by_forge(list(trees.values()))
    found = [hit for f, tree in trees.items() for hit in _findings(f, tree, forge_names)]
    assert not found, (
        "private torch attributes outside forge_core/torch_compat.py (add a function there, or "
        "for another library's name extend NOT_TORCH): "
        + "; ".join(f"{f}:{line} {name}" for f, name, line in found)
    )

"""Package ``__init__`` modules that import their names on first use (PEP 562).

A forge launcher checks a config before it starts ranks. Those checks are pure Python, but a
package whose ``__init__`` imports its torch-heavy modules makes ``import forge_tp_plans.checks``
cost seconds (torch and DTensor's operator tables). With :func:`lazy_exports` a package lists
where each public name lives, and the module defining it is imported only when the name is
first read, so its torch-free submodules import in milliseconds.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for package ``package`` whose public ``name`` is defined in
    submodule ``exports[name]`` (a name relative to the package, e.g. ``"apply"``)."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later reads find it without this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__

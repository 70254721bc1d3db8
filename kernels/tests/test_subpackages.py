"""forge_kernels is split by concept, and only the native ops' build needs cmake and ninja."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import forge_kernels

SCRIPT = textwrap.dedent(
    """
    import shutil, sys
    sys.modules["cmake"] = sys.modules["ninja"] = None  # the Python wheels of the extra: absent
    assert shutil.which("cmake") is None and shutil.which("ninja") is None
    import torch
    from forge_kernels.grouped_gemm import grouped_gemm
    from forge_kernels.permute import permute, routing_layout
    from forge_kernels.routing import routing_layout_reference

    x, w = torch.randn(6, 4), torch.randn(2, 4, 3)
    y = grouped_gemm(x, w, torch.tensor([2, 6], dtype=torch.int32))
    assert torch.allclose(y[:2], x[:2] @ w[0], atol=1e-6) and torch.allclose(y[2:], x[2:] @ w[1], atol=1e-6)
    ids = torch.tensor([[0, 1], [1, 0], [1, 1]])
    layout = routing_layout(ids, 2)
    rows = permute(torch.randn(3, 4), layout, 2)
    assert rows.shape[0] >= 6
    assert not any(name.startswith("forge_kernels.native") for name in sys.modules)
    print("ok")
    """
)


def test_the_pure_python_parts_import_and_run_without_cmake_or_ninja(tmp_path):
    env = {"PATH": str(tmp_path), "PYTHONPATH": ":".join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_one_subpackage_per_concept():
    from importlib import import_module

    for name in ("grouped_gemm", "permute", "native"):
        module = import_module(f"forge_kernels.{name}")
        assert module.__file__ is not None and module.__file__.endswith("/__init__.py"), name
    # the kernels live beside their concept, not as loose private modules of the package
    top = {p.name for p in Path(forge_kernels.__file__).parent.glob("_*.py")}
    assert top == {"__init__.py"}

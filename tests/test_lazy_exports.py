"""Packages import their names on first use: the config and the pure checks load without torch.

forge's launcher checks a config, and the checkpoint a resume starts from, before it imports
torch; these tests keep that true as modules move (a torch import at the top of a checks module
or an eager package ``__init__`` would fail them).
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

#: package -> its modules that must import without torch
TORCH_FREE = {
    "forge_core": ["forge_core.config", "forge_core.errors", "forge_core.model_config"],
    "forge_tp_plans": ["forge_tp_plans.checks", "forge_tp_plans.config"],
    "forge_moe_ep": ["forge_moe_ep.checks"],
    "forge_fsdp_wrap": ["forge_fsdp_wrap.checks"],
    "forge_float8": ["forge_float8.checks", "forge_float8.config"],
    "forge_vlm": ["forge_vlm.checks", "forge_vlm.config"],
    "forge_domain": ["forge_domain.config"],
    "forge_cp": ["forge_cp.checks"],
    "forge_checkpoint": ["forge_checkpoint.files"],
    "forge": ["forge.checks", "forge.cli", "forge.config", "forge.resume"],
}


def test_the_config_checks_and_checkpoint_files_import_without_torch():
    modules = [m for ms in TORCH_FREE.values() for m in ms]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]


@pytest.mark.parametrize("package", sorted(TORCH_FREE))
def test_every_exported_name_resolves(package: str):
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


def test_building_a_plan_imports_no_triton_language():
    """forge's composition imported (every layer's apply path, forge-cp's kernel included) must
    not import triton's language module: after that import triton ignores a TRITON_INTERPRET=1
    set later in the process, which forge-kernels' CPU tests set (torch.nn.attention.bias and
    torch.compiler.disable both import it, so forge-cp imports them when first used)."""
    code = "import sys, forge.build, forge.plan; print('triton.language' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout[:500]

"""forge: make a PyTorch model parallel.

This meta-package composes the layers (forge_core, forge_mesh, forge_fsdp_wrap, ...) and adds
nothing but composition (:func:`build_parallel_model`, :class:`ParallelPlan`) and the ``forge``
CLI.
"""

from typing import TYPE_CHECKING

from forge_core.lazy import lazy_exports

# NOTE: imported on first use: the CLI checks a config (forge.checks) before it imports torch.
_EXPORTS = {
    "ParallelPlan": "build",
    "build_parallel_model": "build",
    "materialize": "build",
    "check_plan": "checks",
    "ForgeConfig": "config",
    "load_config": "config",
}

if TYPE_CHECKING:
    from .build import ParallelPlan, build_parallel_model, materialize
    from .checks import check_plan
    from .config import ForgeConfig, load_config

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__version__ = "0.1.0"
__all__ = [
    "ForgeConfig",
    "ParallelPlan",
    "build_parallel_model",
    "check_plan",
    "load_config",
    "materialize",
]

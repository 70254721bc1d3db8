"""forge: make a PyTorch model parallel.

This meta-package composes the layers (forge_core, forge_mesh, forge_fsdp_wrap, ...) and adds
nothing but composition (:func:`build_parallel_model`, :class:`ParallelPlan`) and the ``forge``
CLI.
"""

from .build import ParallelPlan, build_parallel_model, check_plan, materialize

__version__ = "0.1.0"
__all__ = ["ParallelPlan", "build_parallel_model", "check_plan", "materialize"]

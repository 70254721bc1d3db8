"""Shared fixtures: persistent CPU rank pools (one per world size, kept for the whole session)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from forge_core.testing.harness import PRELOAD, RankPool, start_cpu_forkserver  # noqa: E402

RunOnRanks = Callable[..., list[Any]]

#: What the forkserver every rank worker forks from imports once, besides RankPool's own list
#: (torch, torch.distributed, forge_core), so that no worker imports it again: DTensor, FSDP2
#: and DCP alone are ~2.5 s of CPU per worker, and a session starts 14+ workers (pools of 2, 4
#: and 8 ranks, and restarts), two at a time on 2 cores.
_PRELOAD = [
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.pipelining",
    "forge.build",
    "forge_checkpoint.dcp",
    "forge_checkpoint.export",
    "forge.train",
    "forge_core.testing",
    "forge_core.training",
    # torch.compile's first call (aot_eager: many rank tests compile, on pools of 2 and 4)
    "torch._functorch.aot_autograd",
    "torch._inductor.compile_fx",
]

#: Imports that a test module's rank functions do lazily (inside the function): preloaded
#: only when a test of that module that runs ranks is collected.
_LAZY_IMPORTS = {
    "tests.zoo.test_hf_zoo": ["transformers"],
    "tests.tp_plans.test_hf_classics": ["transformers"],
    "tests.tp_plans.test_packed_styles": ["transformers"],
    "tests.integration.tp_plans.test_packed_styles_with_fsdp2": ["transformers"],
    "tests.integration.tp_plans.test_hf_models_with_fsdp2": ["transformers"],
    "tests.integration.moe_ep.test_hf_moe_training": ["transformers"],
    "tests.integration.vlm.test_hf_vlm": ["transformers"],
    "tests.tp_plans.test_hf_models": [
        "transformers",
        "transformers.models.llama.modeling_llama",
        "transformers.models.qwen2.modeling_qwen2",
        "transformers.models.mistral.modeling_mistral",
        "transformers.models.gemma.modeling_gemma",
    ],
}

_PRELOAD_ENV = "FORGE_TESTS_RANK_PRELOAD"


def _preload_here() -> None:
    """In the forkserver (which imports this module, see ``_start_forkserver``): import every
    module named in ``_PRELOAD_ENV``. A module that fails to import is left to fail in the
    worker that needs it, with its own error, instead of taking the forkserver down."""
    import importlib

    names = os.environ.pop(_PRELOAD_ENV, "")  # NOTE: popped: the workers' children never see it
    for name in filter(None, names.split(",")):
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001, S112 - pytest.skip at import is a BaseException
            continue


def _start_forkserver(modules: list[str]) -> None:
    """Start the forkserver (if it is not running yet), preloading ``_PRELOAD`` and ``modules``.

    NOTE: RankPool sets its own preload list before it starts workers, but the forkserver reads
    that list only when it starts: one started here keeps these imports. The list travels in
    the environment of the forkserver's start (it alone sees the variable) and this module, in
    the forkserver's preload list, imports it (``_preload_here``).
    """
    preload = ",".join(dict.fromkeys([*_PRELOAD, *modules]))
    start_cpu_forkserver([*PRELOAD, __name__], {_PRELOAD_ENV: preload})


if os.environ.get(_PRELOAD_ENV):  # in the forkserver only
    _preload_here()


def _uses_ranks(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    return "run_on_ranks" in names or "rank_forkserver" in names


_COLLECTED_RANK_MODULES: list[str] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the rank workers' forkserver once collection is done, so that its imports run in
    parallel with the first tests that need no ranks.

    A worker imports the module of each function it runs (the function travels by name), so
    the forkserver also imports the collected test modules that run ranks, and the lazy imports
    of their rank functions (``_LAZY_IMPORTS``), once instead of once per worker.
    """
    modules: list[str] = []
    for item in session.items:
        module = getattr(getattr(item, "module", None), "__name__", None)
        if module and _uses_ranks(item):
            modules += [module, *_LAZY_IMPORTS.get(module, [])]
    _COLLECTED_RANK_MODULES[:] = list(dict.fromkeys(modules))
    if _COLLECTED_RANK_MODULES and not session.config.option.collectonly:
        _start_forkserver(_COLLECTED_RANK_MODULES)


@pytest.fixture(scope="session")
def rank_forkserver() -> None:
    """The forkserver rank workers fork from, started with the preloads above (for tests that
    start a RankPool of their own)."""
    _start_forkserver(_COLLECTED_RANK_MODULES)


@pytest.fixture(scope="session")
def run_on_ranks(rank_forkserver: None) -> Iterator[RunOnRanks]:
    """``run_on_ranks(n, fn, *args, **kwargs)`` runs a module-level ``fn`` on n gloo ranks.

    Workers start once per world size and stay alive across tests (torch imported once).
    """
    pools: dict[int, RankPool] = {}

    def run(world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        pool = pools.setdefault(world_size, RankPool(world_size))
        return pool.run(fn, *args, **kwargs)

    yield run
    for pool in pools.values():
        pool.close()

"""pytest fixtures that run test functions on CPU gloo ranks: ``run_on_ranks`` and the forkserver.

Every test folder that runs ranks (forge's ``tests/`` and each layer's ``tests/``, which a
vendored layer takes along) takes the fixtures from here in its ``conftest.py``::

    from forge_core.testing.pytest_ranks import rank_forkserver, run_on_ranks  # noqa: F401

``run_on_ranks(n, fn, *args, **kwargs)`` runs a module-level ``fn`` on n gloo ranks and returns
each rank's result. Its pools (one per world size) live in this module, not in a fixture's
value, so folders whose conftests each import the fixtures still share one set of workers.

The workers fork from one forkserver, which imports once what every worker would otherwise
import again: torch and its distributed packages (:data:`BASE_PRELOAD`), each collected test
module that runs ranks (a worker imports the module of each function it runs: functions travel
by name), and what such a module names in its ``RANK_PRELOAD`` list (the imports its rank
functions make inside the function, ``["transformers"]``). A conftest may add more names with
:func:`add_preload`. The forkserver starts when the first rank test asks for it, or earlier if a
conftest also imports :func:`pytest_collection_finish` (then its imports run beside the first
tests that need no ranks).

This module imports pytest; nothing in forge's layers imports it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from .harness import PRELOAD, RankPool, start_cpu_forkserver

__all__ = [
    "BASE_PRELOAD",
    "RunOnRanks",
    "add_preload",
    "pytest_collection_finish",
    "rank_forkserver",
    "rank_modules",
    "run_on_ranks",
]

RunOnRanks = Callable[..., list[Any]]

#: What the forkserver imports for every session that runs ranks, besides RankPool's own list:
#: DTensor, FSDP2, DCP and pipelining alone are ~2.5 s of CPU per worker, and a session starts
#: 14+ workers (pools of 2, 4 and 8 ranks, and restarts), two at a time on 2 cores.
BASE_PRELOAD = [
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.pipelining",
    "forge_core.testing",
    "forge_core.training",
    # torch.compile's first call (aot_eager: many rank tests compile)
    "torch._functorch.aot_autograd",
    "torch._inductor.compile_fx",
]

_EXTRA_PRELOAD: list[str] = []
_PRELOAD_ENV = "FORGE_TESTS_RANK_PRELOAD"
_POOLS: dict[int, RankPool] = {}


def add_preload(names: Iterable[str]) -> None:
    """Have the forkserver import ``names`` too (call it from a conftest, before the first
    rank test; a forkserver already running keeps what it imported)."""
    _EXTRA_PRELOAD.extend(names)


def _uses_ranks(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    return "run_on_ranks" in names or "rank_forkserver" in names


def rank_modules(items: Iterable[pytest.Item]) -> list[str]:
    """The modules of the tests in ``items`` that run ranks, each followed by its
    ``RANK_PRELOAD`` names, in order and without repeats."""
    names: list[str] = []
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and _uses_ranks(item):
            names += [module.__name__, *getattr(module, "RANK_PRELOAD", ())]
    return list(dict.fromkeys(names))


def _preload_here() -> None:
    """In the forkserver (which imports this module, see :func:`_start`): import every module
    named in ``_PRELOAD_ENV``. One that fails to import is left to fail in the worker that needs
    it, with its own error, instead of taking the forkserver down."""
    names = os.environ.pop(_PRELOAD_ENV, "")  # NOTE: popped: the workers' children never see it
    for name in filter(None, names.split(",")):
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001, S112 - pytest.skip at import is a BaseException
            continue


def _start(session: pytest.Session) -> None:
    """Start the forkserver (if it is not running yet) with every preload above.

    NOTE: the forkserver reads its preload list only when it starts, so the list travels in the
    environment of its start (it alone sees the variable), and this module, in the forkserver's
    own preload list, imports it (``_preload_here``).
    """
    names = [*BASE_PRELOAD, *_EXTRA_PRELOAD, *rank_modules(session.items)]
    start_cpu_forkserver([*PRELOAD, __name__], {_PRELOAD_ENV: ",".join(dict.fromkeys(names))})


if os.environ.get(_PRELOAD_ENV):  # in the forkserver only
    _preload_here()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the forkserver as soon as collection is done, if any collected test runs ranks
    (a conftest that imports this hook opts in)."""
    if not session.config.option.collectonly and rank_modules(session.items):
        _start(session)


@pytest.fixture(scope="session")
def rank_forkserver(request: pytest.FixtureRequest) -> None:
    """The forkserver rank workers fork from, started with the preloads above (for tests that
    start a RankPool of their own)."""
    _start(request.session)


@pytest.fixture(scope="session")
def run_on_ranks(rank_forkserver: None) -> Iterator[RunOnRanks]:
    """``run_on_ranks(n, fn, *args, **kwargs)`` runs a module-level ``fn`` on n gloo ranks.

    Workers start once per world size and stay alive across tests (torch imported once).
    """

    def run(world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        pool = _POOLS.get(world_size)
        if pool is None:
            pool = _POOLS[world_size] = RankPool(world_size)
        return pool.run(fn, *args, **kwargs)

    yield run
    while _POOLS:
        _POOLS.popitem()[1].close()

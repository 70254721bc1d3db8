"""Shared fixtures: persistent CPU rank pools (one per world size, kept for the whole session)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from forge_core.testing.harness import RankPool  # noqa: E402

RunOnRanks = Callable[..., list[Any]]


@pytest.fixture(scope="session")
def run_on_ranks() -> Iterator[RunOnRanks]:
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

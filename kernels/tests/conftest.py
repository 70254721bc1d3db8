"""Kernel tests: the interpreter fix of :mod:`forge_kernels.interpreter` for the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from forge_kernels.interpreter import interpreter_index_fix


@pytest.fixture(scope="session", autouse=True)
def _triton_interpreter_index_fix() -> Iterator[None]:
    with interpreter_index_fix():
        yield

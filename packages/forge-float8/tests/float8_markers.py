"""Skip markers of the Float8 tests, each with the reason it prints (the integration tests of
Float8 import them from here too)."""

from __future__ import annotations

import importlib.util

import pytest

#: Float8 training runs through torchao; the lent GPU machines' image (and so the GPU-image CI
#: lane) has none. tools/gpu_check carries a wheel there.
needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="torchao is not installed here (Float8 runs through torchao)",
)

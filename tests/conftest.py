"""Shared fixtures of forge's own tests: the rank fixtures of :mod:`forge_core.testing.pytest_ranks`
(whose pools each layer's ``tests/conftest.py`` shares), started as soon as collection is done."""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from forge_core.testing.pytest_ranks import (  # noqa: E402, F401 - fixtures and the hook
    add_preload,
    pytest_collection_finish,
    rank_forkserver,
    run_on_ranks,
)

# What forge's own rank tests import inside their rank functions, besides the layers' modules.
add_preload(["forge.build", "forge.train", "forge_checkpoint.dcp", "forge_checkpoint.export"])

"""The rank fixtures (``run_on_ranks``) of forge_core's harness, for this folder's tests."""

from forge_core.testing.pytest_ranks import rank_forkserver, run_on_ranks  # noqa: F401

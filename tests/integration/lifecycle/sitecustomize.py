"""A slow rank 0 for ``forge train``'s real ranks (tests/integration/test_lifecycle.py).

Python imports ``sitecustomize`` at start-up from the import path, so a test that puts this
folder on ``PYTHONPATH`` reaches every process forge's launcher starts. With
``FORGE_TEST_SLOW_RANK0=<file>``, rank 0 takes 3 s longer than the other ranks to finish a run
(its final report, written after the last collective: as with a slow terminal or file system)
and appends a line to ``<file>``: the other ranks have returned seconds before it. Nothing
happens without the variable.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time

_MARKER = os.environ.get("FORGE_TEST_SLOW_RANK0")


class _SlowReport(importlib.abc.MetaPathFinder):
    """Once ``forge.train`` is imported, its ``_report`` (rank 0 only) sleeps 3 s first."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "forge.train":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_slow_down(module):  # type: ignore[no-untyped-def]
            exec_module(module)
            report = module._report

            def slow_report(*args, **kwargs):  # type: ignore[no-untyped-def]
                with open(_MARKER, "a") as f:
                    f.write(f"rank {os.environ.get('RANK')} reports 3 s late\n")
                time.sleep(3.0)
                return report(*args, **kwargs)

            module._report = slow_report

        spec.loader.exec_module = exec_and_slow_down
        return spec


if _MARKER:
    sys.meta_path.insert(0, _SlowReport())

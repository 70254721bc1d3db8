"""Fault injection for ``forge train``'s real ranks (tests/integration/test_faults.py).

Python imports ``sitecustomize`` at start-up from the import path, so a test that puts this
folder on ``PYTHONPATH`` reaches every rank forge's launcher starts (the launcher's forkserver
imports it once). With ``FORGE_FAULT=<kind>:<rank>:<step>`` rank ``<rank>`` fails while it writes
its tensor data for the checkpoint of step ``<step>``:

- ``kill``: once rank 0's shard file is written (it marks that beside the checkpoint), the rank
  SIGKILLs itself, its own shard never written: the save dies between shards;
- ``enospc``: its write fails with ``OSError(ENOSPC)``, as on a full disk.

Nothing happens without ``FORGE_FAULT``.
"""

from __future__ import annotations

import os
import sys

_FAULT = os.environ.get("FORGE_FAULT")
#: multiprocessing's resource tracker, a helper the launcher starts: never a rank, and without
#: this test it would not import torch (seconds of CPU beside the launch).
_HELPER = "multiprocessing.resource_tracker" in " ".join(sys.orig_argv)

if _FAULT and not _HELPER:
    import errno
    import signal
    import time
    from pathlib import Path

    from torch.distributed.checkpoint import FileSystemWriter

    _kind, _rank, _step = _FAULT.split(":")
    _write_data = FileSystemWriter.write_data

    def _faulty_write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        here = Path(str(self.path))
        marker = here.parent / f".rank0-wrote-{here.name}"  # beside the checkpoint, not in it
        if not here.name.endswith(f"{int(_step):08d}"):
            return _write_data(self, plan, planner)
        if os.environ.get("RANK") == "0":
            written = _write_data(self, plan, planner)
            written.wait()  # NOTE: DCP's writes finish (closed, fsynced) before this returns
            marker.touch()
            return written
        if os.environ.get("RANK") != _rank:
            return _write_data(self, plan, planner)
        if _kind == "enospc":
            raise OSError(
                errno.ENOSPC, os.strerror(errno.ENOSPC), str(here / f"__{_rank}_0.distcp")
            )
        deadline = time.monotonic() + 60
        while not marker.is_file() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = _faulty_write_data  # type: ignore[method-assign]

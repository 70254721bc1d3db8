"""Run a function on N gloo ranks on the CPU, with worker processes kept alive between calls.

Starting a rank costs a torch import (seconds), so a :class:`RankPool` starts its N workers once,
joins them into one gloo process group, and then runs any number of functions on all of them.
Functions and arguments are pickled (module-level functions travel by name). A failure on any
rank raises :class:`RankError` carrying every failing rank's traceback; a rank that does not
answer within the timeout (a hang in a collective) makes the pool kill its workers and raise
instead of blocking, and the next call starts a fresh pool.

The ranks are CPU ranks: the forkserver they fork from starts with every GPU hidden
(``CUDA_VISIBLE_DEVICES=""``, :func:`start_cpu_forkserver`). Otherwise an import that asks CUDA
a question there (torchao asks for the device's capability at import) initializes CUDA in the
forkserver, and no process forked from it can use CUDA or import such a module again.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing import forkserver
from typing import Any

__all__ = ["RankError", "RankPool", "start_cpu_forkserver"]

#: What RankPool's forkserver imports once, for every rank forked from it.
PRELOAD = ["torch", "torch.distributed", "forge_core"]


def start_cpu_forkserver(preload: list[str], env: Mapping[str, str] | None = None) -> None:
    """Start this process's forkserver (if it is not running yet) importing ``preload``, with
    every GPU hidden from it and ``env`` added to its environment; this process's own
    environment is left as it was.

    The forkserver reads its preload list and environment only when it starts: a forkserver
    already running (started by someone else) keeps its own.
    """
    mp.get_context("forkserver").set_forkserver_preload(preload)
    extra = {"CUDA_VISIBLE_DEVICES": "", **(env or {})}
    before = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        forkserver.ensure_running()
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class RankError(RuntimeError):
    """One or more ranks failed or hung; the message holds their tracebacks."""


def _worker(
    rank: int, world_size: int, store_path: str, sys_path: list[str], tasks: Any, results: Any
) -> None:
    sys.path[:] = sys_path
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share few cores: oversubscription costs more than it gives
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    results.put((None, rank, True, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        onednn = torch.backends.mkldnn.enabled
        try:
            out = fn(*args, **kwargs)
            results.put((task_id, rank, True, out))
        except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt
            results.put((task_id, rank, False, traceback.format_exc()))
        finally:  # a job may turn oneDNN off (Float8 on CPU); the next job gets it back
            torch.backends.mkldnn.enabled = onednn
    dist.destroy_process_group()


class RankPool:
    """N persistent CPU ranks in one gloo process group.

    >>> pool = RankPool(4)
    >>> pool.run(my_module.fn, arg)   # -> [result of rank 0, ..., result of rank 3]
    >>> pool.close()
    """

    def __init__(self, world_size: int, *, start_timeout: float = 300.0) -> None:
        self.world_size = world_size
        self.start_timeout = start_timeout
        self._procs: list[Any] = []
        self._task_id = 0

    def _start(self) -> None:
        # NOTE: a forkserver imports torch once and forks every rank from that clean,
        # single-threaded process: a 4-rank pool starts in seconds instead of paying one torch
        # import per rank (~4 s each, serialized on a 2-core machine). Plain fork from the caller
        # is unsafe (its OpenMP/gloo threads do not survive fork).
        start_cpu_forkserver(PRELOAD)
        ctx = mp.get_context("forkserver")
        self._dir = tempfile.TemporaryDirectory(prefix="forge-ranks-")
        store_path = os.path.join(self._dir.name, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    store_path,
                    list(sys.path),
                    self._tasks[r],
                    self._results,
                ),
                daemon=True,
                name=f"forge-rank-{r}",
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect(None, self.start_timeout, what="start")

    def _collect(self, task_id: int | None, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(outputs) + len(errors) < self.world_size:
            if errors:  # others are likely blocked in a collective with the failed rank
                deadline = min(deadline, time.monotonic() + 5.0)
            try:
                tid, rank, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - outputs.keys() - errors.keys())
                    reason = (
                        f"worker(s) {dead} died" if dead else f"no answer within {timeout:.0f}s"
                    )
                    self.close(force=True)
                    raise RankError(
                        self._message(
                            what,
                            errors,
                            f"ranks {missing}: {reason} (hung in a collective?); pool restarted",
                        )
                    ) from None
                continue
            if tid != task_id:
                continue  # a late answer from an earlier, abandoned call
            (outputs if ok else errors)[rank] = value
        if errors:
            raise RankError(self._message(what, errors, None))
        return [outputs[r] for r in range(self.world_size)]

    def _message(self, what: str, errors: dict[int, str], extra: str | None) -> str:
        parts = [f"{what} failed on {len(errors)} of {self.world_size} ranks"]
        parts += [f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())]
        if extra:
            parts.append(extra)
        return "\n".join(parts)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        if not self._procs:
            self._start()
        self._task_id += 1
        for q in self._tasks:
            q.put((self._task_id, fn, args, kwargs))
        return self._collect(self._task_id, timeout, what=getattr(fn, "__qualname__", repr(fn)))

    def close(self, force: bool = False) -> None:
        """Stop the workers (politely unless ``force``)."""
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._dir.cleanup()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

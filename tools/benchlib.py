"""Timing helpers shared by the ``tools/bench_*.py`` scripts (imported as a sibling module)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["once_ms", "sync", "time_interleaved"]


def sync(device: torch.device) -> None:
    """Wait for queued device work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def once_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call: CUDA events on a GPU, ``time.perf_counter`` on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_interleaved(
    fns: dict[str, Callable[[], object]], device: torch.device, reps: int, warmup: int = 2
) -> dict[str, tuple[float, float]]:
    """{name: (median ms, min ms)}; the functions run round-robin, ``reps`` rounds.

    NOTE: round-robin so that load from other processes on a shared machine hits every variant
    alike instead of whichever happened to run during a burst.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(once_ms(fn, device))
    return {name: (statistics.median(v), min(v)) for name, v in times.items()}

"""Timing helpers shared by the ``tools/bench_*.py`` scripts (imported as a sibling module)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["machine_facts", "once_ms", "record_target", "sync", "time_interleaved"]

#: Environment variable naming a JSON-lines file that :func:`record_target` appends to
#: (``tools/gpu_check`` sets it and prints the collected targets as its closing table).
SUMMARY_ENV = "FORGE_BENCH_SUMMARY"


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


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (all cores; Linux
    ``/proc/stat``: user, nice, system, irq, softirq and steal), or None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or "unknown model"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown model"


def machine_facts(packages: Sequence[str] = ("triton",)) -> dict[str, str]:
    """The machine lines every ``benchmarks/*.md`` page starts with: date, versions (``packages``
    besides python and torch; "not installed" when missing), CPU, GPU, load average now."""

    def version(name: str) -> str:
        try:
            return str(__import__(name).__version__)
        except ImportError:
            return "not installed"

    gpu = "none"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    return {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **{name: version(name) for name in packages},
        "cpu": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        "gpu": gpu,
        "load average at start (1/5/15 min)": "/".join(f"{x:.1f}" for x in os.getloadavg()),
    }


def record_target(bench: str, target: str, measured: str, met: bool | None) -> None:
    """Note one benchmark target and what was measured against it.

    Printed as a ``TARGET`` line and, when ``$FORGE_BENCH_SUMMARY`` names a file, appended to
    it as a JSON line (``tools/gpu_check`` gathers those into its summary table). ``met`` is
    None when the run could not decide (e.g. a CPU run of a GPU target).
    """
    verdict = "n/a" if met is None else ("met" if met else "NOT met")
    print(f"TARGET {bench} | {target} | {measured} | {verdict}", flush=True)
    path = os.environ.get(SUMMARY_ENV)
    if path:
        with open(path, "a") as f:
            row = {"bench": bench, "target": target, "measured": measured, "met": met}
            f.write(json.dumps(row) + "\n")


def measure_on_rank_pools(
    measure: Callable[[Callable[..., list[Any]]], Any],
) -> tuple[Any, dict[str, str], float]:
    """``measure(run_on_ranks)`` with one ``forge_core.testing.RankPool`` per world size (closed
    afterwards) and one torch thread here; returns its result, the machine's facts (the CPU
    model, the load averages at start and end) and the wall seconds it took."""
    from forge_core.testing import RankPool

    torch.set_num_threads(1)
    info = machine_facts(packages=())
    info["cpu"] = f"{info['cpu']} ({cpu_model()})"
    start = time.perf_counter()
    pools: dict[int, RankPool] = {}

    def run_on_ranks(n: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return pools.setdefault(n, RankPool(n)).run(fn, *args, timeout=900.0)

    try:
        result = measure(run_on_ranks)
    finally:
        for pool in pools.values():
            pool.close()
    info["load average at end (1/5/15 min)"] = "/".join(f"{x:.1f}" for x in os.getloadavg())
    return result, info, time.perf_counter() - start

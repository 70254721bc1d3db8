"""Benchmark forge's build path and write ``benchmarks/build.md``.

Run from anywhere: ``uv run python tools/bench_build.py`` (about 3 minutes on 2 CPU cores).

- ``forge build``: wall time of the default CLI run (dp_shard 2 x tp 2 with sequence parallelism
  on 4 CPU ranks), ``--reps`` times; each must exit 0 and PASS.
- planning: one fresh interpreter per layout (so ``ru_maxrss`` is its own) on the ``fake`` backend
  at world size 1,024: mesh, ``llama3_8b`` on meta, optional ``apply_tensor_parallel``, optional
  ``apply_ac(full)``, ``apply_fsdp2``.

Prints the tables and rewrites ``benchmarks/build.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 1024
PRESET = "llama3_8b"
DEFAULT_LAYOUT = "dp_shard 2 x tp 2 with sequence parallelism, 4 CPU ranks"
# (label, parallelism dict, ac_mode); tp > 1 applies the reference plan (sequence parallel on).
LAYOUTS: list[tuple[str, dict[str, int], str]] = [
    ("FSDP2 dp_shard=1024", {"dp_shard": -1}, "none"),
    ("FSDP2 dp_shard=1024 + AC full", {"dp_shard": -1}, "full"),
    ("HSDP dp_replicate=8 x dp_shard=128", {"dp_replicate": 8, "dp_shard": 128}, "none"),
    ("HSDP 8 x 128 + AC full", {"dp_replicate": 8, "dp_shard": 128}, "full"),
    ("FSDP2 x TP dp_shard=128 x tp=8 + SP", {"dp_shard": -1, "tp": 8}, "none"),
    ("FSDP2 x TP 128 x 8 + SP + AC full", {"dp_shard": -1, "tp": 8}, "full"),
]


def _plan_child(parallelism: dict[str, int], ac_mode: str) -> dict[str, Any]:
    """Runs in a fresh interpreter: plan one layout on the fake backend, return the numbers."""
    import resource

    import torch
    import torch.distributed as dist
    from forge_core import ModelConfig, Transformer
    from forge_fsdp_wrap import apply_ac, apply_fsdp2, default_mp_policy
    from forge_mesh import build_device_mesh
    from forge_tp_plans import apply_tensor_parallel
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {"torch": torch.__version__}
    out["rss_after_import_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.init_process_group("fake", rank=0, world_size=WORLD_SIZE)
    t = time.perf_counter()
    mesh = build_device_mesh(parallelism, "cpu")
    out["mesh_s"] = time.perf_counter() - t
    t = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(ModelConfig.preset(PRESET))
    out["model_s"] = time.perf_counter() - t
    # NOTE: the first meta-device normal_ imports torch._dynamo (torch._refs is dynamo-disabled),
    # ~2 s once per process; a second build shows forge's own cost.
    t = time.perf_counter()
    with torch.device("meta"):
        Transformer(ModelConfig.preset(PRESET))
    out["model_warm_s"] = time.perf_counter() - t
    out["full_params"] = sum(p.numel() for p in model.parameters())
    t = time.perf_counter()
    if parallelism.get("tp", 1) > 1:
        apply_tensor_parallel(model, mesh)
    out["tp_s"] = time.perf_counter() - t if parallelism.get("tp", 1) > 1 else None
    t = time.perf_counter()
    if ac_mode != "none":
        apply_ac(model, ac_mode)
    out["ac_s"] = time.perf_counter() - t if ac_mode != "none" else None
    t = time.perf_counter()
    apply_fsdp2(model, mesh, mp_policy=default_mp_policy())
    out["fsdp2_s"] = time.perf_counter() - t
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) and p.is_meta for p in params), "expected meta DTensors"
    out["local_params"] = sum(p.to_local().numel() for p in params)
    out["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.destroy_process_group()
    return out


def bench_cli(reps: int) -> dict[str, Any]:
    """Time ``forge build`` (default config) ``reps`` times; fail loudly on a non-PASS run."""
    walls, jobs, report = [], [], ""
    for i in range(reps):
        t = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "forge.cli", "build"], cwd=ROOT, capture_output=True, text=True
        )
        walls.append(time.perf_counter() - t)
        if proc.returncode != 0 or "PASS:" not in proc.stdout:
            sys.exit(
                f"forge build run {i + 1} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        report = proc.stdout
        job = re.search(r"rank 0 job time ([\d.]+)s", proc.stdout)
        jobs.append(float(job.group(1)) if job else float("nan"))
        print(f"  forge build run {i + 1}/{reps}: {walls[-1]:.1f} s, exit 0, PASS", flush=True)
    return {"walls": walls, "jobs": jobs, "report": report}


def bench_plan(parallelism: dict[str, int], ac_mode: str) -> dict[str, Any]:
    """Run :func:`_plan_child` in a fresh interpreter and return its JSON."""
    arg = json.dumps({"parallelism": parallelism, "ac_mode": ac_mode})
    proc = subprocess.run(
        [sys.executable, __file__, "--child", arg], cwd=ROOT, capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"planning {parallelism} ac={ac_mode} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine_facts(torch_version: str, load_start: tuple[float, float, float]) -> dict[str, str]:
    cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    mem = re.search(r"^MemTotal:\s*(\d+)", Path("/proc/meminfo").read_text(), re.M)
    return {
        "CPU": cpu.group(1).strip() if cpu else platform.processor() or "unknown",
        "cores": str(len(os.sched_getaffinity(0))),
        "RAM": f"{int(mem.group(1)) / 2**20:.1f} GiB" if mem else "unknown",
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "torch": torch_version,
        "load average at the start (1 / 5 / 15 min)": " / ".join(f"{x:.1f}" for x in load_start),
        "load average at the end (1 min)": f"{os.getloadavg()[0]:.1f}",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def render(
    cli: dict[str, Any], plans: list[tuple[str, dict[str, Any]]], facts: dict[str, str]
) -> str:
    w, j = cli["walls"], cli["jobs"]
    cli_rows = [
        "| command | runs | median wall | min | max | rank-0 job time (median) |",
        "|---|---:|---:|---:|---:|---:|",
        f"| `forge build` (default: {DEFAULT_LAYOUT}) "
        f"| {len(w)} | {statistics.median(w):.1f} s | {min(w):.1f} s | {max(w):.1f} s "
        f"| {statistics.median(j):.1f} s |",
    ]
    plan_rows = [
        "| layout (world 1,024, fake backend) | mesh | model on meta (cold / warm) "
        "| apply_tensor_parallel | apply_ac | apply_fsdp2 | peak RSS (after import) "
        "| params/rank (rank 0) | full / per rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in plans:
        ac = "-" if r["ac_s"] is None else f"{r['ac_s'] * 1e3:.1f} ms"
        tp = "-" if r["tp_s"] is None else f"{r['tp_s']:.2f} s"
        plan_rows.append(
            f"| {label} | {r['mesh_s'] * 1e3:.0f} ms "
            f"| {r['model_s']:.2f} s / {r['model_warm_s'] * 1e3:.0f} ms "
            f"| {tp} | {ac} | {r['fsdp2_s']:.2f} s "
            f"| {r['peak_rss_kib'] / 1024:.0f} MiB ({r['rss_after_import_kib'] / 1024:.0f}) "
            f"| {r['local_params']:,} | {r['full_params'] / r['local_params']:.1f}x |"
        )
    full = plans[0][1]["full_params"]
    slowest = max(
        r["mesh_s"] + r["model_s"] + (r["tp_s"] or 0.0) + (r["ac_s"] or 0.0) + r["fsdp2_s"]
        for _, r in plans
    )
    extra = max(r["peak_rss_kib"] - r["rss_after_import_kib"] for _, r in plans) / 1024
    wall, job = statistics.median(w), statistics.median(j)
    tp_rows = [(label, r) for label, r in plans if r["tp_s"] is not None]
    tp_note = (
        f"`apply_tensor_parallel` on the 8B model takes at most "
        f"{max(r['tp_s'] for _, r in tp_rows):.2f} s; under {tp_rows[0][0]} rank 0 holds "
        f"{tp_rows[0][1]['local_params']:,} parameters."
        if tp_rows
        else ""
    )
    reading = textwrap.fill(
        f"Planning the 8B model for 1,024 ranks takes at most {slowest:.1f} s and {extra:.0f} MiB "
        "above the torch import per layout (the cold model build pays torch's one-off "
        "`torch._dynamo` import; see cold / warm), so a layout can be checked on one CPU before any "
        f"GPU is allocated, while `forge build`'s {wall:.0f} s are mostly process start, imports and "
        f"rank launch (its job: {job:.0f} s). {tp_note} A busy machine (see the load averages above) "
        "makes the `forge build` times longer.",
        width=100,
        break_on_hyphens=False,
    )
    fact_lines = "\n".join(f"- {k}: {v}" for k, v in facts.items())
    return f"""# Build benchmarks

Written by `uv run python tools/bench_build.py`; rerun it to refresh this page.

## What and how

1. **`forge build`**: wall time of `python -m forge.cli build` from the repo root with the default
   config ({DEFAULT_LAYOUT}), a fresh process
   per run; every run exited 0 and printed PASS. "rank-0 job time" is the job's own time from its
   report; the rest is process start, imports and rank launch. Last report:

   ```
{textwrap.indent(cli["report"].strip(), "   ")}
   ```
2. **Planning at scale**: a fresh process per row: `init_process_group("fake", rank=0,
   world_size=1024)`, `build_device_mesh(layout, "cpu")`, the `{PRESET}` Transformer ({full:,}
   parameters) under `torch.device("meta")`, for tp > 1 `apply_tensor_parallel(model, mesh)` (the
   reference plan, sequence parallel on), optionally `apply_ac(model, "full")`, then
   `apply_fsdp2(model, mesh, mp_policy=default_mp_policy())`, each timed. Peak RSS is `ru_maxrss`
   (in brackets: right after the imports). Nothing is materialized (all parameters are meta
   DTensors). FSDP2 chunks dim 0 rounded up, so rank 0 holds a bit more than full / world; under
   TP the embedding and the norms are replicated across the tp ranks (FSDP2 shards them over
   dp_shard only), so full / per rank is below the world size.

## Results

{chr(10).join(cli_rows)}

{chr(10).join(plan_rows)}

## Machine

{fact_lines}

## Reading it

{reading}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="forge build repetitions")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "build.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(_plan_child(spec["parallelism"], spec["ac_mode"])))
        return
    load_start = os.getloadavg()
    print(f"forge build x {args.reps} ...", flush=True)
    cli = bench_cli(args.reps)
    plans = []
    for label, parallelism, ac_mode in LAYOUTS:
        print(f"planning: {label} ...", flush=True)
        plans.append((label, bench_plan(parallelism, ac_mode)))
    page = render(cli, plans, machine_facts(plans[0][1]["torch"], load_start))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print()
    print(page.split("## Results\n\n", 1)[1].split("\n## Machine", 1)[0])
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()

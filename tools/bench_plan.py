"""Benchmark ``forge plan`` (``forge.plan.plan_layout``) from 64 to 16,384 ranks; write
``benchmarks/plan.md``.

Run from anywhere: ``uv run python tools/bench_plan.py`` (about 3 minutes on 2 CPU cores;
``--quick`` for a smoke run that writes nothing). Question: how long does planning a layout for
N ranks take in one CPU process (fake process group, meta tensors), and where does the time go?

One fresh interpreter per layout (so its first call pays the one-off imports, reported as
"cold"), then per world size ``--reps`` calls (median and min; 1 call at 16,384 ranks, where the
pure-FSDP2 layout takes about a minute). Each call builds the mesh and the parallel model as
rank 0, then does every rank's arithmetic. Layouts (one sequence of 4,096 tokens per rank,
bfloat16 compute):

- ``llama3_8b`` FSDP2 over all N ranks
- ``llama3_8b`` HSDP 8 x N/64 x TP 8 with sequence parallelism
- an MoE (preset ``small`` with 64 experts in every block, top-2, one shared expert,
  max_seq_len 4096) with EP 8 carved from FSDP2's dp_shard = N
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine_facts  # noqa: E402 - tools/ sibling module

ROOT = Path(__file__).resolve().parent.parent
OUT_MD = ROOT / "benchmarks" / "plan.md"
SIZES = (64, 512, 4096, 16384)
MOE = [
    "model.preset=small",
    "moe.moe_every=1",
    "moe.num_experts=64",
    "moe.top_k=2",
    "moe.moe_ffn_dim=512",
    "moe.num_shared_experts=1",
    "model.max_seq_len=4096",
    "parallelism.ep=8",
]
#: label -> (overrides, tp degree)
LAYOUTS: dict[str, tuple[list[str], int]] = {
    "llama3_8b FSDP2 dp_shard=N": (["model.preset=llama3_8b", "parallelism.tp=1"], 1),
    "llama3_8b HSDP 8 x N/64 x TP 8 + SP": (
        ["model.preset=llama3_8b", "parallelism.tp=8", "parallelism.dp_replicate=8"],
        8,
    ),
    "MoE 64 experts, EP 8 in dp_shard=N": ([*MOE, "parallelism.tp=1"], 1),
}


def _overrides(base: list[str], tp: int, world: int) -> list[str]:
    batch = f"training.global_batch_size={world // tp}"
    return [*base, batch, "training.seq_len=4096", "training.param_dtype=bfloat16"]


def _child(label: str, sizes: list[int], reps: int) -> dict[str, Any]:
    """Runs in a fresh interpreter: time plan_layout for one layout at every size."""
    from forge import load_config
    from forge.plan import plan_layout

    base, tp = LAYOUTS[label]
    out: dict[str, Any] = {"sizes": {}}
    t = time.perf_counter()
    plan_layout(load_config(None, _overrides(base, tp, sizes[0])), sizes[0])
    out["cold_s"] = time.perf_counter() - t
    for world in sizes:
        cfg = load_config(None, _overrides(base, tp, world))
        runs = []
        for _ in range(1 if world > 4096 else reps):
            plan = plan_layout(cfg, world)
            if not plan.ok or not plan.all_meta:
                raise SystemExit(f"{label} at {world}: {plan.broken_rules} meta={plan.all_meta}")
            runs.append((plan.elapsed_s, dict(plan.timings)))
        totals = [r[0] for r in runs]
        parts = {k: statistics.median(r[1][k] for r in runs) for k in runs[0][1]}
        static = plan.param_bytes[0] + plan.grad_bytes[0] + plan.optim_bytes[0]
        out["sizes"][world] = {
            "median": statistics.median(totals),
            "min": min(totals),
            "runs": len(totals),
            "parts": parts,
            "rows": len(set(zip(plan.param_bytes, plan.padded_param_bytes, strict=True))),
            "static0": static,
            "act": plan.activation.none,
            "act_full": plan.activation.full,
        }
        if world == 4096:
            out["text"] = plan.text()
        print(f"  {label} N={world}: {statistics.median(totals):.2f} s", file=sys.stderr)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="64 and 512 ranks, no file written")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = list(SIZES[:2] if args.quick else SIZES)
    if args.child:
        print(json.dumps(_child(args.child, sizes, args.reps)))
        return
    facts, load_start = machine_facts(packages=()), os.getloadavg()
    results = {}
    for label in LAYOUTS:
        cmd = [sys.executable, __file__, "--child", label, "--reps", str(args.reps)]
        proc = subprocess.run(
            cmd + (["--quick"] if args.quick else []), capture_output=True, text=True
        )
        if proc.returncode != 0:
            sys.exit(f"{label} failed:\n{proc.stderr[-3000:]}")
        results[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [
        "| layout | ranks | plan s (median) | min | runs | mesh s | model s | per-rank s "
        "| distinct rank rows | rank 0 params+grads+AdamW | act / AC full per micro-batch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        for world, s in r["sizes"].items():
            p = s["parts"]
            lines.append(
                f"| {label} | {int(world):,} | {s['median']:.2f} | {s['min']:.2f} | {s['runs']} "
                f"| {p['mesh']:.2f} | {p['model']:.2f} | {p['per-rank arithmetic']:.3f} "
                f"| {s['rows']} | {_gib(s['static0'])} | {_gib(s['act'])} / {_gib(s['act_full'])} |"
            )
    extra = [
        f"| {label} | cold first call at {sizes[0]} ranks: {r['cold_s']:.2f} s; peak RSS "
        f"{r['peak_rss_mib']:.0f} MiB |"
        for label, r in results.items()
    ]
    table = "\n".join(lines)
    print(table)
    print("\n".join(extra))
    if args.quick:
        return
    facts["load average at end (1/5/15 min)"] = "/".join(f"{x:.1f}" for x in os.getloadavg())
    facts["load average at start (1/5/15 min)"] = "/".join(f"{x:.1f}" for x in load_start)
    facts["method"] = (
        f"one interpreter per layout; medians of {args.reps} calls after a cold call (1 call at "
        "16,384 ranks); `plan_layout`'s own timer"
    )
    sample = results["llama3_8b HSDP 8 x N/64 x TP 8 + SP"]["text"]
    slowest4k = max(r["sizes"]["4096"]["median"] for r in results.values())
    every = [s for r in results.values() for s in r["sizes"].values()]
    arith = max(s["parts"]["per-rank arithmetic"] for s in every)
    OUT_MD.write_text(
        "# forge plan: planning a layout for thousands of ranks on one CPU\n\n"
        "Written by `uv run python tools/bench_plan.py`; rerun it to refresh this page.\n\n"
        "## Machine\n\n"
        + "\n".join(f"- {k}: {v}" for k, v in facts.items())
        + "\n\n## Question\n\n"
        "How long does `forge.plan.plan_layout` take for N ranks in one process (fake process "
        "group, meta tensors: nothing allocated), and where does the time go? It builds the mesh "
        "and the parallel model once, as rank 0 (`mesh`, `model`: TP, EP, FSDP2 applied on "
        "meta), then computes every rank's parameter, gradient, AdamW and activation bytes and "
        "the collectives (`per-rank`).\n\n## Results\n\n"
        + table
        + "\n\n| layout | one-off cost |\n|---|---|\n"
        + "\n".join(extra)
        + "\n\n## Reading it\n\n"
        f"At 4,096 ranks the slowest layout plans in {slowest4k:.1f} s (target: under 20 s). The "
        f"per-rank arithmetic for every rank costs at most {arith:.2f} s at any size: it is a "
        "handful of vectorized integer operations per group of identically sharded parameters. "
        "What grows is the model build, and there FSDP2 itself: `fully_shard` chunks every "
        "parameter into one piece per rank of its shard group even on meta, so a pure FSDP2 "
        "layout over N ranks costs O(N) per parameter (the 8B model's 291 parameters at 16,384 "
        "ranks take about a minute). TP and HSDP shrink the shard group (N/64 here) and with it "
        "the cost. 'distinct rank rows' counts the rows of the plan's table: ranks with the same "
        "bytes share one row, so 16,384 ranks print in a few lines. The padded FSDP2 allocation "
        "is the same on every rank of a shard group, while the unpadded shard of small tensors "
        "(norms, routers) is empty on the last ranks. The MoE's rank-0 static bytes stop "
        "shrinking from 64 ranks on: FSDP2 shards dim 0 only, and each EP rank's expert weights "
        "have 64/8 = 8 rows for N/8 shard ranks, so 8 of them hold one whole expert each and the "
        "others none (a layout to rethink, which is what the plan is for).\n\n"
        "Sample plan (llama3_8b, HSDP 8 x 64 x TP 8 + SP, 4,096 ranks):\n\n```\n"
        + sample
        + "\n```\n"
    )
    print(f"wrote {OUT_MD.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

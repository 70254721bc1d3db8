"""Benchmark ``forge plan --search`` (``forge.plan_search.search_layouts``); write
``benchmarks/plan_search.md``.

Run from anywhere: ``uv run python tools/bench_plan_search.py`` (about a minute on 2 CPU cores;
``--quick`` for a smoke run on the debug model that writes nothing). Question: how long does
ranking every candidate layout of Llama3-8B (seq 8192, bf16, AC full) on N ranks take in one
CPU process, against the issue's target of 20 s at 4,096 ranks, and which layout wins?

Each world size is searched ``--reps`` times (median and min; the first call also pays the
imports, which happen before the clock starts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine_facts, record_target  # noqa: E402 - tools/ sibling module

ROOT = Path(__file__).resolve().parent.parent
OUT_MD = ROOT / "benchmarks" / "plan_search.md"
LLAMA = [
    "model.preset=llama3_8b",
    "training.seq_len=8192",
    "training.param_dtype=bfloat16",
    "training.ac_mode=full",
]
TARGET_S = 20.0


def measure(overrides: list[str], worlds: tuple[int, ...], reps: int, gpu: str) -> list[dict]:
    """For each world size: the search's seconds per call, what it tried, and the best row."""
    from forge import load_config
    from forge.plan_predict import load_gpu
    from forge.plan_search import search_layouts

    profile = load_gpu(gpu)
    rows: list[dict[str, Any]] = []
    for world in worlds:
        cfg = load_config(None, [*overrides, f"training.global_batch_size={world}"])
        seconds = []
        for _ in range(reps):
            start = time.perf_counter()
            found, tried = search_layouts(cfg, world, profile)
            seconds.append(time.perf_counter() - start)
        best = next((r for r in found if r.fits), None)
        rows.append(
            {
                "world": world,
                "tried": tried,
                "fit": sum(r.fits for r in found),
                "median_s": statistics.median(seconds),
                "min_s": min(seconds),
                "best": best,
            }
        )
    return rows


def _degrees(layout: dict[str, Any]) -> str:
    names = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
    return " x ".join(f"{k} {layout[k]}" for k in names if layout[k] > 1) or "one rank"


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| ranks | layouts tried | fit | median s | min s | best layout | tok/s/GPU | MFU |",
        "|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        best = r["best"]
        cells = (
            [_degrees(best.layout), f"{best.tokens_per_second_per_gpu:,.0f}", f"{best.mfu:.1%}"]
            if best
            else ["none fits", "", ""]
        )
        lines.append(
            f"| {r['world']:,} | {r['tried']} | {r['fit']} | {r['median_s']:.1f} | "
            f"{r['min_s']:.1f} | " + " | ".join(cells) + " |"
        )
    return lines


def render(info: dict[str, str], rows: list[dict[str, Any]], reps: int, gpu: str) -> str:
    facts = "\n".join(f"- {k}: {v}" for k, v in info.items())
    at_4096 = next((r for r in rows if r["world"] == 4096), None)
    verdict = (
        f"At 4,096 ranks the search takes {at_4096['median_s']:.1f} s (median of {reps}): "
        + ("under" if at_4096["median_s"] <= TARGET_S else "OVER")
        + f" the {TARGET_S:.0f} s target."
        if at_4096
        else "4,096 ranks not measured."
    )
    return "\n".join(
        [
            "# forge plan --search: time to rank every layout",
            "",
            "Written by `uv run python tools/bench_plan_search.py` (one CPU process; each call "
            "plans every candidate at a data-parallel degree of at most 8 on the meta device and "
            "scales back, see docs/planning.md). Llama3-8B, seq 8192, bf16, AC full, one "
            f"sequence per rank, on `{gpu}`; {reps} calls per world size.",
            "",
            facts,
            "",
            *table(rows),
            "",
            verdict,
            "The predictions themselves are not yet checked against measured runs (issue 34).",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gpu", default="h100-sxm")
    parser.add_argument("--out", type=Path, default=OUT_MD)
    parser.add_argument("--quick", action="store_true", help="debug model, 16 ranks, no page")
    args = parser.parse_args(argv)
    if args.quick:
        rows = measure([], (16,), 1, args.gpu)
        print("\n".join(table(rows)))
        return 0
    info = machine_facts(("transformers",))
    rows = measure(LLAMA, (512, 4096), args.reps, args.gpu)
    print("\n".join(table(rows)))
    median = next(r["median_s"] for r in rows if r["world"] == 4096)
    record_target(
        "plan_search", f"<= {TARGET_S:.0f} s at 4,096 ranks", f"{median:.1f} s", median <= TARGET_S
    )
    args.out.write_text(render(info, rows, args.reps, args.gpu))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

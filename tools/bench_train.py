"""Benchmark ``forge train`` itself (the CLI, one rank) and write ``benchmarks/train.md``.

Run from anywhere: ``uv run python tools/bench_train.py`` (``--quick`` for a CPU smoke run of a
tiny model). Question: how many tokens per second and what MFU does a user get from
``forge train --device cuda --nproc 1`` on a ~1B dense model in bf16, eager and compiled? The
1B step in ``tools/bench_float8.py`` times forge's Transformer in one process; this one goes
through the whole CLI: config checks, the launcher, FSDP2 on one rank, the data loader, the
optimizer, gradient clipping, the LR schedule and the logging, exactly as a user runs it.

Each variant is one ``python -m forge.cli train`` subprocess writing ``metrics.jsonl`` to a
scratch folder (no checkpoint). The first ``--warmup`` steps (compilation, allocator growth) are
left out (the first H200 run, 12 steps with 4 left out, saw the compiled run still speeding up
at step 12: 40k tokens/s at step 3, 53k at step 10; hence 40 steps, 15 left out, which cost
seconds next to the compile); the page reports the median tokens/s and MFU of the rest (the MFU is the one forge
train logs: 6 x parameters + causal attention FLOPs per token against the GPU's dense bf16
datasheet peak) and the largest peak memory. The target (MFU >= 50% compiled, issue 30) is
reported through ``benchlib.record_target``; on a CPU it is n/a (no MFU without a GPU peak).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from benchlib import machine_facts, record_target  # tools/ sibling module

ROOT = Path(__file__).resolve().parent.parent
OUT_MD = ROOT / "benchmarks" / "train.md"

#: ~1.1B dense (the same model as bench_float8's step): dim 2048, 16 layers, ffn 8192, vocab 32k.
MODEL_1B = {
    "model.vocab_size": 32000,
    "model.dim": 2048,
    "model.n_layers": 16,
    "model.n_heads": 16,
    "model.n_kv_heads": 16,
    "model.ffn_dim": 8192,
    "model.max_seq_len": 2048,
}
MODEL_TINY = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.ffn_dim": 128}
MFU_TARGET = 0.50
#: Rows of each variant's operator table the page keeps (the log has the whole table).
PROFILE_ROWS = 15
#: The variants (``--variants``) and the ``--set`` values each adds. ``compiled-no-fsdp2``
#: (``parallelism.data=none``: autocast instead of FSDP2's mixed precision on the one rank)
#: tells what FSDP2 costs on one GPU, the first suspect of the gap to bench_float8's one-process
#: step (first H200 run: 35.8% against 52.6%); ``compiled-foreach-adamw`` the optimizer's
#: share (forge train's AdamW is fused on a GPU since the fourth lease measured it: 48.2k tokens/s
#: with torch's default, foreach, 55.3k fused).
VARIANTS: dict[str, dict[str, object]] = {
    "eager": {"training.compile": False},
    "compiled": {"training.compile": True},
    "compiled-no-fsdp2": {"training.compile": True, "parallelism.data": "none"},
    "compiled-foreach-adamw": {"training.compile": True, "training.optimizer_impl": "foreach"},
}
Results = dict[str, dict[str, float | None]]


def overrides(model: Mapping[str, object], *, seq: int, batch: int, steps: int, variant: str,
              out_dir: str, dtype: str, profile_step: int = 0) -> list[str]:  # fmt: skip
    """The ``--set`` arguments of one variant."""
    values: dict[str, object] = {
        "metrics.profile_step": profile_step,
        "model.preset": "debug",
        **model,
        "parallelism.tp": 1,
        "training.steps": steps,
        "training.seq_len": seq,
        "training.global_batch_size": batch,
        "training.param_dtype": dtype,
        "training.out_dir": out_dir,
        "checkpoint.save_at_end": False,
        **VARIANTS[variant],
    }
    out = []
    for key, value in values.items():
        text = json.dumps(value) if isinstance(value, str) else str(value).lower()
        out += ["--set", f"{key}={text}"]
    return out


def run_variant(device: str, sets: list[str], out_dir: Path, timeout_s: float) -> list[dict]:
    """One ``forge train`` run; its per-step metrics rows (raises with the CLI's output tail)."""
    argv = [sys.executable, "-m", "forge.cli", "train", "--device", device, "--nproc", "1", *sets]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    print(done.stdout[-2000:], done.stderr[-2000:], sep="\n", flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"forge train exited {done.returncode}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "throughput" in r]


def summarize(rows: list[dict], warmup: int) -> dict[str, float | None]:
    """Medians over the steps after ``warmup``, the profiled step left out (it runs slower)."""
    timed = [r for r in rows[warmup:] if not r.get("profiled")] or rows[-1:]
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {
        "steps timed": len(timed),
        "tokens/s": statistics.median(r["throughput"] for r in timed),
        "mfu": statistics.median(mfus) if mfus else None,
        "peak GiB": max(max(r["peak_mem_bytes"]) for r in rows) / 2**30,
        "last loss": rows[-1]["loss"],
    }


def profile_rows(out_dir: Path, step: int, rows: int = PROFILE_ROWS) -> list[str]:
    """The head of rank 0's operator table of the profiled step (by device time on a GPU, else
    by CPU time), as ``metrics.profile_step`` wrote it; the whole file goes to stdout."""
    path = out_dir / "profile" / f"step-{step}-rank-0.txt"
    if not path.is_file():
        return [f"(no profile: {path.name} was not written)"]
    text = path.read_text()
    print(text, flush=True)
    table = text.split("## by ", 2)[1].splitlines()[2:]  # the first table: device, else CPU
    return [line for line in table if line.strip()][: rows + 3]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model on the CPU (a smoke run)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--out", type=Path, default=OUT_MD)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--profile-step",
        type=int,
        default=-1,
        help="the step each variant runs under torch.profiler (metrics.profile_step; left out "
        "of the medians); default: the last step; 0: none",
    )
    args = p.parse_args()
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    gpu = torch.cuda.is_available() and not args.quick
    device = "cuda" if gpu else "cpu"
    model, seq, batch, dtype = (
        (MODEL_1B, 2048, 4, "bfloat16") if gpu else (MODEL_TINY, 64, 4, "float32")
    )
    steps = args.steps if gpu else min(args.steps, 4)
    warmup = args.warmup if gpu else 1
    profiled = steps if args.profile_step < 0 else min(args.profile_step, steps)
    started = time.perf_counter()
    results: Results = {}
    profiles: dict[str, list[str]] = {}
    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory(prefix="bench_train-") as scratch:
            sets = overrides(model, seq=seq, batch=batch, steps=steps, variant=variant,
                             out_dir=scratch, dtype=dtype, profile_step=profiled)  # fmt: skip
            results[variant] = summarize(run_variant(device, sets, Path(scratch), 420), warmup)
            if profiled:
                profiles[variant] = profile_rows(Path(scratch), profiled)
    lines = page(results, device, model, seq, batch, dtype, steps, warmup, args.quick)
    for variant, rows in profiles.items():
        lines += ["", f"Step {profiled} of `{variant}` under torch.profiler, rank 0 "
                  "(`metrics.profile_step`; the first rows):", "", "```", *rows, "```"]  # fmt: skip
    lines.append(f"wall time {time.perf_counter() - started:.0f} s")
    print("\n".join(lines))
    best = results.get("compiled", {}).get("mfu")
    measured = "n/a on CPU" if best is None else f"{best:.1%} (compiled)"
    met = None if best is None else best >= MFU_TARGET
    record_target("bench_train", f"forge train bf16 ~1B MFU >= {MFU_TARGET:.0%}", measured, met)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 0


def page(
    results: Results, device: str, model: Mapping[str, object], seq: int, batch: int,
    dtype: str, steps: int, warmup: int, quick: bool,
) -> list[str]:  # fmt: skip
    """The markdown page of one run."""
    facts = machine_facts()
    described = ", ".join(f"{k.removeprefix('model.')}={v}" for k, v in model.items())
    lines = [
        "# forge train (the CLI, one rank)",
        "",
        f"Run: `uv run python tools/bench_train.py{' --quick' if quick else ''}`"
        f" on {device}; " + ", ".join(f"{k}: {v}" for k, v in facts.items()) + ".",
        "",
        f"Model: {described}; "
        f"seq {seq}, global batch {batch}, param_dtype {dtype}, {steps} steps, the first "
        f"{warmup} left out; AdamW, grad clipping, no checkpoint.",
        "",
        "| variant | steps timed | tokens/s (median) | MFU (median) | peak memory GiB | last loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {name} | {r['steps timed']} | {r['tokens/s']:,.0f} | {mfu} | "
            f"{r['peak GiB']:.2f} | {r['last loss']:.4f} |"
        )
    return lines


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

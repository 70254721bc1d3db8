"""Time every launch configuration of forge's Triton grouped GEMM, the autotuner's candidates and
experiments outside its lists, one by one, and write ``benchmarks/grouped_gemm_sweep.md``.

Run from the repo root on a GPU: ``uv run python tools/sweep_grouped_gemm.py`` (about a minute
on an H200: a compile of each config per shape, then ``--reps`` CUDA-event timings;
``--quick``: the Qwen3-like shape alone, 3 timings). Without a GPU (or with ``--dry-run``) it
runs every config once under the Triton interpreter at a toy shape and checks its output: the
plumbing, not the speed.

Why: the autotuner keeps one config per shape and says nothing of the others, and a new kind of
config (``warp_specialize``: Triton splits the K loop into loading and math warps) must be timed
on a GPU before it may join the autotuner's lists. Each config is launched explicitly
(``gmm_rows(config=...)``, ``gmm_ragged_k(config=...)``), its output compared with
``torch._grouped_mm``'s (a config that fails to compile or computes wrong is a row with its
error, not a crash), then timed against ``torch._grouped_mm`` on the same tensors.
The passes: ``fwd`` (``x @ w[e]``), ``dX`` (``g @ w[e].T``), ``dW`` (``x[rows_e].T @ g[rows_e]``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from bench_grouped_gemm import routing_offs  # tools/ sibling modules
from benchlib import machine_facts, once_ms

ROOT = Path(__file__).resolve().parent.parent
OUT_MD = ROOT / "benchmarks" / "grouped_gemm_sweep.md"
TOP_K = 8
#: name: (E, dim, ffn); the up projection (K = dim, N = ffn), where the gap is largest
MODELS = {"Qwen3-30B-A3B-like": (128, 2048, 768), "DeepSeek-V3-like": (256, 7168, 2048)}
TOY = (12, 64, 96)  # the dry run's (E, dim, ffn): top-8 of 12 experts, ragged groups
#: relative error that a bf16 product may reach against torch's (fp32 accumulation both)
TOLERANCE = 2e-2


def experiments() -> dict[str, list]:
    """The configs timed per kernel: the autotuner's 16-bit TMA candidates, then each of them
    warp-specialized (TMA loads are what Triton's Hopper warp specialization splits off)."""
    import dataclasses

    from forge_kernels.grouped_gemm import _tuning

    rows = list(_tuning.TMA_CONFIGS_16BIT)
    dw = list(dict.fromkeys(_tuning.DW_CONFIGS_16BIT + _tuning.TMA_DW_CONFIGS_16BIT))
    return {
        "rows": rows + [dataclasses.replace(c, warp_specialize=True) for c in rows],
        "ragged_k": dw + [dataclasses.replace(c, warp_specialize=True) for c in dw if c.tma],
    }


def _median_ms(fn: Callable[[], object], reps: int, on_gpu: bool) -> float:
    """Median CUDA-event milliseconds of ``fn`` (benchlib's timer); NaN on CPU (a dry run)."""
    if not on_gpu:
        fn()
        return float("nan")
    return statistics.median(once_ms(fn, torch.device("cuda")) for _ in range(reps))


def _passes(x, w, g, offs) -> dict[str, tuple[str, Callable, Callable]]:  # noqa: ANN001
    """pass -> (kernel, forge's launch with a config, torch._grouped_mm's reference)."""
    from forge_kernels.grouped_gemm import _triton as kern

    wt = w.transpose(1, 2)
    return {
        "fwd": ("rows", lambda c: kern.gmm_rows(x, w, offs, config=c), lambda: _gmm(x, w, offs)),
        "dX": ("rows", lambda c: kern.gmm_rows(g, wt, offs, config=c), lambda: _gmm(g, wt, offs)),
        "dW": (
            "ragged_k",
            lambda c: kern.gmm_ragged_k(x, g, offs, config=c),
            lambda: _gmm(x.t(), g, offs),
        ),
    }


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if a.is_cuda:
        return torch._grouped_mm(a, b, offs=offs)
    # NOTE: the dry run's reference on CPU: a per-group loop in float64
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:  # rows: a[rows_e] @ b[e]
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
        for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
            out[s:t] = a[s:t].double() @ b[e].double()
        return out
    out = torch.zeros(len(ends), a.shape[0], b.shape[1], dtype=torch.float64)  # a is x.T
    for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
        out[e] = a[:, s:t].double() @ b[s:t].double()
    return out


def _error(got: torch.Tensor, ref: torch.Tensor, offs: torch.Tensor) -> float:
    rows = int(offs[-1]) if got.dim() == 2 else None  # rows past offs[-1]: torch leaves them
    got, ref = (got[:rows], ref[:rows]) if rows is not None else (got, ref)
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def sweep(
    models: dict[str, tuple[int, int, int]],
    tokens: int,
    reps: int,
    on_gpu: bool,
    passes: tuple[str, ...] = ("fwd", "dX", "dW"),
) -> list:
    """One row per (model, pass, config), plus torch._grouped_mm's row per (model, pass)."""
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    configs = experiments()
    rows: list[dict] = []
    for model, (experts, dim, ffn) in models.items():
        gen = torch.Generator().manual_seed(1)
        m = tokens * TOP_K
        x = torch.randn(m, dim, generator=gen).to(device, dtype)
        w = (torch.randn(experts, dim, ffn, generator=gen) / dim**0.5).to(device, dtype)
        g = torch.randn(m, ffn, generator=gen).to(device, dtype)
        offs = routing_offs(tokens, experts, device)[0]  # bench_grouped_gemm's balanced routing
        for name, (kernel, launch, reference) in _passes(x, w, g, offs).items():
            if name not in passes:
                continue
            ref = reference()
            flops = 2.0 * m * dim * ffn
            base = {"model": model, "pass": name, "M": m, "K": dim, "N": ffn}
            ms = _median_ms(reference, reps, on_gpu) if on_gpu else float("nan")
            rows.append({**base, "config": "torch._grouped_mm", "ms": ms, "flops": flops})
            for cfg in configs[kernel]:
                row = {**base, "config": _label(cfg), "flops": flops}
                try:
                    row["error"] = _error(launch(cfg), ref, offs)
                    if row["error"] > TOLERANCE:
                        raise AssertionError(f"relative error {row['error']:.2e} > {TOLERANCE}")
                    row["ms"] = _median_ms(lambda c=cfg, run=launch: run(c), reps, on_gpu)
                except Exception as err:  # noqa: BLE001 - a failing config is a row, not a crash
                    row["failed"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                rows.append(row)
                print("swept", _line(row), flush=True)  # NOTE: a timeout keeps these
    return rows


def _label(cfg) -> str:  # noqa: ANN001 - a GemmConfig
    """``128x256x64 w8 s3`` and the flags a config sets (``tma``, ``persistent``, ``ws``)."""
    flags = [("tma", cfg.tma), ("persistent", cfg.persistent), ("ws", cfg.warp_specialize)]
    shape = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
    return " ".join([shape, *(name for name, on in flags if on)])


def _line(row: dict) -> str:
    head = f"| {row['model']} | {row['pass']} | {row['config']} |"
    if "failed" in row:
        return f"{head} failed: {row['failed']} | | |"
    if row["ms"] != row["ms"]:  # NaN: the dry run times nothing
        return f"{head} - | - | {row.get('error', 0.0):.1e} |"
    tflops = row["flops"] / (row["ms"] * 1e-3) / 1e12
    return f"{head} {row['ms']:.3f} | {tflops:.1f} | {row.get('error', 0.0):.1e} |"


def page(rows: list, on_gpu: bool, tokens: int, reps: int) -> list[str]:
    facts = machine_facts()
    lines = [
        "# Grouped GEMM: every launch configuration, one by one",
        "",
        f"Written by `uv run python tools/sweep_grouped_gemm.py` on "
        f"{'a GPU (bf16)' if on_gpu else 'CPU (dry run: interpreter, fp32, toy shape)'}; "
        + ", ".join(f"{k}: {v}" for k, v in facts.items())
        + f"; {datetime.date.today()}.",
        "",
        f"{tokens} tokens x top-{TOP_K}, mildly skewed routing; median of {reps} CUDA-event "
        "timings after a first call that compiles. Error: relative Frobenius error against "
        "torch._grouped_mm (CPU: a float64 loop).",
        "",
        "| model | pass | config | ms | TFLOP/s | rel. error |",
        "|---|---|---|---:|---:|---:|",
        *[_line(r) for r in rows],
    ]
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated: " + ",".join(MODELS)
    )
    p.add_argument("--dry-run", action="store_true", help="interpreter, toy shape, no timing")
    p.add_argument("--quick", action="store_true", help="GPU: one shape, 3 timings")
    p.add_argument("--out", type=Path, default=OUT_MD)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    on_gpu = torch.cuda.is_available() and not args.dry_run
    if not on_gpu:
        # NOTE: before forge_kernels' Triton module is first imported (sweep() imports it):
        # triton decides compiled or interpreted when the kernels are decorated.
        os.environ["TRITON_INTERPRET"] = "1"
    if args.quick:
        args.models, args.reps = "Qwen3-30B-A3B-like", 3
    unknown = sorted(set(args.models.split(",")) - set(MODELS))
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    models = {m: MODELS[m] for m in args.models.split(",")} if on_gpu else {"toy": TOY}
    tokens, reps = (args.tokens, args.reps) if on_gpu else (16, 1)
    # NOTE: a quick dry run leaves out dX: it runs the forward's kernel, only transposed
    passes = ("fwd", "dW") if args.quick and not on_gpu else ("fwd", "dX", "dW")
    with contextlib.ExitStack() as stack:
        if not on_gpu:  # triton 3.6's interpreter under numpy >= 2.4 (forge_kernels.interpreter)
            from forge_kernels.interpreter import interpreter_index_fix

            stack.enter_context(interpreter_index_fix())
        rows = sweep(models, tokens, reps, on_gpu, passes)
    lines = page(rows, on_gpu, tokens, reps)
    print("\n".join(lines))
    failed = [r for r in rows if "failed" in r]
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    # NOTE: on a GPU a config that fails is a finding (the page records it); on CPU every config
    # must run, since the interpreter ignores what only a GPU compile can refuse.
    return 1 if failed and not on_gpu else 0


if __name__ == "__main__":
    sys.exit(main())

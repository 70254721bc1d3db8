"""Benchmark forge's grouped GEMM and write ``benchmarks/grouped_gemm.md``.

Run from the repo root: ``uv run python tools/bench_grouped_gemm.py`` (GPU: ~10 minutes on an
H100 with autotuning; CPU: ~2 minutes on 2 cores).

- On a GPU (bf16): TFLOP/s of forge's Triton kernels vs raw ``torch._grouped_mm`` vs one dense
  cuBLAS matmul of the same FLOPs, forward (``x @ w[e]``) and backward (dX + dW), for the expert
  up (K = dim, N = ffn) and down (K = ffn, N = dim) projections of a Qwen3-30B-A3B-like
  (E=128, top-8, dim 2048, ffn 768) and a DeepSeek-V3-like (E=256, top-8, dim 7168, ffn 2048)
  MoE, at 4k-32k tokens. Medians over ``--reps`` timings with CUDA events, after warm-up (which
  includes autotuning).
- Without a GPU (fp32): the same models with dim and ffn scaled down 8x / 16x (E and top-8 kept,
  so the routing raggedness is the real one) and 512-2048 tokens: ``torch._grouped_mm`` vs
  forge's dispatcher (which is ``torch._grouped_mm`` plus the tail masks on CPU) vs the
  per-group reference loop vs one dense matmul; plus the Triton *interpreter* at a toy shape
  (a correctness run, not a performance number), and an ahead-of-time compile of every Triton
  config for sm90 (shared memory, registers, spills; no GPU needed).

Routing is random: every token picks 8 distinct experts, sampled with probabilities
``softmax(s * randn(E))``; ``--routing balanced`` (s = 0.5, a mild fixed skew, as a trained router
would give) and ``skewed`` (s = 2.0: a few experts take most rows, some get none), both by
default on a GPU.
Prints the tables and rewrites ``benchmarks/grouped_gemm.md`` (``--out`` elsewhere, ``--no-write``
to print only). ``--quick`` is a smoke run (one model, one token count, 3 reps, no sm90 compile
check: seconds on a GPU after autotuning, ~10 s on CPU). Each target is also reported through
``benchlib.record_target`` (``tools/gpu_check`` gathers them into its summary table).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOP_K = 8
# name: (E, dim, ffn)
MODELS: dict[str, tuple[int, int, int]] = {
    "Qwen3-30B-A3B-like": (128, 2048, 768),
    "DeepSeek-V3-like": (256, 7168, 2048),
}
CPU_SCALE = {"Qwen3-30B-A3B-like": 8, "DeepSeek-V3-like": 16}
GPU_TOKENS = (4096, 8192, 16384, 32768)
CPU_TOKENS = (512, 1024, 2048)
QUICK_MODEL = "Qwen3-30B-A3B-like"
# routing name: s in softmax(s * randn(E)), the experts' popularity
ROUTINGS = {"balanced": 0.5, "skewed": 2.0}
TARGETS = "Triton >= 1.0x torch._grouped_mm and >= 65% of the dense matmul (fwd and bwd)"


def routing_offs(tokens: int, experts: int, device: str, seed: int = 0, skew: float = 0.5):
    """int32 cumulative group ends for ``tokens`` x top-8 random routing (``skew``: the s of
    ``softmax(s * randn(E))``, the experts' popularity)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(skew * torch.randn(experts, generator=g), 0)
    choice = torch.multinomial(probs.expand(tokens, experts), TOP_K, generator=g)
    counts = torch.bincount(choice.flatten(), minlength=experts)
    return torch.cumsum(counts, 0).to(torch.int32).to(device), counts


def _time_ms_cuda(run: Callable[[Any], Any], setup: Callable[[], Any] | None) -> float:
    """Milliseconds of ``run(setup())`` between CUDA events (setup not timed)."""
    import torch

    arg = setup() if setup else None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(arg)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _time_ms_cpu(run: Callable[[Any], Any], setup: Callable[[], Any] | None) -> float:
    """Wall-clock milliseconds of ``run(setup())`` (setup not timed)."""
    arg = setup() if setup else None
    t = time.perf_counter()
    run(arg)
    return (time.perf_counter() - t) * 1e3


def _median_times(
    impls: dict[str, Impl], reps: int, warmup: int, on_gpu: bool
) -> dict[tuple[str, str], float]:
    """Median ms per (impl, pass). Repetitions are interleaved across implementations, so a
    load change on a shared machine hits all of them alike."""
    time_ms = _time_ms_cuda if on_gpu else _time_ms_cpu
    for fwd, bwd, setup in impls.values():
        for _ in range(warmup):  # includes autotuning on the GPU
            fwd(None)
            bwd(setup() if setup else None)
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(reps):
        for name, (fwd, bwd, setup) in impls.items():
            samples.setdefault((name, "fwd"), []).append(time_ms(fwd, None))
            samples.setdefault((name, "bwd"), []).append(time_ms(bwd, setup))
    return {key: statistics.median(v) for key, v in samples.items()}


# name -> (forward, backward, backward setup or None); backward(setup()) is what is timed.
Impl = tuple[Callable[[Any], Any], Callable[[Any], Any], Callable[[], Any] | None]


def _implementations(x, w, g, offs, on_gpu: bool) -> dict[str, Impl]:
    """The implementations timed at one shape (closures over its tensors)."""
    import torch
    from forge_kernels.grouped_gemm import grouped_gemm

    wd = w[0].contiguous()
    impls: dict[str, Impl] = {}
    if on_gpu:
        from forge_kernels.grouped_gemm import _triton as kern

        impls["triton"] = (
            lambda _: kern.gmm_rows(x, w, offs),
            lambda _: (kern.gmm_rows(g, w.transpose(1, 2), offs), kern.gmm_ragged_k(x, g, offs)),
            None,
        )
    impls["torch_grouped_mm"] = (
        lambda _: torch._grouped_mm(x, w, offs=offs),
        lambda _: (
            torch._grouped_mm(g, w.transpose(1, 2), offs=offs),
            torch._grouped_mm(x.t(), g, offs=offs),
        ),
        None,
    )
    impls["dense"] = (lambda _: x @ wd, lambda _: (g @ wd.t(), x.t() @ g), None)
    if not on_gpu:
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

        def through_autograd(backend: str) -> Impl:
            def fwd(_: Any) -> torch.Tensor:
                return grouped_gemm(xr, wr, offs, backend=backend)

            def bwd(out: torch.Tensor) -> Any:
                return torch.autograd.grad(out, (xr, wr), g)

            return fwd, bwd, lambda: fwd(None)

        impls["forge (cpu dispatch)"] = through_autograd("torch_grouped_mm")
        impls["reference loop"] = through_autograd("reference")
    return impls


def bench_shapes(
    on_gpu: bool,
    reps: int,
    tokens_list: tuple[int, ...],
    models: tuple[str, ...] = tuple(MODELS),
    routings: tuple[str, ...] = ("balanced",),
) -> list[dict[str, Any]]:
    """Time every (model, projection, tokens, routing) on the GPU or the CPU; one row per
    pass."""
    import torch

    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    unit, scale = ("TFLOP/s", 1.0) if on_gpu else ("GFLOP/s", 1e3)
    rows = []
    for model in models:
        experts, dim, ffn = MODELS[model]
        if not on_gpu:
            dim, ffn = dim // CPU_SCALE[model], ffn // CPU_SCALE[model]
        for proj, (k, n) in (("up", (dim, ffn)), ("down", (ffn, dim))):
            for tokens, routing in itertools.product(tokens_list, routings):
                offs, counts = routing_offs(tokens, experts, device, skew=ROUTINGS[routing])
                m = tokens * TOP_K
                x = torch.randn(m, k, device=device, dtype=dtype)
                w = torch.randn(experts, k, n, device=device, dtype=dtype) / k**0.5
                g = torch.randn(m, n, device=device, dtype=dtype)
                flops = 2.0 * m * k * n
                point = {"model": model, "proj": proj, "tokens": tokens, "routing": routing}
                point |= {"M": m, "K": k, "N": n, "largest_group": int(counts.max())}
                point["empty_groups"] = int((counts == 0).sum())
                summary = []
                impls = _implementations(x, w, g, offs, on_gpu)
                medians = _median_times(impls, reps, 3 if on_gpu else 1, on_gpu)
                for name in impls:
                    for pass_, f in (("fwd", flops), ("bwd", 2 * flops)):
                        t_ms = medians[(name, pass_)]
                        tflops = f / (t_ms * 1e-3) / 1e12
                        rows.append(
                            {**point, "impl": name, "pass": pass_, "ms": t_ms, "tflops": tflops}
                        )
                        summary.append(f"{name} {pass_} {tflops * scale:.1f}")
                print(
                    f"  {model} {proj} tokens={tokens} {routing} M={m} K={k} N={n}: "
                    + ", ".join(summary)
                    + f" {unit}",
                    flush=True,
                )
                del impls, x, w, g
                if on_gpu:
                    torch.cuda.empty_cache()
    return rows


def _interpreter_fix() -> Any:
    """forge_kernels.interpreter's fix for triton 3.6's interpreter under numpy >= 2.4 (triton
    issue #9171); a no-op where numpy is older."""
    from forge_kernels.interpreter import interpreter_index_fix

    return interpreter_index_fix()


def bench_interpreter_toy() -> dict[str, Any]:
    """Triton interpreter at a toy shape, checked against float64: correctness, not speed."""
    import torch
    from forge_kernels.grouped_gemm import grouped_gemm

    m, k, n, offs_list = 64, 48, 48, [10, 10, 33, 50]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).requires_grad_(True)
    w = torch.randn(len(offs_list), k, n, generator=gen).requires_grad_(True)
    offs = torch.tensor(offs_list, dtype=torch.int32)
    t = time.perf_counter()
    with _interpreter_fix():
        out = grouped_gemm(x, w, offs, backend="triton")
        out.backward(torch.ones_like(out))
    seconds = time.perf_counter() - t
    ref = torch.zeros(m, n, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs_list):
        ref[start:end] = x[start:end].double() @ w[e].double()
        start = end
    err = ((out.double() - ref).norm() / ref.norm()).item()
    return {"shape": f"M={m} K={k} N={n} E={len(offs_list)}", "seconds": seconds, "rel_err": err}


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile check for sm90 (no GPU needed)
# ---------------------------------------------------------------------------------------------


def _descriptor_types(rows: bool, cfg: Any, dtype: str, b_trans: bool) -> dict[str, str]:
    """Signature types of the kernels' tensor-descriptor arguments under ``cfg``."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if rows:
        b_block = [1, bn, bk] if b_trans else [1, bk, bn]
        blocks = {"a_desc": [bm, bk], "b_desc": b_block}
    else:
        blocks = {"a_desc": [bk, bm], "b_desc": [bk, bn]}
    return {name: f"tensordesc<{dtype}[{','.join(map(str, b))}]>" for name, b in blocks.items()}


def _compile_check_child() -> list[dict[str, Any]]:
    """Compile each autotune config for sm90 (runs with TRITON_INTERPRET unset)."""
    import inspect
    import tempfile

    import triton
    from forge_kernels.grouped_gemm import _triton as kern
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    new_api = "constexprs" in inspect.signature(ASTSource.__init__).parameters
    results = []
    rows, dw = kern._gmm_rows_kernel, kern._gmm_ragged_k_kernel
    rows16 = kern.candidates("rows", False, False) + kern.candidates("rows", False, True)
    plans = [
        ("rows (fwd)", rows, rows16, "*bf16", {"stride_bn": 1, "B_TRANS": False}),
        ("rows (dX)", rows, rows16[:1] + rows16[-1:], "*bf16", {"stride_bk": 1, "B_TRANS": True}),
        (
            "rows (fwd)",
            rows,
            kern.candidates("rows", True, False),
            "*fp32",
            {"stride_bn": 1, "B_TRANS": False},
        ),
        ("ragged_k (dW)", dw, kern.candidates("ragged_k", False, True), "*bf16", {}),
        ("ragged_k (dW)", dw, kern.candidates("ragged_k", True, False), "*fp32", {}),
    ]
    for label, fn, configs, ptr_type, layout in plans:
        for cfg in configs:
            consts: dict[str, Any] = {
                **cfg.meta(),
                "INPUT_PRECISION": "ieee" if ptr_type == "*fp32" else "tf32",
                "stride_ak": 1,
                "stride_cn": 1,
                **({"stride_bn": 1} if fn is dw else {}),
                **layout,
            }
            if fn is rows:
                consts["E_POW2"] = 256
            descs = _descriptor_types(fn is rows, cfg, ptr_type[1:], layout.get("B_TRANS", False))
            if not cfg.tma:
                consts.update(a_desc=None, b_desc=None)
            names = fn.arg_names
            sig = {
                a: "constexpr"
                if a in consts
                else descs[a]
                if a in descs
                else ("*i32" if a == "offs_ptr" else ptr_type)
                if a.endswith("_ptr")
                else "i32"
                for a in names
            }
            # what triton's launcher infers for 16-aligned pointers, strides, N and K
            div16 = [
                a
                for a in names
                if a not in consts
                and (a.endswith("_ptr") or a.startswith("stride") or a in ("N", "K"))
            ]
            if new_api:
                attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div16}
                src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
            else:
                from triton.backends.compiler import AttrsDescriptor

                attrs = AttrsDescriptor.from_hints({names.index(a): 16 for a in div16})
                src = ASTSource(fn, sig, constants=consts, attrs=attrs)
            row: dict[str, Any] = {"kernel": label, "dtype": ptr_type[1:], "config": cfg.__dict__}
            try:
                compiled = triton.compile(
                    src,
                    target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                )
            except Exception as exc:  # report, do not hide
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                results.append(row)
                continue
            ptx = compiled.asm["ptx"]
            row.update(
                smem=compiled.metadata.shared,
                wgmma="wgmma" in ptx,
                cp_async="cp.async" in ptx,
                tma="cp.async.bulk.tensor" in ptx,
            )
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                usage = subprocess.run(
                    [str(cuobjdump), "--dump-resource-usage", f.name],
                    capture_output=True,
                    text=True,
                ).stdout
            regs = re.search(r"REG:(\d+)", usage)
            local = re.search(r"LOCAL:(\d+)", usage)
            row["regs"] = int(regs.group(1)) if regs else None
            row["spill_bytes"] = int(local.group(1)) if local else None
            results.append(row)
    return results


def compile_check() -> tuple[list[dict[str, Any]], str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, __file__, "--compile-check-child"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return [], proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def machine_facts(on_gpu: bool) -> dict[str, str]:
    import torch

    facts: dict[str, str] = {}
    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        facts["GPU"] = (
            f"{props.name} ({props.multi_processor_count} SMs, sm{props.major}{props.minor})"
        )
        facts["CUDA (torch build)"] = str(torch.version.cuda)
    else:
        cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        facts["GPU"] = "none"
        facts["CPU"] = cpu.group(1).strip() if cpu else platform.processor() or "unknown"
        facts["cores"] = str(len(os.sched_getaffinity(0)))
        facts["torch threads"] = str(torch.get_num_threads())
        load = os.getloadavg()
        facts["load average (1/5/15 min, at the end)"] = " / ".join(f"{v:.1f}" for v in load)
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = "not installed"
    facts["torch"] = torch.__version__
    facts["Python"] = platform.python_version()
    facts["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return facts


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    """One table row: (model, proj, tokens, routing, pass)."""
    return (r["model"], r["proj"], r["tokens"], r.get("routing", "balanced"), r["pass"])


def _ratios(rows: list[dict[str, Any]], ours: str, other: str) -> list[float]:
    """tflops(ours) / tflops(other) at every (model, proj, tokens, pass)."""
    by_key: dict[tuple, dict[str, float]] = {}
    for r in rows:
        by_key.setdefault(_key(r), {})[r["impl"]] = r["tflops"]
    return [v[ours] / v[other] for v in by_key.values()]


def record_targets(rows: list[dict[str, Any]], on_gpu: bool) -> None:
    """The two targets through ``benchlib.record_target`` (met is None without a GPU)."""
    from benchlib import record_target  # tools/ sibling module

    ours = "triton" if on_gpu else "forge (cpu dispatch)"
    every = "every shape, fwd and bwd"
    for other, target, bound, show in (
        ("torch_grouped_mm", f"Triton >= 1.0x torch._grouped_mm ({every})", 1.0, "{:.2f}x"),
        ("dense", f"Triton >= 65% of the dense matmul ({every})", 0.65, "{:.0%}"),
    ):
        ratios = _ratios(rows, ours, other)
        span = f"{show.format(min(ratios))}-{show.format(max(ratios))}"
        if on_gpu:
            measured = f"{span} over {len(ratios)} points"
            record_target("bench_grouped_gemm", target, measured, min(ratios) >= bound)
        else:
            measured = f"no GPU; CPU fp32 {ours} / {other}: {span}"
            record_target("bench_grouped_gemm", target, measured, None)


def _table(rows: list[dict[str, Any]], on_gpu: bool) -> list[str]:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    unit, scale = ("TFLOP/s", 1.0) if on_gpu else ("GFLOP/s", 1e3)
    ours = "triton" if on_gpu else "forge (cpu dispatch)"
    head = (
        "| model | proj | tokens | routing | M | K | N | empty / largest expert | pass | "
        + " | ".join(f"{i} {unit}" for i in impls)
        + f" | {ours} / torch_grouped_mm | {ours} / dense |"
    )
    lines = [head, "|" + "---|" * 9 + "---:|" * (len(impls) + 2)]
    keys = list(dict.fromkeys(_key(r) for r in rows))
    for key in keys:
        sel = {r["impl"]: r for r in rows if _key(r) == key}
        any_row = next(iter(sel.values()))
        vals = " | ".join(f"{sel[i]['tflops'] * scale:.1f}" for i in impls)
        ratio_t = sel[ours]["tflops"] / sel["torch_grouped_mm"]["tflops"]
        ratio_d = sel[ours]["tflops"] / sel["dense"]["tflops"]
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {any_row['M']} | {any_row['K']} | "
            f"{any_row['N']} | {any_row['empty_groups']} / {any_row.get('largest_group', '')} | "
            f"{key[4]} | {vals} | "
            f"{ratio_t:.2f}x | {ratio_d:.0%} |"
        )
    return lines


def render(
    rows: list[dict[str, Any]],
    on_gpu: bool,
    facts: dict[str, str],
    toy: dict[str, Any] | None,
    compiled: list[dict[str, Any]],
    compile_error: str,
    reps: int,
    tokens: tuple[int, ...],
    picked: list[tuple[str, Any, Any]] = (),  # type: ignore[assignment]
) -> str:
    out = [
        "# Grouped GEMM benchmarks",
        "",
        "Written by `uv run python tools/bench_grouped_gemm.py`; rerun it to refresh this page.",
        "",
        "## Environment",
        "",
        *[f"- {k}: {v}" for k, v in facts.items()],
        "",
        f"Targets on H100/H200 (bf16): {TARGETS}.",
        "",
        "## What is measured",
        "",
        "- forge's Triton path (`forge_kernels/grouped_gemm/_triton.py`): fwd and dX share one "
        "kernel (`gmm_rows`, dX reads `w` transposed through strides), dW is `gmm_ragged_k` "
        "(reduction over each expert's rows). No host sync: the grid is "
        "`(M // BLOCK_M + E + 1) x N tiles`, each program finds its expert by a prefix sum over "
        "`offs` on the device; rows past `offs[-1]` are written as zeros.",
        "- Autotuned on the GPU over the Hopper configs in `forge_kernels/grouped_gemm/_tuning.py` "
        "(key: N, K, log2 rows per expert, layout; TMA candidates join when the operands allow "
        "tensor descriptors), so the first call per shape pays for tuning (done in the warm-up "
        "here); the configs picked are listed below the results.",
        "",
    ]
    if on_gpu:
        ratios_t = _ratios(rows, "triton", "torch_grouped_mm")
        ratios_d = _ratios(rows, "triton", "dense")
        out += [
            "## Results (GPU, bf16)",
            "",
            f"Median of {reps} CUDA-event timings, interleaved across implementations, after "
            "warm-up (autotuning happens in the warm-up). `triton` calls forge's kernels "
            "directly (fwd: `gmm_rows`; bwd: `gmm_rows` on `w.transpose(1, 2)` for dX + "
            "`gmm_ragged_k` for dW); `torch_grouped_mm` is raw `torch._grouped_mm` for the same "
            "three products; `dense` is one `[M, K] @ [K, N]` matmul (bwd: the dX and dW "
            "matmuls) of the same FLOPs. FLOPs count every routed row; bwd = 2x fwd.",
            "",
            f"Against the targets: Triton / torch._grouped_mm ranges {min(ratios_t):.2f}x to "
            f"{max(ratios_t):.2f}x (target >= 1.0x); Triton / dense {min(ratios_d):.0%} to "
            f"{max(ratios_d):.0%} (target >= 65%).",
            "",
            *_table(rows, on_gpu),
            "",
            "Configs the autotuner picked (kernel, tuning key, config):",
            "",
            *[f"- {kernel} {key}: {cfg}" for kernel, key, cfg in picked],
            "",
        ]
    else:
        torch_threads = facts.get("torch threads", "?")
        token_list = ", ".join(map(str, tokens))
        scales = ", ".join(f"{name} /{div}" for name, div in CPU_SCALE.items())
        out += [
            "## No GPU on this machine: what is missing",
            "",
            "**Every GPU number is missing**: the Triton kernels' TFLOP/s on H100/H200 at the "
            "Qwen3-30B-A3B-like and DeepSeek-V3-like shapes, the comparison with "
            "`torch._grouped_mm` and with dense cuBLAS, and so whether the targets are met. "
            "Run this script on a GPU machine to fill them in. What this machine can say is "
            "below: CPU throughput of the CPU paths at reduced shapes, a correctness run of the "
            "Triton interpreter, and the sm90 compile of every Triton config.",
            "",
            "## Results (CPU, fp32, reduced shapes; says nothing about GPU performance)",
            "",
            f"dim and ffn scaled down ({scales}; E and top-8 kept), tokens {token_list}. Median of "
            f"{reps} wall-clock timings with {torch_threads} torch thread(s), interleaved across "
            "implementations (the machine is shared: see the load average above). "
            "`torch_grouped_mm`: raw `torch._grouped_mm` (bwd: the dX and dW products); "
            "`forge (cpu dispatch)`: `grouped_gemm` on CPU, i.e. torch._grouped_mm plus the "
            "device-side tail masks, alignment checks and autograd (bwd: `autograd.grad` of its "
            "output); `reference loop`: per-expert matmuls (reads offs on the host); `dense`: "
            "one matmul of the same FLOPs.",
            "",
            *_table(rows, on_gpu),
            "",
        ]
    if toy is not None:
        out += [
            "## Triton interpreter (correctness run, NOT a performance number)",
            "",
            f"`TRITON_INTERPRET=1`, {toy['shape']}, fp32, forward + backward through "
            f"`grouped_gemm(..., backend='triton')`: {toy['seconds']:.2f} s wall (numpy "
            f"interpreter), relative error of the output vs float64 {toy['rel_err']:.1e}.",
            "",
        ]
    out += ["## Ahead-of-time compile for sm90 (Hopper), no GPU needed", ""]
    if compiled:
        out += [
            "Every autotune config compiled with the installed triton for `cuda:90` (ptxas "
            "included in the triton wheel), with the 16-byte divisibility the launcher infers "
            "for real shapes. `smem` is the pipelined shared-memory footprint (stages x tile), "
            "`spill` the local-memory bytes (0 = no register spills). fp32 uses "
            "`input_precision='ieee'` (no tensor cores; `fp32_precision='tf32'` opts in).",
            "",
            "| kernel | dtype | block m x n x k | warps | stages | persistent | smem | regs | "
            "spill | wgmma | cp.async | TMA |",
            "|---|---|---|---:|---:|---|---:|---:|---:|---|---|---|",
        ]
        for r in compiled:
            c = r["config"]
            shape = f"{c['block_m']}x{c['block_n']}x{c['block_k']}"
            if "error" in r:
                out.append(
                    f"| {r['kernel']} | {r['dtype']} | {shape} | | | | error: {r['error']} |"
                )
                continue
            out.append(
                f"| {r['kernel']} | {r['dtype']} | {shape} | {c['num_warps']} | "
                f"{c['num_stages']} | {c['persistent']} | {r['smem'] // 1024} KiB | {r['regs']} | "
                f"{r['spill_bytes']} | {r['wgmma']} | {r['cp_async']} | {r.get('tma', False)} |"
            )
        out.append("")
    else:
        out += [f"Compile check did not run: {compile_error}", ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None, help="timings per point (GPU 20, CPU 7)")
    parser.add_argument("--tokens", type=int, nargs="*", help="token counts to run")
    parser.add_argument(
        "--routing",
        nargs="*",
        choices=tuple(ROUTINGS),
        help="expert popularity (default: both on a GPU, balanced on CPU)",
    )
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch threads on a CPU-only machine (default 1: stable on a shared machine)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "grouped_gemm.md")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_MODEL} only, the smallest token count, 3 reps, no compile check",
    )
    parser.add_argument("--no-compile-check", action="store_true", help="skip the sm90 compile")
    parser.add_argument("--compile-check-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_check_child:
        print(json.dumps(_compile_check_child()))
        return

    import torch

    on_gpu = torch.cuda.is_available()
    reps = args.reps or (3 if args.quick else 20 if on_gpu else 7)
    tokens = tuple(args.tokens) if args.tokens else (GPU_TOKENS if on_gpu else CPU_TOKENS)
    if args.quick and not args.tokens:
        tokens = tokens[:1]
    models = (QUICK_MODEL,) if args.quick else tuple(MODELS)
    toy = None
    if not on_gpu:
        # NOTE: one thread by default. On a shared 2-core machine, 2-thread OpenMP pools made
        # the per-group loop of torch._grouped_mm 20x slower in the median than in the best run.
        torch.set_num_threads(args.cpu_threads)
        # set before forge_kernels' Triton module is first imported (triton reads it at jit time)
        os.environ["TRITON_INTERPRET"] = "1"
        print("Triton interpreter toy run (correctness only) ...", flush=True)
        toy = bench_interpreter_toy()
        print(f"  {toy}", flush=True)
    print(f"Timing on {'GPU' if on_gpu else 'CPU'} ...", flush=True)
    routings = (
        tuple(args.routing)
        if args.routing
        else (tuple(ROUTINGS) if on_gpu and not args.quick else ("balanced",))
    )
    rows = bench_shapes(on_gpu, reps, tokens, models, routings)
    compiled: list[dict[str, Any]] = []
    if args.quick or args.no_compile_check:
        compile_error = "skipped (--quick / --no-compile-check)"
    else:
        print("sm90 compile check ...", flush=True)
        compiled, compile_error = compile_check()
    picked = []
    if on_gpu:
        from forge_kernels.grouped_gemm import _triton as kern

        picked = kern.best_configs()
    text = render(
        rows, on_gpu, machine_facts(on_gpu), toy, compiled, compile_error, reps, tokens, picked
    )
    print()
    print(text)
    record_targets(rows, on_gpu)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        where = args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out
        print(f"\nwrote {where}")


if __name__ == "__main__":
    main()

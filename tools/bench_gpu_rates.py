"""The rates a step-time model needs, measured on this GPU: matmul and attention efficiency by
shape, memory bandwidth. Writes ``benchmarks/gpu_rates.md`` and ``benchmarks/gpu_rates.json``.

Run: ``python tools/bench_gpu_rates.py`` on a GPU (about 30 s on an H100/H200; ``--quick`` for a
few seconds; ``--out PAGE.md`` writes the page there and the JSON beside it). Without a GPU it prints that and writes
nothing: CPU rates would say nothing about a GPU.

What is timed (medians of CUDA-event timings after warm-up; fresh random inputs, never zeros):

- bf16 matmul ``x[M, K] @ w[K, N]`` over the shapes of transformer Linears (K, N from 1k to 16k,
  M = tokens from 1k to 16k): TFLOP/s and its fraction of the datasheet peak.
- Attention through ``torch.nn.functional.scaled_dot_product_attention`` (causal, bf16, head
  dim 128, GQA 4:1 expanded by the caller's own repeat as forge's model does), forward and
  forward+backward, at 2k-16k tokens: TFLOP/s counting the causal half only (the work done).
- Device-to-device copy of 4 GiB: bytes read + written per second.

The JSON holds every row with stable keys (``matmul``, ``attention``, ``copy_bytes_per_s``,
``device``, ``torch``) for a planner to read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from bench_float8 import peak_bf16_tflops  # noqa: E402
from benchlib import machine_facts  # noqa: E402 - tools/ sibling module

MATMUL_KN = (
    (2048, 2048),
    (2048, 8192),
    (8192, 2048),
    (4096, 4096),
    (4096, 14336),
    (14336, 4096),
    (7168, 2048),
    (2048, 7168),
    (8192, 8192),
    (16384, 16384),
)
MATMUL_M = (1024, 4096, 16384)
ATTN = ((2048, 32), (4096, 32), (8192, 16), (16384, 8))  # (seq, query heads), batch 1
HEAD_DIM = 128


def _median_ms(fn: Any, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def matmul_rows(reps: int, quick: bool) -> list[dict[str, Any]]:
    rows = []
    shapes = MATMUL_KN[:3] if quick else MATMUL_KN
    for m in MATMUL_M[1:2] if quick else MATMUL_M:
        for k, n in shapes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            ms = _median_ms(lambda x=x, w=w: x @ w, reps)
            rows.append({"M": m, "K": k, "N": n, "ms": ms, "tflops": 2 * m * k * n / ms / 1e9})
            del x, w
    return rows


def attention_rows(reps: int, quick: bool) -> list[dict[str, Any]]:
    rows = []
    for seq, heads in ATTN[:1] if quick else ATTN:
        shape = (1, heads, seq, HEAD_DIM)
        q, k, v = (
            torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

        def fwd(q=q, k=k, v=v) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd(q=q, k=k, v=v, grad=grad) -> None:
            torch.autograd.grad(fwd(q, k, v), (q, k, v), grad)

        # causal: half of the 4 * seq^2 * head_dim * heads FLOPs of QK^T and PV; backward 2.5x
        flops = 2.0 * seq * seq * HEAD_DIM * heads
        with torch.no_grad():
            ms_f = _median_ms(fwd, reps)
        ms_fb = _median_ms(fwd_bwd, reps)
        rows.append(
            {
                "seq": seq,
                "heads": heads,
                "head_dim": HEAD_DIM,
                "fwd_ms": ms_f,
                "fwd_tflops": flops / ms_f / 1e9,
                "fwd_bwd_ms": ms_fb,
                "fwd_bwd_tflops": 3.5 * flops / ms_fb / 1e9,
            }
        )
        del q, k, v, grad
    return rows


def copy_rate(reps: int) -> float:
    n = 2**31  # 4 GiB of bf16
    src = torch.randn(n // 2**10, 2**10, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), reps)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def render(data: dict[str, Any]) -> str:
    peak = data["peak_bf16_tflops"]

    def frac(t: float) -> str:
        return f"{t / peak:.0%}" if peak else "—"

    lines = [
        "# GPU rates for the step-time model",
        "",
        "Written by `tools/bench_gpu_rates.py`; medians of CUDA-event timings after warm-up.",
        "",
        *[f"- {k}: {v}" for k, v in data["machine"].items()],
        f"- datasheet bf16 peak used: {peak or 'unknown'} TFLOP/s",
        "",
        f"Device-to-device copy (4 GiB, read + write): "
        f"**{data['copy_bytes_per_s'] / 1e12:.2f} TB/s**",
        "",
        "## bf16 matmul x[M, K] @ w[K, N]",
        "",
        "| M | K | N | ms | TFLOP/s | of peak |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['M']} | {r['K']} | {r['N']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
        f"{frac(r['tflops'])} |"
        for r in data["matmul"]
    ]
    lines += [
        "",
        "## Causal attention (SDPA, bf16, head dim 128, batch 1)",
        "",
        "| seq | heads | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | of peak |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['seq']} | {r['heads']} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.0f} | "
        f"{r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_tflops']:.0f} | {frac(r['fwd_bwd_tflops'])} |"
        for r in data["attention"]
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="a few shapes, seconds")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "gpu_rates.md")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_rates: no GPU visible; nothing measured (CPU rates say nothing of a GPU)")
        return 0
    torch.manual_seed(0)
    data: dict[str, Any] = {
        "machine": machine_facts(("triton",)),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "peak_bf16_tflops": peak_bf16_tflops(),
    }
    data["copy_bytes_per_s"] = copy_rate(args.reps)
    data["matmul"] = matmul_rows(args.reps, args.quick)
    data["attention"] = attention_rows(args.reps, args.quick)
    text = render(data)
    print(text, flush=True)
    if not args.no_write:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

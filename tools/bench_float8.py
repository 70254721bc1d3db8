"""Benchmark a Float8 training step (forge_float8 recipes) against bf16; write ``benchmarks/float8.md``.

Run from anywhere: ``uv run python tools/bench_float8.py`` (about 2-3 minutes on 2 CPU cores;
``--quick`` for a ~20 s smoke run, ``--no-write`` to print only). Question: what does one
single-device training step (forward + backward + AdamW step) of the reference dense
Transformer cost in bf16 against ``forge_float8.apply_float8`` with the ``tensorwise``,
``rowwise`` and ``rowwise_with_gw_hp`` recipes, each eager and under ``torch.compile``
(``forge_fsdp_wrap.apply_compile``, per block, applied after ``apply_float8`` as forge's order
requires), and does the fp8 model train like the bf16 one (loss after a few steps, same seed and
data)? Target: tensorwise + compile >= 1.25x bf16 + compile on a GPU; the anchor is torchtitan's
Llama3-8B measurement, 8,532 vs 6,667 tokens/s/GPU (1.28x).

Precision: ``torch.autocast(bfloat16)`` over fp32 master weights everywhere (the bf16 baseline
and the Float8 variants alike; Float8 runs its GEMMs in E4M3/E5M2 with dynamic scales). On a GPU
(sm_89+): a ~1.1B-parameter config (dim 2048, 16 layers, ffn 8192, vocab 32000), batch 4 x 2048;
one variant at a time on a fresh model (freed afterwards) so each peak memory is its own. On CPU:
a reduced config (dim 256, 4 layers, ffn 1024, vocab 4096, batch 4 x 128) where the fp8 GEMMs run
through torch's CPU ``_scaled_mm``: the timings only show that each path runs (CPU fp8 is not
faster than bf16); all variants stay alive and are timed round-robin. Compile variants on CPU
cost an inductor compile each (tens of seconds); ``--no-compile`` skips them. ``--quick`` is a
smoke run (a small model, eager only, 3 timed steps, on either device); ``--out PATH`` writes the
page elsewhere. The target is also reported through ``benchlib.record_target``
(``tools/gpu_check`` gathers those into its summary table).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from benchlib import (  # noqa: E402 - tools/ sibling module
    machine_facts,
    record_target,
    sync,
    time_interleaved,
)
from forge_core import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parent.parent
OUT_MD = ROOT / "benchmarks" / "float8.md"
RECIPES: tuple[str | None, ...] = (None, "tensorwise", "rowwise", "rowwise_with_gw_hp")
TARGET = 1.25
ANCHOR = (
    "torchtitan, Llama3-8B: 8,532 (Float8 tensorwise + compile) vs 6,667 (bf16 + compile) "
    "tokens/s/GPU, 1.28x"
)
LR = 3e-4
# dense bf16 tensor-core peak, TFLOP/s, by a word in torch.cuda.get_device_name() (datasheets,
# SXM parts without sparsity); MFU is reported only for these
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "B200": 2250.0, "A100": 312.0}
MFU_TARGET = 0.50


@dataclass(frozen=True)
class Setup:
    """Model config, batch and step counts of one run."""

    name: str
    config: ModelConfig
    batch: int
    seq: int
    loss_steps: int
    reps: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def train_flops_per_token(self) -> float:
        """Model FLOPs of one training token (PaLM's count): 6 x the parameters that multiply
        (every Linear, the output head too; not the embedding lookup) plus 12 x layers x dim x
        seq for attention's two matmuls, forward and backward, causality not discounted."""
        with torch.device("meta"):
            model = Transformer(self.config)
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        return 6.0 * linear + 12.0 * self.config.n_layers * self.config.dim * self.seq


def peak_bf16_tflops() -> float | None:
    """The datasheet bf16 peak of this GPU, or None when it is not in PEAK_BF16_TFLOPS."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    if "PCIe" in name or "NVL" in name:  # other clocks and power: not the SXM figure
        return None
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def mfu(setup: Setup, ms: float | None) -> float | None:
    """Model FLOPs utilization of one step of ``ms`` milliseconds (None off the known GPUs)."""
    peak = peak_bf16_tflops()
    if peak is None or ms is None:
        return None
    return setup.train_flops_per_token() * setup.tokens / (ms * 1e-3) / (peak * 1e12)


def _cuda_setup(reps: int | None, quick: bool = False) -> Setup:
    if quick:
        # NOTE: big enough for the fp8 GEMMs to run on tensor cores, small enough for seconds.
        cfg = ModelConfig(
            vocab_size=8192, dim=1024, n_layers=2, n_heads=8, ffn_dim=4096, max_seq_len=1024
        )
        return Setup("smoke", cfg, 2, 1024, 3, reps or 3)
    cfg = ModelConfig(
        vocab_size=32000,
        dim=2048,
        n_layers=16,
        n_heads=16,
        n_kv_heads=8,
        ffn_dim=8192,
        max_seq_len=2048,
    )
    return Setup("~1B dense", cfg, 4, 2048, 8, reps or 20)


def _cpu_setup(reps: int | None, quick: bool) -> Setup:
    if quick:
        cfg = ModelConfig(
            vocab_size=1024, dim=128, n_layers=2, n_heads=2, ffn_dim=512, max_seq_len=64
        )
        return Setup("smoke", cfg, 2, 64, 3, reps or 3)
    cfg = ModelConfig(
        vocab_size=4096,
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=1024,
        max_seq_len=128,
    )
    return Setup("reduced", cfg, 4, 128, 6, reps or 7)


@dataclass
class Variant:
    """One (recipe, compile) combination and what was measured for it."""

    recipe: str | None
    compiled: bool
    error: str | None = None
    losses: list[float] = field(default_factory=list)
    ms: float | None = None
    min_ms: float | None = None
    peak_gib: float | None = None
    reserved_gib: float | None = None  # the caching allocator's peak reservation
    build_s: float | None = None
    converted: int | None = None

    @property
    def label(self) -> str:
        return f"{self.recipe or 'bf16'}{' + compile' if self.compiled else ''}"


# --------------------------------------------------------------------------- building and stepping
def _import_float8() -> Any:
    """``forge_float8``, adding the repository's package sources when it is not installed.

    NOTE: tools/gpu_check puts only some packages on PYTHONPATH; fall back to the checkout.
    """
    try:
        import forge_float8
    except ImportError:
        for src in sorted((ROOT / "packages").glob("*/src")):
            if str(src) not in sys.path:
                sys.path.append(str(src))
        import forge_float8
    return forge_float8


def build_model(setup: Setup, recipe: str | None, compiled: bool, device: torch.device) -> Any:
    """A fresh reference Transformer (seed 0, fp32 master weights), Float8 then compile."""
    with torch.device("meta"):
        model = Transformer(setup.config)
    model.to_empty(device=device)
    model.init_weights(0)
    if recipe is not None:
        f8 = _import_float8()
        # Single device, no FSDP2: no fp8 all-gather (rowwise recipes refuse it anyway).
        f8.apply_float8(model, recipe=recipe, enable_fsdp_float8_all_gather=False)
    if compiled:
        from forge_fsdp_wrap import apply_compile

        apply_compile(model, backend="inductor")
    return model


class TrainStep:
    """One training step: autocast(bf16) forward, fp32 cross-entropy, backward, AdamW step."""

    def __init__(self, model: Any, tokens: torch.Tensor, device: torch.device) -> None:
        self.model = model
        self.inputs, self.labels = tokens[:, :-1], tokens[:, 1:].reshape(-1)
        self.device_type = device.type
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=device.type == "cuda")

    def __call__(self) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            logits = self.model(self.inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), self.labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def _short_error(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]


def prepare(
    v: Variant, setup: Setup, tokens: torch.Tensor, device: torch.device
) -> TrainStep | None:
    """Build the variant and run its loss-recording steps (they also warm up / compile)."""
    t0 = time.perf_counter()
    try:
        model = build_model(setup, v.recipe, v.compiled, device)
        if v.recipe is not None:
            report = _import_float8().float8_report(model)
            v.converted = len(report.converted) if report is not None else None
        step = TrainStep(model, tokens, device)
        for _ in range(setup.loss_steps):
            v.losses.append(float(step()))
        sync(device)
    except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
        traceback.print_exc()
        v.error = _short_error(exc)
        return None
    v.build_s = time.perf_counter() - t0
    print(
        f"  {v.label}: ready in {v.build_s:.1f} s, losses "
        + " ".join(f"{x:.4f}" for x in v.losses),
        flush=True,
    )
    return step


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(setup: Setup, variants: list[Variant], device: torch.device) -> None:
    """Measure every variant in place (CPU: round-robin over all; CUDA: one at a time)."""
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(
        0, setup.config.vocab_size, (setup.batch, setup.seq + 1), generator=gen
    ).to(device)
    if device.type == "cuda":
        for v in variants:
            _free(device)
            torch.cuda.reset_peak_memory_stats()
            step = prepare(v, setup, tokens, device)
            if step is None:
                continue
            try:
                (v.ms, v.min_ms) = time_interleaved({v.label: step}, device, setup.reps)[v.label]
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                v.error = _short_error(exc)
            v.peak_gib = torch.cuda.max_memory_allocated() / 2**30
            v.reserved_gib = torch.cuda.max_memory_reserved() / 2**30
            print(
                f"  {v.label}: {v.ms} ms, peak {v.peak_gib:.1f} GiB allocated, "
                f"{v.reserved_gib:.1f} GiB reserved",
                flush=True,
            )
            del step
        _free(device)
        return
    steps: dict[str, TrainStep] = {}
    for v in variants:
        step = prepare(v, setup, tokens, device)
        if step is not None:
            steps[v.label] = step
    if steps:
        res = time_interleaved(dict(steps), device, setup.reps, warmup=1)
        for v in variants:
            if v.label in res:
                v.ms, v.min_ms = res[v.label]


# --------------------------------------------------------------------------- the page
def _f(v: float | None, spec: str, unit: str = "") -> str:
    return "—" if v is None else f"{format(v, spec)}{unit}"


def _baseline(variants: list[Variant], v: Variant) -> Variant | None:
    return next((b for b in variants if b.recipe is None and b.compiled == v.compiled), None)


def _speedup(variants: list[Variant], v: Variant) -> float | None:
    b = _baseline(variants, v)
    if b is None or b.ms is None or v.ms is None:
        return None
    return b.ms / v.ms


def _loss_diff(variants: list[Variant], v: Variant) -> float | None:
    """Largest relative loss difference against bf16 (same compile setting) over the steps."""
    b = _baseline(variants, v)
    if b is None or b is v or not b.losses or len(b.losses) != len(v.losses):
        return None
    return max(abs(x - y) / abs(y) for x, y in zip(v.losses, b.losses, strict=True))


def results_table(setup: Setup, variants: list[Variant], on_cuda: bool) -> list[str]:
    n = setup.loss_steps
    lines = [
        f"| variant | Linears in fp8 | step median (min) ms | tokens/s | MFU (bf16 peak) | "
        f"speedup vs bf16 (same compile) | peak memory allocated / reserved | loss step 1 -> step {n} | "
        "max rel. loss diff vs bf16 | build + first steps s |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for v in variants:
        if v.error is not None:
            lines.append(f"| {v.label} | {_f(v.converted, 'd')} | error: {v.error} ||||||||")
            continue
        tps = None if v.ms is None else setup.tokens / (v.ms / 1e3)
        losses = f"{v.losses[0]:.4f} -> {v.losses[-1]:.4f}" if v.losses else "—"
        conv = "0 (bf16)" if v.recipe is None else _f(v.converted, "d")
        mem = (
            f"{_f(v.peak_gib, '.1f')} / {_f(v.reserved_gib, '.1f')} GiB" if on_cuda else "n/a (CPU)"
        )
        lines.append(
            f"| {v.label} | {conv} | {_f(v.ms, '.1f')} ({_f(v.min_ms, '.1f')}) | "
            f"{_f(tps, ',.0f')} | {_f(mfu(setup, v.ms), '.1%')} | "
            f"{_f(_speedup(variants, v), '.2f', 'x')} | {mem} | {losses} | "
            f"{_f(_loss_diff(variants, v), '.1e')} | {_f(v.build_s, '.1f')} |"
        )
    return lines


def reading(
    setup: Setup,
    variants: list[Variant],
    on_cuda: bool,
    compile_skipped: bool,
    info: dict[str, str],
) -> list[str]:
    lines: list[str] = []
    errors = [v for v in variants if v.error is not None]
    if errors:
        lines.append("- **Errors**: " + "; ".join(f"{v.label}: {v.error}" for v in errors) + ".")
        if any(v.recipe == "rowwise_with_gw_hp" for v in errors) and not on_cuda:
            lines.append(
                "  The `rowwise_with_gw_hp` failure under CPU autocast is torchao's: "
                "`Float8Linear.forward` casts its input to the autocast dtype only when "
                "`torch.is_autocast_enabled()` (CUDA autocast) is true, so under "
                '`torch.autocast("cpu")` the saved input stays fp32 while the incoming gradient '
                "is bf16, and the high-precision weight-gradient `torch.mm` of this recipe "
                "rejects the mix (the other recipes cast both to fp8 first). It runs with bf16 "
                "parameters instead of autocast, and compiled (inductor promotes the mixed "
                "`mm`); CUDA autocast takes the cast. The same check means that under CPU "
                "autocast every Float8Linear sees fp32 inputs (cast straight to fp8), not bf16 "
                "ones as the bf16 baseline's Linears do."
            )
    tw = next((v for v in variants if v.recipe == "tensorwise" and v.compiled), None)
    ratio = _speedup(variants, tw) if tw is not None else None
    if on_cuda:
        verdict = (
            "unmeasured (a variant failed or was skipped)"
            if ratio is None
            else f"**{'met' if ratio >= TARGET else 'not met'}** ({ratio:.2f}x)"
        )
        lines.append(
            f"- Target, tensorwise + compile >= {TARGET}x bf16 + compile on this GPU: {verdict}. "
            f"Anchor: {ANCHOR}."
        )
    else:
        lines.append(
            f"- **No GPU in this session; the >= {TARGET}x target is unmeasured.** The anchor "
            f"it is set against: {ANCHOR}."
        )
        lines.append(
            "- CPU timings only show that each path runs end to end (convert, compile, forward, "
            "backward, optimizer step): the fp8 GEMMs go through torch's CPU `_scaled_mm`, which "
            "is not faster than bf16 GEMMs, and the per-step dynamic-scale casts (amax, scale, "
            "cast for input, weight and gradient) are extra work at these small shapes. Speedups "
            "below 1x here say nothing about a GPU."
        )
    if not on_cuda:
        lines.append(
            "- Noise: a shared 2-core machine (load average "
            f"{info.get('load average at start (1/5/15 min)', '?')} at the start, "
            f"{info.get('load average at end (1/5/15 min)', '?')} at the end); the variants run "
            "round-robin so load bursts hit them alike, but medians can move by 10-20% between "
            "runs."
        )
    if compile_skipped:
        lines.append(
            "- Compile variants were skipped (`--no-compile`/`--quick`); run without it to "
            "include them."
        )
    for compiled in (False, True):
        speeds = [
            f"{v.recipe} {s:.2f}x"
            for v in variants
            if v.compiled == compiled and v.recipe and (s := _speedup(variants, v)) is not None
        ]
        if speeds:
            lines.append(
                f"- Speed vs bf16 {'+ compile' if compiled else 'eager'} (bf16 time / variant "
                f"time, >1 is faster): {', '.join(speeds)}."
            )
    diffs = [(v.label, d) for v in variants if v.recipe and (d := _loss_diff(variants, v))]
    if diffs:
        worst = max(d for _, d in diffs)
        lines.append(
            f"- Training: over {setup.loss_steps} AdamW steps (lr {LR}) on one fixed random "
            f"batch from the same seed, the fp8 losses stay within {worst:.1e} (relative) of "
            "bf16's at every step ("
            + ", ".join(f"{n} {d:.1e}" for n, d in diffs)
            + "); a few steps of memorizing one batch are a smoke test of the numerics, not a "
            "convergence study."
        )
    if not on_cuda:
        first = [
            f"{v.label} {v.build_s:.0f} s" for v in variants if v.compiled and v.build_s is not None
        ]
        if first:
            lines.append(
                "- Inductor compile time on CPU (build + the first "
                f"{setup.loss_steps} steps): {', '.join(first)} (a warm inductor cache makes "
                "reruns faster)."
            )
    return lines


def record_targets(setup: Setup, variants: list[Variant], on_cuda: bool) -> None:
    """The targets through ``benchlib.record_target`` (met is None off a GPU or when
    unmeasured): the Float8 speedup, and the bf16 step's MFU."""
    best = min(
        (v for v in variants if v.recipe is None and v.ms is not None),
        key=lambda v: v.ms or 0.0,
        default=None,
    )
    best_mfu = None if best is None else mfu(setup, best.ms)
    mfu_target = f"bf16 training step MFU >= {MFU_TARGET:.0%} ({setup.name})"
    if best is None or best_mfu is None:
        why = "no GPU" if not on_cuda else "no bf16 timing or GPU peak unknown"
        record_target("bench_float8", mfu_target, f"unmeasured ({why})", None)
    else:
        record_target(
            "bench_float8", mfu_target, f"{best_mfu:.1%} ({best.label})", best_mfu >= MFU_TARGET
        )
    target = f"tensorwise + compile >= {TARGET}x bf16 + compile"
    tw = next((v for v in variants if v.recipe == "tensorwise" and v.compiled), None)
    ratio = _speedup(variants, tw) if tw is not None else None
    eager = next((v for v in variants if v.recipe == "tensorwise" and not v.compiled), None)
    eager_ratio = _speedup(variants, eager) if eager is not None else None
    eager_note = "" if eager_ratio is None else f"; eager tensorwise {eager_ratio:.2f}x"
    if ratio is None:
        why = "compile variants skipped" if tw is None else "a variant failed"
        measured, met = f"unmeasured ({why}){eager_note}", None
    else:
        measured, met = f"{ratio:.2f}x{eager_note}", ratio >= TARGET
    if not on_cuda:
        measured, met = f"no GPU; CPU: {measured}", None
    record_target("bench_float8", target, measured, met)


def write_markdown(
    setup: Setup,
    variants: list[Variant],
    info: dict[str, str],
    on_cuda: bool,
    compile_skipped: bool,
    write: bool,
    out_md: Path = OUT_MD,
) -> None:
    cfg = setup.config
    where = "GPU" if on_cuda else "CPU (reduced config)"
    lines = [
        "# Float8 training step: forge_float8 recipes vs bf16",
        "",
        "Written by `uv run python tools/bench_float8.py`; rerun it to refresh this page.",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in info.items()],
        "",
        "## Question",
        "",
        "What does one single-device training step (forward + backward + AdamW step) of forge's "
        "reference dense Transformer cost in bf16 against Float8 training "
        "(`forge_float8.apply_float8`, torchao `Float8Linear`) with the `tensorwise`, `rowwise` "
        "and `rowwise_with_gw_hp` recipes, each eager and compiled "
        "(`forge_fsdp_wrap.apply_compile`, per block, after `apply_float8`), and does the fp8 "
        "model train like the bf16 one?",
        "",
        f"Target: tensorwise + compile >= {TARGET}x bf16 + compile on a GPU. Anchor: {ANCHOR}.",
        "",
        f"Setup: `ModelConfig(vocab_size={cfg.vocab_size}, dim={cfg.dim}, "
        f"n_layers={cfg.n_layers}, n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}, "
        f"ffn_dim={cfg.ffn_dim})`, {cfg.num_params() / 1e6:,.1f}M parameters, dense "
        f"`forge_core.Transformer`, batch {setup.batch} x {setup.seq} = {setup.tokens} tokens, "
        "one fixed random batch (seed 1234), every model built fresh from `init_weights(0)`. "
        "Precision: fp32 master weights under `torch.autocast(bfloat16)` for every variant; "
        "fp32 cross-entropy; `torch.optim.AdamW` "
        f"(lr {LR}{', fused' if on_cuda else ''}). Float8: `enable_fsdp_float8_all_gather=False` "
        "(one device, no FSDP2), output head kept in high precision (forge's default), emulate "
        "off. Each variant first runs "
        f"{setup.loss_steps} recorded steps (the losses below; they also warm up and compile), "
        + (
            f"then {setup.reps} timed steps after 2 warm-up steps, one variant at a time on a "
            "fresh model (freed before the next), CUDA events; peak memory is "
            "`torch.cuda.max_memory_allocated` over the variant's whole run."
            if on_cuda
            else f"then all variants are timed round-robin, {setup.reps} rounds after 1 warm-up "
            "round, `time.perf_counter`; medians (min)."
        ),
        "",
        f"## Results on {where}",
        "",
        *results_table(setup, variants, on_cuda),
        "",
        "## Reading",
        "",
        *reading(setup, variants, on_cuda, compile_skipped, info),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if write:
        out_md.parent.mkdir(parents=True, exist_ok=True)
        out_md.write_text(text)
        print(f"wrote {out_md.relative_to(ROOT) if out_md.is_relative_to(ROOT) else out_md}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--reps", type=int, default=None, help="timed steps (default 7 CPU, 20 GPU)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small model, eager only, 3 timed steps (~20 s)"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the compile variants")
    parser.add_argument(
        "--recipes",
        nargs="*",
        choices=[r or "bf16" for r in RECIPES],
        default=[r or "bf16" for r in RECIPES],
        help="variants to run (bf16 is the baseline of every speedup)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--out", type=Path, default=OUT_MD, help="the page (markdown) to write")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on a CPU-only machine (default 1: stable on a shared machine)",
    )
    args = parser.parse_args(argv)
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    if not on_cuda:
        torch.set_num_threads(args.threads)
        # as forge train does on CPU: oneDNN's CPU fp8 GEMM is a slow reference kernel here
        _import_float8().use_torch_cpu_fp8_kernels()
    setup = _cuda_setup(args.reps, args.quick) if on_cuda else _cpu_setup(args.reps, args.quick)
    compile_skipped = args.no_compile or args.quick
    recipes = [r for r in RECIPES if (r or "bf16") in args.recipes]
    variants = [Variant(r, False) for r in recipes]
    if not compile_skipped:
        variants += [Variant(r, True) for r in recipes]
    info = machine_facts(("torchao", "triton"))
    print(
        f"{setup.name}: {setup.config.num_params() / 1e6:.1f}M params, "
        f"{setup.batch}x{setup.seq} tokens, {len(variants)} variants on {device}",
        flush=True,
    )
    t0 = time.perf_counter()
    run(setup, variants, device)
    info["load average at end (1/5/15 min)"] = "/".join(f"{x:.1f}" for x in os.getloadavg())
    info["total run time"] = f"{time.perf_counter() - t0:.0f} s"
    record_targets(setup, variants, on_cuda)
    write_markdown(
        setup, variants, info, on_cuda, compile_skipped, write=not args.no_write, out_md=args.out
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

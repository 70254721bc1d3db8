"""Context parallelism on CPU: per-rank activation memory and step time against cp=1; writes
``benchmarks/cp.md``.

Run: ``uv run python tools/bench_cp.py`` (2.5 minutes on a quiet 2-core machine, longer while
other processes load it; the 16k sequences take most of it), ``--quick`` (sequences of 256 and 512, cp 1 and 2, a tiny
model: seconds; what ``tests/tools/test_bench_cp.py`` runs), ``--no-write`` (print only),
``--out PATH``, ``--rounds N`` (timed steps per repeat), ``--repeats N``.

What runs: sequences of 4096, 8192 and 16384 tokens (batch 1; 65536 for memory only) through a
small fp32 reference ``Transformer`` at cp = 1 (the plain model), 2 and 4 (forge-cp on gloo
ranks, each ``[cp]`` variant: all-gather and heads), one
``forge_core.training.forward_backward`` step at a time; the page's Settings section
(``render_markdown``) says exactly what. How each number is taken, with the analytic account of
what a cp rank holds beyond ``(cp=1) / cp``, is written once, in ``METHOD`` below (the page
prints it); what the numbers do not say, in ``NOTES``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import gc
import importlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from benchlib import machine_busy_s, measure_on_rank_pools  # noqa: E402 - sibling module (tools/ is the script's folder)
from forge_core import ModelConfig
from forge_cp.checks import kv_head_copies

ROOT = Path(__file__).resolve().parent.parent
OUT_MD = ROOT / "benchmarks" / "cp.md"

RunOnRanks = Callable[..., list[Any]]

METHOD = [
    "- **measured**: the first step of every (seq, cp, repeat) runs `forward_backward` inside "
    "`torch.autograd.graph.saved_tensors_hooks`; every distinct storage autograd saves for "
    "backward counts once (key: its `data_ptr()`, bytes: its `untyped_storage().nbytes()`), "
    "the loss's log-softmax and the token ids included. Nothing saved is freed before backward "
    "starts, so the sum is what the rank holds for backward at the end of its forward. Left "
    "out: parameters and views of them (the weights `F.linear` saves; FSDP2's unsharded "
    "weights, freed after forward and gathered again for backward) and the model's buffers "
    "(cp=1's RoPE tables). The largest rank's bytes; every repeat gives the same bytes (checked).",
    "- **ideal** `(cp=1)/cp`: cp=1's bytes split evenly. What a cp rank holds beyond it is "
    "computed analytically (fp32, 4 bytes; `S` tokens, `L` blocks, `chunk = S / (2 cp)`):",
    "- **K/V excess**: every rank keeps the all-gathered K and V of every block for backward, "
    "`L x 2 x B x S x n_kv_heads x head_dim x 4` bytes (column *gathered K/V (all)*), which do "
    "not shrink with cp (`forge_cp/attention.py`); the ideal already holds 1/cp of them, the "
    "excess is the rest.",
    "- **masks**: CPU only (cp=1 passes `is_causal=True`: no mask). The kernel flips each query "
    "chunk, so its causal mask is constant along anti-diagonals and is a `(1, 1)`-strided view "
    "of one row of `chunk + end - 1` values, made once per chunk shape and shared by the blocks. "
    "A rank's two chunks attend to prefixes ending at `(r + 1) chunk` and `(2 cp - r) chunk`: "
    "`4 x ((2 cp + 3) chunk - 2)` bytes on every rank, linear in S. *masks measured*: the saved "
    "storages found in the kernel's mask cache.",
    '- **heads variant** (`[cp] variant = "heads"`): an all-to-all gives each rank every '
    "token of `1/cp` of the heads, attended with SDPA `is_causal=True` (no mask), and sends the "
    "output back. Its K/V held (`L x 2 x B x S x n_kv_heads x head_dim x 4 / cp`) is already "
    "in the ideal; the K/V excess is the copy each key/value head gets when there are fewer of "
    "them than cp ranks (e.g. 2 of them at cp=4: each goes to two ranks; the Settings give the model's); masks none; smaller "
    "as below (the output sent back is `wo`'s own copy).",
    "- **smaller**: the attention output saved twice per block (the two chunks' SDPA outputs, "
    "then their concatenation for `wo`: `L x B x S/cp x dim x 4`; cp=1's kernel writes its "
    "output in `wo`'s layout already) plus the rank's RoPE rows gathered by position "
    "(`2 x S/cp x head_dim x 4`, shared by the blocks; cp=1 reads slices of the buffers) plus "
    "the int64 token ids (cp=1's inputs and targets are views of one tensor, a rank's are two "
    "slices of their own). **predicted** = ideal + K/V excess + masks + smaller.",
    "- **peak RSS growth**: the process's peak resident set (`VmHWM`, reset through "
    "`/proc/self/clear_refs` before the step) during the last timed step, minus its resident set "
    "after building the model (after `gc.collect` and glibc's `malloc_trim`: a pool worker runs "
    "every seq in turn). It holds everything the step allocates (activations, masks, gradients, "
    "backward temporaries, gloo buffers) and misses what the allocator kept resident from before "
    "the baseline: it says roughly what a rank's process needs, the saved bytes say what context "
    'parallelism divides. "—" where `/proc` is unreadable.',
    "- **step time**: the memory step doubles as the warm-up (it also builds the masks and runs "
    "FSDP2's lazy init); each timed step starts after a barrier of the cp ranks and takes the "
    "slowest rank's time (`forward_backward` ends with an all-reduce of the loss). Seq by seq, "
    "cp 1, 2, 4 in turn (three pools, one world size each), the sweep repeated: load from "
    "elsewhere hits every degree alike. Each repeat's median, and their median. Tokens/s per "
    "rank = `B x S / cp` over the step time; speed-up = cp=1's step time over cp's.",
    "- **CPU ms per rank**: the busiest rank's `time.process_time` per step (gloo's threads "
    "included; not stretched by waiting for a core), against its ideal share, cp=1's / cp. "
    "**CPU share**: CPU time over wall time (1.0 = a core of its own). **Other processes**: the "
    "machine's busy CPU time during the step (`/proc/stat`, 10 ms ticks, read on rank 0) minus "
    "the ranks' own, in cores: the machine is shared, and this says how much of it others took.",
]

NOTES = [
    "- The masks are a CPU cost only, and a negligible one: on CUDA forge-cp passes "
    "`causal_lower_right` and the fused kernels build no mask. (The CPU kernel used to build a "
    "full `chunk x end` float mask per shape, `4 x chunk^2 x (2 cp + 1)` bytes per rank, "
    "quadratic in S: at seq 16384, cp=2 held 1.36 x cp=1's bytes.) Every term a rank saves is "
    "now linear in S, so its ratio to cp=1 hardly moves with the sequence.",
    "- The gathered K and V do not shrink with cp (forge-cp's all-gather design): with the "
    "attention output's second copy and the gathered RoPE rows they make up the remaining excess. "
    "With GQA (the Settings give the model's KV heads) they are a small part of a block's saved bytes; the share "
    "depends on `n_kv_heads x head_dim / dim` and on what else a block saves, not on model size.",
    "- Step time: 2 cores. cp=4 runs 4 single-thread ranks on them (CPU share at most about 0.5), "
    "so its times say nothing about 4 devices; cp=2's ranks share the cores with the machine's "
    "other processes (last column), which the single cp=1 process feels less. cp=1 runs one "
    "torch thread like every rank (same compute per core); with 2 it would be faster than shown.",
    "- CPU work per rank is above its ideal share: the CPU kernel computes the whole "
    "(chunk x end) score rectangles under the mask (only `is_causal` skips masked blocks), "
    "`(2 cp + 1) chunk^2` scores per rank against cp=1's `~2 cp^2 chunk^2`: `(2 cp + 1) / (2 cp)` "
    "times the ideal share of the attention work. Each rank also copies its queries and outputs "
    "for the flips, gathers the parameters (FSDP2) and exchanges K/V over gloo once per block "
    "forward and once backward. Checked apart (torch 2.15, one thread, forward + backward): a "
    "4096-token square under the flipped mask takes 1.04 x the maskless time and 1.8 x "
    "`is_causal`'s; 2048 queries over 8192 keys take 1.06 x the maskless time with the strided "
    "mask, 1.21 x with it made contiguous. On CUDA (`causal_lower_right`, masked blocks skipped) "
    "there is no such extra compute and the all-gathers run over NCCL; this script is CPU-only.",
]


@dataclasses.dataclass(frozen=True)
class Settings:
    """One benchmark configuration (model, sequences, cp degrees, timing rounds)."""

    seqs: tuple[int, ...]
    cps: tuple[int, ...]
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab: int = 512
    batch: int = 1
    rounds: int = 3
    repeats: int = 2
    #: [cp] variants run at each cp > 1 (cp=1 is the plain model)
    variants: tuple[str, ...] = ("allgather", "heads")
    #: sequences measured for memory only: one step, no timing, in the first repeat
    memory_seqs: tuple[int, ...] = ()

    def model_config(self, seq: int) -> ModelConfig:
        return ModelConfig.preset(
            "debug",
            vocab_size=self.vocab,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_dim=None,  # the Llama rule: 8/3 x dim rounded up to 64
            max_seq_len=seq,
        )


FULL = Settings((4096, 8192, 16384), (1, 2, 4), memory_seqs=(65536,))
QUICK = Settings((256, 512), (1, 2), dim=64, vocab=256, rounds=2, repeats=1)


# --------------------------------------------------------------------------- ranks
class SavedTensors:
    """A ``saved_tensors_hooks`` pack hook that sums the distinct storages autograd saves,
    less parameters and views of them (``t._base`` a ``Parameter``) and the model's buffers.

    Keys are storage addresses: a saved activation stays alive until backward, so no two live
    activations share one (FSDP2's freed unsharded weights may reuse theirs; never recorded).
    """

    def __init__(self, model: nn.Module) -> None:
        self.buffers = {b.untyped_storage().data_ptr() for b in model.buffers()}
        self.activations: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        weight = isinstance(t if t._base is None else t._base, nn.Parameter)
        if not weight and ptr not in self.buffers:
            self.activations[ptr] = max(nbytes, self.activations.get(ptr, 0))
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def _proc_kib(field: str) -> int | None:
    """A ``VmRSS``/``VmHWM`` line of ``/proc/self/status`` in KiB (None where unreadable)."""
    try:
        with open("/proc/self/status") as f:
            return next((int(ln.split()[1]) for ln in f if ln.startswith(field + ":")), None)
    except OSError:
        return None


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``; elsewhere a
    no-op), so that a pool worker's resident set stops counting what earlier runs freed."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _reset_peak_rss() -> bool:
    """Reset the process's peak resident set (Linux >= 4.0); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _mask_storages(model: nn.Module) -> set[int]:
    """Storage addresses of the masks forge-cp's CPU kernels hold.

    NOTE: reads ``ContextParallelAttention._masks`` (forge-cp's own private cache: the strided
    mask views) through the attention modules' installed kernel (``forge_core.contracts``'
    private attribute); without them the measured-mask column reads "—" and nothing else changes.
    """
    from forge_core import contracts

    found: set[int] = set()
    for module in model.modules():
        kernel = module.__dict__.get(getattr(contracts, "_KERNEL_ATTR", ""))
        for mask in getattr(kernel, "_masks", {}).values():
            if isinstance(mask, torch.Tensor):
                found.add(mask.untyped_storage().data_ptr())
    return found


def rank_run(
    settings: Settings, cp: int, seq: int, variant: str = "allgather", timed: bool = True
) -> dict[str, Any]:
    """On every rank of a ``cp``-rank pool (cp=1: the plain model): the memory step, then the
    timed steps (none unless ``timed``); returns this rank's numbers."""
    from forge.build import ParallelPlan
    from forge_core import Transformer
    from forge_core.training import forward_backward
    from forge_cp import CPConfig
    from forge_mesh import build_device_mesh

    torch.set_num_threads(1)
    cfg = settings.model_config(seq)
    with torch.device("meta"):
        meta_model = Transformer(cfg)
    mesh = build_device_mesh({"cp": cp}, "cpu") if cp > 1 else None
    plan = ParallelPlan(mesh, param_dtype=torch.float32, cp=CPConfig(variant=variant))
    model = plan.parallelize(meta_model, device="cpu", seed=0)
    group = mesh["cp"].get_group() if mesh is not None else None
    g = torch.Generator().manual_seed(seq)
    tokens = torch.randint(0, cfg.vocab_size, (settings.batch, seq + 1), generator=g)
    gc.collect()  # the previous run's model and masks (this worker ran other seqs before)
    _trim_heap()
    base_kib = _proc_kib("VmRSS")

    # The memory step (also the warm-up): what autograd saves during forward_backward.
    saved = SavedTensors(model)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        forward_backward(model, tokens, mesh=mesh)
    masks = _mask_storages(model)
    mask_bytes = sum(n for ptr, n in saved.activations.items() if ptr in masks)

    steps: list[dict[str, float | None]] = []
    peak_kib = None
    first_rank = not dist.is_initialized() or dist.get_rank() == 0
    for i in range(settings.rounds if timed else 0):
        model.zero_grad(set_to_none=True)
        last = i == settings.rounds - 1 and _reset_peak_rss()
        if group is not None:
            dist.barrier(group=group)
        m0 = machine_busy_s() if first_rank else None
        t0, c0 = time.perf_counter(), time.process_time()
        forward_backward(model, tokens, mesh=mesh)
        step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        m1 = machine_busy_s() if first_rank else None
        busy = None if m0 is None or m1 is None else m1 - m0
        steps.append({"step_s": step_s, "cpu_s": cpu_s, "machine_busy_s": busy})
        if last:
            peak_kib = _proc_kib("VmHWM")
    return {
        "activation_bytes": sum(saved.activations.values()),
        "mask_bytes": mask_bytes if masks or cp == 1 else None,
        "rss_growth_bytes": 1024 * (peak_kib - base_kib) if peak_kib and base_kib else None,
        "steps": steps,
    }


# --------------------------------------------------------------------------- analysis
def analytic_terms(
    settings: Settings, seq: int, cp: int, variant: str = "allgather"
) -> dict[str, float]:
    """The per-rank bytes (fp32) that cp>1 holds beyond ``(cp=1) / cp`` (see ``METHOD``)."""
    cfg = settings.model_config(seq)
    assert cfg.n_kv_heads is not None  # NOTE: ModelConfig.__post_init__ fills it
    b, fp32 = settings.batch, 4
    kv = cfg.n_layers * 2 * b * seq * cfg.n_kv_heads * cfg.head_dim * fp32
    if cp == 1:
        return {"kv": kv, "kv_excess": 0.0, "masks": 0.0, "small": 0.0}
    chunk = seq // (2 * cp)
    attn_out = cfg.n_layers * b * (seq // cp) * cfg.dim * fp32
    rope = 2 * (seq // cp) * cfg.head_dim * fp32
    # int64 token ids: cp=1's inputs and targets are views of one [B, S+1] tensor (batch 1:
    # the flattened targets stay a view), a cp rank's are two [B, S/cp] slices of their own.
    ids = 8 * b * (2 * (seq // cp) - (seq + 1) / cp)
    if variant == "heads":  # the whole sequence of 1/cp of the heads: K/V beyond it only
        # where a key/value head goes to cp / n_kv_heads ranks; no masks (is_causal=True)
        repeat = kv_head_copies(cfg.n_kv_heads, cp)
        return {
            "kv": kv * repeat / cp,
            "kv_excess": kv * (repeat - 1) / cp,
            "masks": 0.0,
            "small": attn_out + rope + ids,
        }
    return {
        "kv": kv,
        "kv_excess": kv * (1 - 1 / cp),
        # one row of chunk + end - 1 values per chunk; ends (r + 1) chunk and (2 cp - r) chunk
        "masks": fp32 * ((2 * cp + 3) * chunk - 2),
        "small": attn_out + rope + ids,
    }


def summarize(
    settings: Settings,
    seq: int,
    cp: int,
    variant: str,
    per_rep: list[list[dict[str, Any]]],
    base: Any,
) -> dict[str, Any]:
    """One table row from every repeat's per-rank results (``per_rep[repeat][rank]``);
    ``base``: the cp=1 row of this seq (None for cp=1 itself). A memory-only row (no timed
    steps) has NaN timings."""
    act = [max(r["activation_bytes"] for r in ranks) for ranks in per_rep]
    if len(set(act)) != 1:
        raise RuntimeError(f"seq {seq} cp {cp}: saved bytes differ between repeats: {act}")
    rss = [r["rss_growth_bytes"] for ranks in per_rep for r in ranks]
    # per timed step: (slowest rank's wall s, busiest rank's CPU s, other processes' cores)
    step_ms: list[float] = []
    cpu_s, other, cpu_share = [], [], []
    for ranks in per_rep:
        walls = []
        for i in range(len(ranks[0]["steps"])):
            steps = [r["steps"][i] for r in ranks]
            wall = max(s["step_s"] for s in steps)
            walls.append(wall)
            cpu_s.append(max(s["cpu_s"] for s in steps))
            cpu_share += [s["cpu_s"] / s["step_s"] for s in steps]
            if steps[0]["machine_busy_s"] is not None:  # rank 0's /proc/stat minus the ranks'
                other.append((steps[0]["machine_busy_s"] - sum(s["cpu_s"] for s in steps)) / wall)
        step_ms.append(1e3 * statistics.median(walls) if walls else math.nan)
    terms = analytic_terms(settings, seq, cp, variant)
    cp1 = act[0] if base is None else base["act"]
    ideal = cp1 / cp
    predicted = ideal + terms["kv_excess"] + terms["masks"] + terms["small"]
    median_ms = statistics.median(step_ms)
    cpu = statistics.median(cpu_s) if cpu_s else math.nan
    masks_measured = [r["mask_bytes"] for r in per_rep[0]]
    return {
        "seq": seq,
        "cp": cp,
        "variant": variant if cp > 1 else "-",
        "act": act[0],
        "act_lo": min(r["activation_bytes"] for r in per_rep[0]),
        "ratio": act[0] / cp1,
        "ideal": ideal,
        **terms,
        "predicted": predicted,
        "vs_predicted": act[0] / predicted,
        "mask_measured": None if None in masks_measured else max(masks_measured),
        "rss": None if None in rss else max(rss),
        "step_ms": median_ms,
        "step_ms_reps": step_ms,
        "tok_s_rank": settings.batch * seq / cp / (median_ms / 1e3),
        "speedup": 1.0 if base is None else base["step_ms"] / median_ms,
        "cpu_share": statistics.median(cpu_share) if cpu_share else math.nan,
        "cpu_s": cpu,
        "cpu_vs_ideal": math.nan if base is None else cpu / (base["cpu_s"] / cp),
        "other_cores": max(0.0, statistics.median(other)) if other else math.nan,
    }


def measure(settings: Settings, run_on_ranks: RunOnRanks) -> list[dict[str, Any]]:
    """Every (seq, cp) row; ``run_on_ranks(n, fn, *args)`` runs ``fn`` on n gloo ranks."""
    results: dict[tuple[int, int, str], list[list[dict[str, Any]]]] = {}
    runs = [(c, v) for c in settings.cps for v in (settings.variants if c > 1 else ("-",))]
    for rep in range(settings.repeats):
        t0 = time.perf_counter()
        seqs = [(s, True) for s in settings.seqs]
        seqs += [(s, False) for s in settings.memory_seqs] if rep == 0 else []
        for seq, timed in seqs:
            for cp, variant in runs:  # interleaved: the degrees share the machine's noise
                kind = variant if cp > 1 else "allgather"
                out = run_on_ranks(cp, rank_run, settings, cp, seq, kind, timed)
                results.setdefault((seq, cp, variant), []).append(out)
        print(f"  repeat {rep + 1}: {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for seq in (*settings.seqs, *settings.memory_seqs):
        base = None
        for cp, variant in sorted(runs):
            row = summarize(settings, seq, cp, variant, results[seq, cp, variant], base)
            base = base or (row if cp == 1 else None)
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- output
def _mib(n: float | None) -> str:
    return "—" if n is None or math.isnan(n) else f"{n / 2**20:.1f}"


def _num(value: float, fmt: str) -> str:
    return "—" if math.isnan(value) else format(value, fmt)


def _span(values: list[float], fmt: str) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo} to {hi}"


def memory_table(rows: list[dict[str, Any]]) -> list[str]:
    """Saved-for-backward bytes per rank against cp=1 / cp and the analytic terms (MiB)."""
    lines = [
        "| seq | cp | variant | measured MiB | / cp=1 | ideal 1/cp | (cp=1)/cp | + K/V excess "
        "| + masks KiB | + smaller | = predicted | measured / predicted | K/V held "
        "| masks measured KiB | peak RSS growth MiB |",
        "|---:|---:|---|" + "---:|" * 12,
    ]
    for r in rows:
        kib = "—" if r["mask_measured"] is None else f"{r['mask_measured'] / 1024:.1f}"
        lines.append(
            f"| {r['seq']} | {r['cp']} | {r['variant']} | {_mib(r['act'])} | {r['ratio']:.3f} "
            f"| {1 / r['cp']:.3f} "
            f"| {_mib(r['ideal'])} | {_mib(r['kv_excess'])} | {r['masks'] / 1024:.1f} "
            f"| {_mib(r['small'])} | {_mib(r['predicted'])} | {r['vs_predicted']:.4f} "
            f"| {_mib(r['kv'])} | {kib} | {_mib(r['rss'])} |"
        )
    return lines


def time_table(rows: list[dict[str, Any]]) -> list[str]:
    """Step time (median of each repeat), tokens/s per rank, speed-up, CPU share."""
    lines = [
        "| seq | cp | variant | step ms (median) | step ms (r1 / r2 / ...) | tokens/s per rank "
        "| tokens/s all ranks | speed-up vs cp=1 | CPU share | CPU ms per rank "
        "| CPU / ((cp=1 CPU) / cp) | other processes, cores |",
        "|---:|---:|---|" + "---:|" * 9,
    ]
    for r in rows:
        if math.isnan(r["step_ms"]):  # a memory-only sequence
            continue
        reps = " / ".join(f"{ms:.0f}" for ms in r["step_ms_reps"])
        lines.append(
            f"| {r['seq']} | {r['cp']} | {r['variant']} | {r['step_ms']:.0f} | {reps} "
            f"| {r['tok_s_rank']:.0f} "
            f"| {r['tok_s_rank'] * r['cp']:.0f} | {r['speedup']:.2f} | {r['cpu_share']:.2f} "
            f"| {1e3 * r['cpu_s']:.0f} | {_num(r['cpu_vs_ideal'], '.2f')} "
            f"| {_num(r['other_cores'], '.2f')} |"
        )
    return lines


def reading(rows: list[dict[str, Any]]) -> list[str]:
    """The numbers the page's reading rests on, computed from this run's rows."""
    par = [r for r in rows if r["cp"] > 1]
    if not par:
        return []
    gathered = [r for r in par if r["variant"] == "allgather"]
    exact = sum(r["mask_measured"] == r["masks"] for r in gathered)
    lines = [
        "- Measured against predicted ((cp=1)/cp + K/V excess + masks + smaller terms): "
        f"{_span([r['vs_predicted'] for r in par], '.5f')} (largest miss "
        f"{max(abs(r['act'] - r['predicted']) for r in par):.0f} bytes); the masks measured in the "
        "all-gather kernel's cache equal the formula "
        + ("exactly." if exact == len(gathered) else f"in {exact} of {len(gathered)} rows.")
    ]
    timing = []
    for cp, variant in sorted({(r["cp"], r["variant"]) for r in par}):
        at = [r for r in par if (r["cp"], r["variant"]) == (cp, variant)]
        seqs = ", ".join(str(r["seq"]) for r in at)
        timed = [r for r in at if not math.isnan(r["step_ms"])]

        def share(key: str, fmt: str, at: list[dict[str, Any]] = at) -> str:
            return _span([r[key] / (r["act"] - r["ideal"]) for r in at], fmt)

        lines.append(
            f"- cp={cp} {variant}: a rank saves {_span([r['ratio'] for r in at], '.3f')} of "
            f"cp=1's bytes (ideal {1 / cp:.3f}) for seq {seqs}. Of the excess over (cp=1)/cp, "
            f"the K/V excess is {share('kv_excess', '.0%')}, the smaller terms "
            f"{share('small', '.0%')}, the masks {share('masks', '.2%')}."
        )
        at = timed
        seqs = ", ".join(str(r["seq"]) for r in at)
        if not at:  # memory only (--memory-only): nothing was timed
            continue
        timing.append(
            f"- Step time at cp={cp} {variant}: {_span([r['speedup'] for r in at], '.2f')} x cp=1's speed "
            f"(seq {seqs}), CPU share per rank {_span([r['cpu_share'] for r in at], '.2f')}; the "
            f"busiest rank's CPU time is {_span([r['cpu_vs_ideal'] for r in at], '.2f')} x its "
            f"ideal share (cp=1's / {cp}); other processes kept "
            f"{_span([r['other_cores'] for r in at], '.2f')} cores busy."
        )
    worse = [r for r in par if r["ratio"] >= 1.0]
    if worse:
        lines.append(
            "- Where cp>1 saves *more* than cp=1: "
            + ", ".join(f"seq {r['seq']} cp={r['cp']} ({r['ratio']:.2f} x)" for r in worse)
            + "."
        )
    share = max(r["masks"] / r["act"] for r in par)
    lines.append(f"- The masks are at most {share:.3%} of a rank's saved bytes.")
    return lines + timing


def render_markdown(
    info: dict[str, str],
    settings: Settings,
    rows: list[dict[str, Any]],
    wall_s: float,
    command: str = "uv run python tools/bench_cp.py",
) -> str:
    cfg = settings.model_config(max((*settings.seqs, *settings.memory_seqs)))
    setup = [
        f"- Model: forge's reference `Transformer`, dim {cfg.dim}, {cfg.n_layers} blocks, "
        f"{cfg.n_heads} heads, {cfg.n_kv_heads} KV heads (GQA), head_dim {cfg.head_dim}, FFN "
        f"{cfg.ffn_dim}, vocabulary {cfg.vocab_size}; fp32.",
        f"- Batch {settings.batch}, sequences {', '.join(map(str, settings.seqs)) or 'none'} "
        "timed"
        + (
            f" ({', '.join(map(str, settings.memory_seqs))} for memory only: one step, no timing)"
            if settings.memory_seqs
            else ""
        )
        + f"; cp in {list(settings.cps)}, each cp > 1 with the `[cp]` variants "
        f"{list(settings.variants)}. cp=1: the plain model (`ParallelPlan(None)`: no mesh, SDPA "
        "`is_causal=True`) in a 1-rank `forge_core.testing.RankPool`, so it runs in the same kind "
        'of process as the cp ranks; cp>1: `ParallelPlan(build_device_mesh({"cp": cp}, "cpu"))` '
        '(forge-cp\'s load-balanced shards; all-gathered K/V, or with `variant = "heads"` the '
        "all-to-all over heads; FSDP2 sharding the parameters over the cp ranks: forge's "
        "default) on cp gloo ranks. One torch thread per process, cp=1 "
        "included.",
        "- A step: `forge_core.training.forward_backward` on the same full batch on every rank (it "
        "keeps the rank's two chunks of inputs, targets and positions; forward, loss, backward; no "
        "optimizer). "
        + (
            f"Per (seq, cp): one memory step (also the warm-up), then {settings.rounds} timed "
            f"steps; the whole sweep {settings.repeats} times. "
            if settings.seqs
            else "Per (seq, cp): one memory step, no timing (`--memory-only`). "
        )
        + f"Wall time of this run: {wall_s / 60:.1f} min.",
    ]
    lines = [
        "# Context parallelism: activation memory and step time per rank\n",
        f"Written by `{command}`; rerun it to refresh this page.",
    ]
    sections = [
        ("Machine", [f"- {k}: {v}" for k, v in info.items()]),
        ("Settings", setup),
        ("Method", METHOD),
        ("Activation memory per rank", memory_table(rows)),
        ("Step time", time_table(rows)),
        ("Reading", reading(rows) + NOTES),
    ]
    if not settings.seqs:  # memory only
        sections = [(title, body) for title, body in sections if title != "Step time"]
    for title, body in sections:
        lines += ["", f"## {title}", "", *body]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq 256/512, cp 1/2 (seconds)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--out", type=Path, default=OUT_MD)
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--kv-heads", type=int, default=None, help="key/value heads of the model (default 2)"
    )
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="one memory step per (seq, cp), no timing (the sequences of --seqs or the sweep)",
    )
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help="sequence lengths")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    seqs = tuple(args.seqs) if args.seqs else settings.seqs
    settings = dataclasses.replace(
        settings,
        seqs=seqs,
        rounds=args.rounds or settings.rounds,
        repeats=args.repeats or settings.repeats,
        n_kv_heads=args.kv_heads or settings.n_kv_heads,
    )
    if args.memory_only:
        memory = tuple(dict.fromkeys((*settings.seqs, *settings.memory_seqs)))
        settings = dataclasses.replace(settings, seqs=(), memory_seqs=memory, repeats=1)
    rows, info, wall_s = measure_on_rank_pools(lambda run: measure(settings, run))
    print("\n" + "\n".join(memory_table(rows)))
    if settings.seqs:
        print("\n" + "\n".join(time_table(rows)))
    print("\n" + "\n".join(reading(rows)))
    print(f"\nwall time {wall_s:.0f} s")
    if not args.no_write:
        command = " ".join(["uv run python tools/bench_cp.py", *(argv or sys.argv[1:])])
        args.out.write_text(render_markdown(info, settings, rows, wall_s, command))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    # NOTE: run main() from this file imported as ``bench_cp`` (tools/ is on sys.path as the
    # script's folder): RankPool's workers unpickle rank_run and Settings by module name, and
    # names of __main__ would not resolve in them.
    sys.exit(importlib.import_module("bench_cp").main())

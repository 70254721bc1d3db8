"""Benchmark forge's MoE layer per dispatch mode against a torchtitan-style reference; write ``benchmarks/moe.md``.

Run from anywhere: ``uv run python tools/bench_moe.py`` (about a minute on 2 CPU cores;
``--quick`` for a ~10 s smoke run). Question: what does one MoE layer cost per training step
(forward + backward) and how many times does it make the host wait for the device, for each
forge dispatch mode, against the torchtitan expert-parallel dropless pattern written here:

- ``reference (torchtitan-style)``: fp32 softmax top-k router (weights copied from the forge
  layer), counts by ``torch.histc``, an all-to-all of the counts, a **blocking** device-to-host
  copy of the split sizes, ``argsort`` permutation, the variable-size all-to-all, a reorder of the
  received rows to expert-major, ``torch._grouped_mm`` (per-expert loop where it does not run),
  unpermute by ``index_copy`` and a weighted combine in fp32 (``bmm``).
- ``forge dropless``: ``moe_dispatch="dropless"`` with an ``ep`` group: the EP path with one
  deferred host wait (``StagedSplits``).
- ``forge dropless (local, no EP)``: the same without an ``ep`` group (no collective).
- ``forge capacity``: ``moe_dispatch="capacity"``, ``capacity_factor=1.25``, with an ``ep`` group.

One process: the ``ep`` group is the 1-rank world group (gloo on CPU, NCCL on CUDA), set on the
layers by hand because ``apply_expert_parallel`` creates no ``ep`` axis of size 1. The
all-to-alls then run with one rank, which still exercises the count exchange, the staging and
the host wait. Timed: forward + backward (input and parameter gradients), variants round-robin,
medians of ``--reps`` runs after warm-up (CUDA: events, synchronized). Host syncs: one step under
``forge_core.sync_guard.count_host_syncs`` (on CPU it flags the ops that would sync a GPU; on
CUDA it counts torch's sync-debug warnings), plus the layer's own count of host waits
(``moe_metrics``). On a GPU: bf16 parameters and activations (the router computes in fp32), the
Qwen3-30B-A3B-like and Mixtral-like shapes of the grouped-GEMM benchmark; on CPU: fp32 at
reduced shapes, where timings are only indicative and the sync counts are the finding.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from benchlib import machine_facts, sync, time_interleaved  # noqa: E402 - tools/ sibling module
from forge_core import ModelConfig
from forge_core.sync_guard import count_host_syncs
from forge_mesh import build_device_mesh
from forge_moe_ep import MoE, apply_expert_parallel, capacity_per_sequence, moe_metrics
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parent.parent
OUT_MD = ROOT / "benchmarks" / "moe.md"
REFERENCE = "reference (torchtitan-style)"
DROPLESS = "forge dropless"
LOCAL = "forge dropless (local, no EP)"
CAPACITY = "forge capacity"
VARIANTS = (REFERENCE, DROPLESS, LOCAL, CAPACITY)
CAPACITY_FACTOR = 1.25
TARGETS = "0 host syncs per step in capacity mode; forge dropless >= 1.1x the reference on a GPU"


@dataclass(frozen=True)
class Shape:
    """One MoE layer configuration and batch: ``T = batch * seq`` tokens."""

    name: str
    batch: int
    seq: int
    dim: int
    experts: int
    top_k: int
    ffn: int
    shared: int = 0

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def label(self) -> str:
        shared = f" +{self.shared} shared" if self.shared else ""
        return (
            f"{self.name}: T={self.tokens} ({self.batch}x{self.seq}) E={self.experts} "
            f"K={self.top_k} D={self.dim} H={self.ffn}{shared}"
        )


# GPU: the grouped-GEMM benchmark's Qwen3-30B-A3B-like layer (E=128, top-8, dim 2048, ffn 768)
# at 8k and 16k tokens, and a Mixtral-8x7B-like layer (E=8, top-2, dim 4096, ffn 14336) at 8k.
SHAPES_CUDA = [
    Shape("Qwen3-30B-A3B-like", 2, 4096, 2048, 128, 8, 768),
    Shape("Qwen3-30B-A3B-like", 4, 4096, 2048, 128, 8, 768),
    Shape("Mixtral-like", 2, 4096, 4096, 8, 2, 14336),
]
# CPU: small fp32 layers that finish in well under two minutes on 2 cores.
SHAPES_CPU = [
    Shape("Mixtral-like, reduced", 4, 512, 256, 8, 2, 512),
    Shape("fine-grained, reduced", 4, 512, 128, 32, 4, 256, shared=1),
    Shape("Qwen3-like, reduced", 2, 512, 256, 128, 8, 96),
]
SHAPES_QUICK = [Shape("smoke", 2, 128, 64, 8, 2, 128, shared=1)]


# --------------------------------------------------------------------------- process group
def init_single_rank_group(device: torch.device) -> None:
    """A world of one rank (gloo on CPU, NCCL on CUDA) unless one is already initialized."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


# --------------------------------------------------------------------------- the reference
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` (forward and backward) runs for this device and dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.zeros(16, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.zeros(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
        torch._grouped_mm(x, w, offs=offs).backward(torch.ones(16, 16, device=device, dtype=dtype))
    except (RuntimeError, NotImplementedError):
        return False
    return True


class TorchtitanStyleMoE(nn.Module):
    """The torchtitan expert-parallel dropless MoE pattern, with its own copy of the weights.

    The one host sync is the blocking copy of the split sizes right after the count exchange;
    nothing is overlapped with it. ``group=None`` means a 1-rank world group.
    """

    def __init__(self, forge: MoE, group: dist.ProcessGroup | None, use_grouped_mm: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.score = (
            forge.num_experts,
            forge.top_k,
            forge.router.score,
        )
        self.group = group
        self.use_grouped_mm = use_grouped_mm
        self.gate = nn.Parameter(forge.router.gate.weight.detach().clone())
        self.register_buffer("expert_bias", forge.router.expert_bias.detach().clone())
        experts = forge.experts
        self.w1 = nn.Parameter(_local(experts.w1).detach().clone())
        self.w2 = nn.Parameter(_local(experts.w2).detach().clone())
        self.w3 = nn.Parameter(_local(experts.w3).detach().clone())
        self.shared = None if forge.shared_expert is None else copy.deepcopy(forge.shared_expert)

    def _experts(self, x: torch.Tensor, offs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if self.use_grouped_mm:
            h = F.silu(torch._grouped_mm(x, self.w1, offs=offs)) * torch._grouped_mm(
                x, self.w3, offs=offs
            )
            return torch._grouped_mm(h, self.w2, offs=offs)
        outs = []
        for e, x_e in enumerate(torch.split(x, counts)):
            h = F.silu(x_e @ self.w1[e]) * (x_e @ self.w3[e])
            outs.append(h @ self.w2[e])
        return torch.cat(outs)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x_BSD.shape
        x = x_BSD.reshape(-1, dim)
        t, k, e = x.shape[0], self.top_k, self.num_experts
        group = dist.group.WORLD if self.group is None else self.group
        ranks = dist.get_world_size(group)
        local = e // ranks
        # Router: fp32, top-k on (scores + bias), unbiased scores as combine weights.
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.float())
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        ids = torch.topk(scores.detach() + self.expert_bias, k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.score == "sigmoid" and k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        # Counts, their all-to-all, then the blocking copy of the split sizes.
        counts = torch.histc(ids.view(-1).float(), bins=e, min=0, max=e).to(torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        send_RE, recv_RE = counts.view(ranks, local), recv_counts.view(ranks, local)
        splits = torch.cat([send_RE.sum(1), recv_RE.sum(1), recv_RE.sum(0)])
        host = splits.to("cpu", non_blocking=False).tolist()  # the host sync
        in_splits, out_splits = host[:ranks], host[ranks : 2 * ranks]
        expert_rows = host[2 * ranks :]
        received = sum(out_splits)
        # Permute: slots sorted by expert (stable), token rows gathered.
        order = torch.argsort(ids.view(-1), stable=True)
        x_sorted = x[order // k]
        x_recv = funcol.all_to_all_single_autograd(x_sorted, out_splits, in_splits, group)
        # Received rows are [source rank, local expert] blocks: reorder them expert-major.
        block_expert = torch.arange(local, device=x.device).repeat(ranks)
        row_expert = torch.repeat_interleave(
            block_expert, recv_RE.reshape(-1), output_size=received
        )
        perm = torch.argsort(row_expert, stable=True)
        offs = recv_RE.sum(0).cumsum(0).to(torch.int32)
        y_e = self._experts(x_recv[perm], offs, expert_rows)
        y_recv = y_e.new_empty(y_e.shape).index_copy(0, perm, y_e)
        y_back = funcol.all_to_all_single_autograd(y_recv, in_splits, out_splits, group)
        # Unpermute to slot order, then the weighted combine in fp32.
        y_slots = y_back.new_empty(t * k, dim).index_copy(0, order, y_back)
        out = torch.bmm(weights.view(t, 1, k), y_slots.view(t, k, dim).float())
        out = out.squeeze(1).to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(batch, seq, dim)


# --------------------------------------------------------------------------- building the variants
def _config(shape: Shape, dispatch: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=256,
        dim=shape.dim,
        n_layers=1,
        n_heads=max(1, shape.dim // 64),
        moe_every=1,
        num_experts=shape.experts,
        top_k=shape.top_k,
        moe_ffn_dim=shape.ffn,
        num_shared_experts=shape.shared,
        moe_dispatch=dispatch,
        capacity_factor=CAPACITY_FACTOR,
    )


def build_variants(
    shape: Shape, device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, nn.Module], bool]:
    """The four layers (forge ones share router, experts and shared expert); grouped_mm used?"""
    base = MoE(_config(shape, "dropless"), 0)
    base.init_weights(seed=0)
    base.to(device)
    # NOTE: cast the parameters only (as FSDP2's param_dtype does): Module.to(dtype) would also
    # cast the router's fp32 count buffer and break MoE.forward in training mode.
    for p in base.parameters():
        p.data = p.data.to(dtype)
    mesh = build_device_mesh(
        {"dp_shard": dist.get_world_size(), "ep": dist.get_world_size()},
        device.type,
        num_experts=shape.experts,
    )
    apply_expert_parallel(base, mesh)
    ep_group = base.ep_group or dist.group.WORLD  # no ep axis of size 1: set it by hand
    base.ep_group = ep_group

    def sharing(dispatch: str, group: dist.ProcessGroup | None) -> MoE:
        moe = MoE(_config(shape, dispatch), 0)
        moe.router, moe.experts, moe.shared_expert = base.router, base.experts, base.shared_expert
        moe.to(device)  # NOTE: after sharing, so only the counters move (no expert-sized copy)
        moe.ep_group, moe.count_group = group, base.count_group
        return moe

    use_grouped_mm = grouped_mm_runs(device, dtype)
    reference = TorchtitanStyleMoE(base, ep_group, use_grouped_mm).to(device)
    layers: dict[str, nn.Module] = {
        REFERENCE: reference,
        DROPLESS: base,
        LOCAL: sharing("dropless", None),
        CAPACITY: sharing("capacity", ep_group),
    }
    for layer in layers.values():
        layer.train()
    return layers, use_grouped_mm


# --------------------------------------------------------------------------- timing


class Step:
    """One training step of a layer: forward, backward into the input and the parameters."""

    def __init__(self, layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
        self.layer, self.grad = layer, grad
        self.input = x.detach().clone().requires_grad_()

    def __call__(self) -> torch.Tensor:
        self.layer.zero_grad(set_to_none=True)
        self.input.grad = None
        out = self.layer(self.input)
        out.backward(self.grad)
        return out


def _moe_layers(layer: nn.Module) -> list[MoE]:
    return [m for m in layer.modules() if isinstance(m, MoE)]


def bench_shape(
    shape: Shape, device: torch.device, dtype: torch.dtype, reps: int, warmup: int
) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    layers, use_grouped_mm = build_variants(shape, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(shape.batch, shape.seq, shape.dim, generator=g).to(device, dtype)
    grad = torch.randn(shape.batch, shape.seq, shape.dim, generator=g).to(device, dtype)
    steps = {name: Step(layer, x, grad) for name, layer in layers.items()}
    rows: dict[str, dict[str, Any]] = {}
    outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    # Correctness pass (also the first warm-up): outputs and input gradients.
    for name, step in list(steps.items()):
        rows[name] = dict(shape=shape.label(), variant=name, error=None)
        try:
            out = step()
            sync(device)
            assert step.input.grad is not None
            outputs[name] = (out.detach().float(), step.input.grad.detach().float())
        except Exception as exc:  # noqa: BLE001 -- report the failing variant, keep the others
            traceback.print_exc()
            rows[name]["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            del steps[name]
    ref_out = outputs.get(DROPLESS)
    for name, (out, dx) in outputs.items():
        if ref_out is not None:
            rows[name]["max_out_diff"] = (out - ref_out[0]).abs().max().item()
            rows[name]["max_dx_diff"] = (dx - ref_out[1]).abs().max().item()
    del outputs, ref_out
    timed = time_interleaved(dict(steps), device, reps, warmup)
    for name, (med, low) in timed.items():
        rows[name].update(ms=med, min_ms=low, tokens_per_s=shape.tokens / (med * 1e-3))
    # Host syncs, after the warm-up (no autotuning left): one step each under the guard, and
    # the layer's own counters around it.
    for name, step in steps.items():
        moes = _moe_layers(layers[name])
        waits0 = sum(m.host_syncs for m in moes)
        dropped0 = moe_metrics(layers[name])["tokens_dropped"] if moes else 0
        sync(device)
        with count_host_syncs(device) as counter:
            step()  # NOTE: no synchronize inside: on CUDA that would count as a sync itself
        rows[name]["syncs"] = counter.count
        rows[name]["sync_ops"] = dict(counter.ops)
        if moes:
            rows[name]["layer_waits"] = sum(m.host_syncs for m in moes) - waits0
            rows[name]["dropped"] = moe_metrics(layers[name])["tokens_dropped"] - dropped0
    ref_ms = timed.get(REFERENCE, (None,))[0]
    for name in timed:
        rows[name]["vs_ref"] = ref_ms / timed[name][0] if ref_ms else None
        rows[name]["grouped_mm"] = use_grouped_mm
        rows[name]["slots"] = shape.tokens * shape.top_k
        print(_row_line(rows[name]), flush=True)
    if CAPACITY in rows:
        cap = capacity_per_sequence(shape.seq, shape.top_k, shape.experts, CAPACITY_FACTOR)
        rows[CAPACITY]["buffer_rows"] = shape.experts * shape.batch * cap
    del layers, steps
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return list(rows.values())


def _row_line(r: dict[str, Any]) -> str:
    if r.get("error"):
        return f"{r['shape']} | {r['variant']}: ERROR {r['error']}"
    return (
        f"{r['shape']} | {r['variant']:30s} {r['ms']:9.2f} ms (min {r['min_ms']:8.2f})  "
        f"syncs {r['syncs']}  vs ref {_fmt(r['vs_ref'], '.2f', unit='x')}  "
        f"max|out diff| {r.get('max_out_diff', float('nan')):.1e}"
    )


# --------------------------------------------------------------------------- report
def _fmt(v: Any, spec: str, missing: str = "—", unit: str = "") -> str:
    return missing if v is None else format(v, spec) + unit


def _ops(r: dict[str, Any]) -> str:
    ops = r.get("sync_ops") or {}
    return ", ".join(f"`{k}` x{v}" for k, v in ops.items()) or "none"


def results_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| shape | variant | fwd+bwd median (min) ms | tokens/s | host syncs / step (guard) "
        "| host waits / step (layer) | speed vs reference | max abs out diff vs forge dropless "
        "| max abs dx diff | routed slots dropped |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['shape']} | {r['variant']} | error: {r['error']} |||||||| ")
            continue
        dropped = r.get("dropped")
        drop = "—" if dropped is None else f"{dropped} ({100 * dropped / r['slots']:.1f}%)"
        lines.append(
            f"| {r['shape']} | {r['variant']} | {r['ms']:.2f} ({r['min_ms']:.2f}) | "
            f"{r['tokens_per_s']:,.0f} | {r['syncs']} | {_fmt(r.get('layer_waits'), 'd')} | "
            f"{_fmt(r['vs_ref'], '.2f', unit='x')} | {_fmt(r.get('max_out_diff'), '.1e')} | "
            f"{_fmt(r.get('max_dx_diff'), '.1e')} | {drop} |"
        )
    return lines


def sync_table(rows: list[dict[str, Any]]) -> list[str]:
    """The flagged ops per variant (the same for every shape, so listed once per variant)."""
    seen: dict[str, str] = {}
    for r in rows:
        if not r.get("error"):
            seen.setdefault(r["variant"], _ops(r))
    return [
        "| variant | ops seen by the guard in one fwd+bwd step |",
        "|---|---|",
        *[f"| {v} | {ops} |" for v, ops in seen.items()],
    ]


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x" if values else "n/a"


def reading(rows: list[dict[str, Any]], on_cuda: bool, info: dict[str, str]) -> list[str]:
    ok = [r for r in rows if not r.get("error")]
    by = {v: [r for r in ok if r["variant"] == v] for v in VARIANTS}
    lines = []
    errors = [r for r in rows if r.get("error")]
    if errors:
        lines.append(
            "- **Errors**: "
            + "; ".join(f"{r['variant']} at {r['shape']}: {r['error']}" for r in errors)
            + "."
        )
    cap_syncs = sorted({r["syncs"] for r in by[CAPACITY]})
    cap_ok = cap_syncs == [0]
    lines.append(
        f"- Target 1, 0 host syncs per step in capacity mode: "
        f"{'**met**' if cap_ok else '**not met**'} (guard counted {cap_syncs} per step)."
    )
    dl_syncs = sorted({r["syncs"] for r in by[DROPLESS]})
    dl_waits = sorted({r.get("layer_waits") for r in by[DROPLESS]})
    ref_syncs = sorted({r["syncs"] for r in by[REFERENCE]})
    local_syncs = sorted({r["syncs"] for r in by[LOCAL]})
    backward_note = (
        " Both backwards add none: the one sync of the step is the forward's split-size read "
        "(the all-to-all backwards reuse the split lists)."
        if ref_syncs == [1] and dl_syncs == [1]
        else ""
    )
    lines.append(
        f"- Host syncs per fwd+bwd step: reference {ref_syncs}, forge dropless (EP) {dl_syncs} "
        f"(the layer counted {dl_waits} deferred waits), forge dropless local {local_syncs}, "
        f"forge capacity {cap_syncs}.{backward_note}"
    )
    if on_cuda:
        lines.append(
            "- On CUDA the guard counts torch's sync-debug warnings: a blocking copy "
            "(`.to('cpu')`, `.item()`) warns, but forge's deferred wait is "
            "`torch.cuda.Event.synchronize()`, which the sync debug mode may not report; the "
            "layer's own counter (`moe_metrics()['host_syncs']`) is the reliable count there."
        )
    speed = {v: [r["vs_ref"] for r in by[v] if r.get("vs_ref")] for v in VARIANTS[1:]}
    lines.append(
        "- Speed vs the reference (reference time / variant time, >1 is faster): "
        + ", ".join(f"{v} {_span(s)}" for v, s in speed.items())
        + "."
    )
    if on_cuda:
        fast = speed[DROPLESS] and min(speed[DROPLESS]) >= 1.1
        lines.append(
            f"- Target 2, forge dropless >= 1.1x the reference on the GPU: "
            f"{'**met**' if fast else '**not met**'} ({_span(speed[DROPLESS])})."
        )

    def worst(variant: str, key: str) -> str:
        vals = [r[key] for r in by[variant] if r.get(key) is not None]
        return f"{max(vals):.1e}" if vals else "n/a"

    lines.append(
        f"- Equivalence ({'bf16: different rounding points' if on_cuda else 'fp32'}): against "
        f"forge dropless (EP), the reference differs by at most {worst(REFERENCE, 'max_out_diff')}"
        f" in the output and {worst(REFERENCE, 'max_dx_diff')} in the input gradient; forge "
        f"dropless local by {worst(LOCAL, 'max_out_diff')} / {worst(LOCAL, 'max_dx_diff')}. "
        "Capacity differs where it drops slots (those get no routed output)."
    )
    drops = [
        f"{r['shape'].split(':')[0]} {100 * r['dropped'] / r['slots']:.1f}%"
        for r in by[CAPACITY]
        if r.get("dropped") is not None
    ]
    if drops:
        lines.append(
            f"- Capacity factor {CAPACITY_FACTOR} dropped {', '.join(drops)} of the routed "
            "slots with a freshly initialized router on random inputs (per-sequence capacity)."
        )
    pads = [
        f"{r['buffer_rows'] / r['slots']:.2f}x"
        for r in by[CAPACITY]
        if r.get("buffer_rows") is not None
    ]
    if pads:
        lines.append(
            "- Capacity computes its whole fixed buffer: the expert GEMMs run over E x batch x "
            f"capacity rows, {', '.join(pads)} the routed slots at these shapes (empty rows "
            "included), which is most of its gap to dropless; what it buys is no host sync at all."
        )
    if not on_cuda:
        lines += [
            "- Where forge's CPU time goes beyond the reference (torch.profiler at the "
            "Qwen3-like reduced shape): the expert GEMMs are the same `torch._grouped_mm` calls "
            "in both; forge adds the grouped-GEMM wrapper's tail masks (a `masked_fill` over "
            "every GEMM output and dX, 6 per step, although dropless layouts have no tail rows: "
            "they keep the contract that rows past `offs[-1]` are zeros), the rank-major reorder "
            "and its inverse gather, and in the EP path the counts all-to-all and the staging.",
            "- **GPU numbers are missing**: this session had no GPU. CPU timings are only "
            "indicative: the grouped GEMM on CPU is `torch._grouped_mm`'s per-group loop, the "
            "all-to-alls are gloo copies within one process, and a host sync costs nothing "
            "because the CPU never runs ahead of a device queue. What the CPU run does prove is "
            "the sync counts (the ops that would sync a GPU) and the numerical equivalence.",
            f"- Noise: a shared 2-core machine (load average "
            f"{info.get('load average at start (1/5/15 min)', '?')} at the start, "
            f"{info.get('load average at end (1/5/15 min)', '?')} at the end); variants run "
            "round-robin so they share the disturbance; read ratios within ~1.2x as ties.",
            "- Rerun `uv run python tools/bench_moe.py` (or `bash tools/gpu_check`) on an "
            "H100/H200 to fill the GPU table and settle target 2.",
        ]
    return lines


def write_markdown(
    info: dict[str, str], rows: list[dict[str, Any]], on_cuda: bool, reps: int, warmup: int
) -> list[str]:
    dtype = "bf16 parameters and activations" if on_cuda else "fp32"
    gmm = sorted({r.get("grouped_mm") for r in rows if r.get("grouped_mm") is not None})
    gmm_text = (
        "`torch._grouped_mm`"
        if gmm == [True]
        else "a per-expert loop (`torch._grouped_mm` does not run here)"
        if gmm == [False]
        else "mixed"
    )
    lines = [
        "# MoE layer benchmark: forge dispatch modes vs a torchtitan-style reference",
        "",
        "Written by `uv run python tools/bench_moe.py`; rerun it to refresh this page.",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in info.items()],
        f"- medians of {reps} runs after {warmup} warm-up runs (plus one correctness run), "
        "variants round-robin, "
        + ("CUDA events, synchronized" if on_cuda else "`time.perf_counter`"),
        "",
        "## Question",
        "",
        "What does one MoE layer cost per training step (forward + backward into the input and "
        "the parameters) and how often does it make the host wait for the device, for each forge "
        "dispatch mode (`dropless` with expert parallelism, `dropless` local, `capacity` with "
        f"factor {CAPACITY_FACTOR}), against the torchtitan expert-parallel dropless pattern? "
        "The reference (in `tools/bench_moe.py`) copies the forge layer's weights: fp32 softmax "
        "top-k router, `torch.histc` counts, all-to-all of the counts, a blocking device-to-host "
        "copy of the split sizes, `argsort` permutation, variable-size all-to-all, reorder to "
        f"expert-major, {gmm_text}, unpermute by `index_copy`, weighted combine in fp32. "
        f"The EP group is a 1-rank world group, so the all-to-alls run but move nothing between "
        f"devices. Dtype: {dtype} (the router computes in fp32 everywhere).",
        "",
        f"Targets: {TARGETS}.",
        "",
        "Columns: *host syncs (guard)*: `forge_core.sync_guard.count_host_syncs` around one step; "
        "*host waits (layer)*: `moe_metrics()['host_syncs']` delta (forge's deferred split-size "
        "waits); *speed vs reference*: reference median / variant median; diffs: max abs "
        "difference of the output and the input gradient against forge dropless (EP); "
        "*dropped*: routed (token, expert) slots dropped in one step.",
        "",
        f"## Results on {'CUDA (' + info['gpu'] + ')' if on_cuda else 'CPU (reduced shapes)'}",
        "",
        *results_table(rows),
        "",
        "## What the guard flagged",
        "",
        *sync_table(rows),
        "",
    ]
    if not on_cuda:
        lines += [
            "## CUDA",
            "",
            "Missing: no GPU was available when this page was written (shapes planned: "
            + "; ".join(s.label() for s in SHAPES_CUDA)
            + ", bf16).",
            "",
        ]
    lines += ["## Reading", "", *reading(rows, on_cuda, info), ""]
    OUT_MD.parent.mkdir(exist_ok=True)
    OUT_MD.write_text("\n".join(lines))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=None, help="timed runs (default 9 CPU, 20 GPU)")
    parser.add_argument("--quick", action="store_true", help="one tiny shape, 3 reps (~10 s)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch threads on a CPU-only machine (default 1: stable on a shared machine)",
    )
    args = parser.parse_args(argv)
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    if not on_cuda:
        torch.set_num_threads(args.cpu_threads)
    shapes = SHAPES_CUDA if on_cuda else SHAPES_CPU
    reps, warmup = args.reps or (20 if on_cuda else 9), 3 if on_cuda else 2
    if args.quick:
        shapes, reps, warmup = SHAPES_QUICK, args.reps or 3, 1
    init_single_rank_group(device)
    info = machine_facts()
    info["process group"] = f"{dist.get_backend()} world of 1 rank (ep group = the world group)"
    print(info, flush=True)
    rows: list[dict[str, Any]] = []
    try:
        for shape in shapes:
            try:
                rows += bench_shape(shape, device, dtype, reps, warmup)
            except Exception as exc:  # noqa: BLE001 -- e.g. out of memory: keep the other shapes
                traceback.print_exc()
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                rows.append(dict(shape=shape.label(), variant="(all)", error=error))
                if on_cuda:
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    info["load average at end (1/5/15 min)"] = "/".join(f"{x:.1f}" for x in os.getloadavg())
    if args.no_write:
        print("\n".join(results_table(rows) + [""] + reading(rows, on_cuda, info)))
        return 0
    lines = write_markdown(info, rows, on_cuda, reps, warmup)
    start = lines.index("## Question")
    print("\n".join(lines[start:]))
    print(f"wrote {OUT_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""forge's MoE layer side by side with torchtitan 0.3.0's real MoE; writes ``benchmarks/moe.md``.

Why: forge's target is "forge/torchtitan median time ratio <= 1.0 in every row" with at most one
host sync per MoE forward+backward in ``dropless`` mode under expert parallelism (EP) and none in
``capacity`` mode. This script measures exactly that against the peer itself (not a re-written
copy of it): ``torchtitan.models.common.moe.MoE`` built from torchtitan's own config helpers and,
under EP, parallelized by torchtitan's own ``Module.parallelize`` (``AllToAllTokenDispatcher``).

Run: ``uv run python tools/bench_moe.py`` (CPU: about 9 minutes on 2 shared cores; needs
``uv sync --group bench`` for the torchtitan column), ``--quick`` (one tiny shape, seconds),
``--no-write`` (print only), ``--out PATH`` (the page), ``--reps N`` (default 5 on CPU, 20 on a
GPU), ``--cpu-bf16-full`` (CPU bf16 rows at 4,096 tokens too and with the capacity column: CPU
bf16 grouped GEMMs are slow, ~+30 minutes). Without torchtitan it still times forge's rows and
says the peer column is missing and why.

What runs, per row (shape x tokens per rank x dtype x pass x layout):

- ``forge dropless``: ``forge_moe_ep.MoE`` with ``moe_dispatch="dropless"``; under EP the ``ep``
  group comes from ``forge_mesh.build_device_mesh`` + ``forge_moe_ep.apply_expert_parallel``.
- ``forge capacity``: ``moe_dispatch="capacity"``, ``capacity_factor=1.25`` (an extra column; it
  shares the dropless layer's router, experts and shared expert).
- ``torchtitan``: the same weights copied into torchtitan's layout (experts ``w1_EFD``/``w3_EFD``
  are forge's ``w1``/``w3`` transposed, ``w2_EDF`` is ``w2`` transposed; router gate and shared
  expert as they are).
- Layouts: one process without EP, and EP=2 over gloo with 2 processes (``RankPool(2)``, one torch
  thread each; each rank holds half the experts and routes its own tokens). CUDA: one process
  only, full-size Qwen3-30B-A3B and DeepSeek-V3 expert shapes in bf16.
- Passes: the forward of a training step (autograd recording, graph discarded) and
  forward+backward (input and parameter gradients). All six (variant, pass) functions of a row run
  round-robin in one ``benchlib.time_interleaved`` call; medians. Under EP every timed call ends
  with a barrier, and the row reports the larger of the two ranks' medians.
- Same run, correctness: top-k choices compared token by token (as sets), max abs difference of
  the outputs, the input gradients and the parameter gradients (forge dropless vs torchtitan),
  and host syncs per forward+backward under ``forge_core.testing.count_host_syncs`` on every
  rank.

Router settings both sides support identically: Qwen3-like rows use softmax scores without
renormalizing the top-k (torchtitan ``route_norm=False``; real Qwen3 renormalizes, forge's softmax
router does not); DeepSeek-V3-like rows use sigmoid scores normalized over the top-k
(torchtitan ``route_norm=True``, as forge does for sigmoid) with ``route_scale=1.0`` and no
node-limited routing (DeepSeek-V3 uses 2.5 and 8 groups / 4; forge has neither). Expert bias
zero on both sides (present on both: forge's ``router.expert_bias``, torchtitan's
``expert_bias_E``), and the gate runs in fp32 on both sides.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from benchlib import machine_facts, record_target, sync, time_interleaved  # noqa: E402 - sibling
from forge_core.testing.harness import RankPool
from forge_core.testing.sync_guard import count_host_syncs
from forge_moe_ep import MoE
from forge_moe_ep.config import MoEModelConfig
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parent.parent
OUT_MD = ROOT / "benchmarks" / "moe.md"
BENCH = "bench_moe"

DROPLESS, CAPACITY, TITAN = "forge dropless", "forge capacity", "torchtitan"
FWD, FWDBWD = "forward", "forward+backward"
PASSES = (FWD, FWDBWD)
CAPACITY_FACTOR = 1.25
SINGLE, EP2 = "single process (no EP)", "EP=2 (gloo, 2 processes)"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGET_RATIO = "forge/torchtitan median time ratio <= 1.0 in every row (forge dropless)"
TARGET_DROPLESS_SYNCS = "host syncs per MoE forward+backward under EP=2, forge dropless <= 1"
TARGET_CAPACITY_SYNCS = "host syncs per MoE forward+backward under EP=2, forge capacity == 0"


@dataclass(frozen=True)
class Shape:
    """One MoE layer: ``experts`` SwiGLU experts of ``dim -> hidden -> dim``, top-``top_k``."""

    name: str
    dim: int
    hidden: int
    experts: int
    top_k: int
    shared: int
    score: str  # "softmax" (top-k not renormalized) | "sigmoid" (normalized over the top-k)

    def label(self) -> str:
        shared = f", {self.shared} shared" if self.shared else ""
        return (
            f"{self.name} (D={self.dim}, H={self.hidden}, E={self.experts}, "
            f"top-{self.top_k}{shared}, {self.score})"
        )


@dataclass(frozen=True)
class Point:
    """One row: a shape, ``batch x seq`` tokens per rank, a dtype name."""

    shape: Shape
    batch: int
    seq: int
    dtype: str

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


QWEN_CPU = Shape("Qwen3-30B-A3B-like, reduced", 512, 192, 128, 8, 0, "softmax")
DSV3_CPU = Shape("DeepSeek-V3-like, reduced", 448, 128, 256, 8, 1, "sigmoid")
QWEN_CUDA = Shape("Qwen3-30B-A3B-like", 2048, 768, 128, 8, 0, "softmax")
DSV3_CUDA = Shape("DeepSeek-V3-like", 7168, 2048, 256, 8, 1, "sigmoid")
SMOKE = Shape("smoke", 64, 32, 8, 2, 1, "sigmoid")


def plan_points(on_cuda: bool, quick: bool, cpu_bf16_full: bool = False) -> list[Point]:
    """The rows to run (each is run in every layout)."""
    if quick:
        return [Point(SMOKE, 2, 64, d) for d in DTYPES]
    if on_cuda:
        # NOTE: bf16 only on the GPU (the training dtype); 4k and 16k tokens. DeepSeek-V3's full
        # expert weights are 22.5 GB in bf16 per copy (forge + torchtitan + gradients): 16k tokens
        # may not fit an 80 GB GPU; such a row reports the OOM and the others still run.
        return [Point(s, b, 4096, "bf16") for s in (QWEN_CUDA, DSV3_CUDA) for b in (1, 4)]
    # NOTE: bf16 torch._grouped_mm on CPU runs at ~2-10 GFLOP/s (fp32: ~60), so one bf16 round
    # of a 4,096-token row takes over a minute: by default bf16 runs at 1,024 tokens only (and
    # without the capacity column, see with_capacity), which keeps the whole CPU run near 10
    # minutes on 2 cores (--cpu-bf16-full adds them back, ~+30 minutes).
    return [
        Point(s, b, 512, d)
        for s in (QWEN_CPU, DSV3_CPU)
        for b in (2, 8)
        for d in DTYPES
        if d == "fp32" or b == 2 or cpu_bf16_full
    ]


def warmup_rounds(on_cuda: bool, dtype: str) -> int:
    """Untimed rounds before the timed ones (after one checked forward+backward per variant).

    NOTE: on CPU a bf16 round at 1,024 tokens takes ~25 s, and the checked forward+backward
    already ran every code path once, so bf16 rows take no further warm-up round there.
    """
    return 3 if on_cuda else (1 if dtype == "fp32" else 0)


# --------------------------------------------------------------------------- torchtitan
def torchtitan_missing() -> str | None:
    """None when torchtitan imports, else why it does not (the peer column is then missing)."""
    try:
        importlib.import_module("torchtitan.models.common.moe")
    except Exception as exc:  # noqa: BLE001 -- any import failure means "no peer column"
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return None


_TITAN_DIMS: dict[int, Any] = {}


def _titan_parallel_dims(ep: int) -> Any:
    """torchtitan's ``ParallelDims``: ``dp_shard = ep`` ranks, EP over all of them (cached)."""
    if ep not in _TITAN_DIMS:
        import torchtitan.distributed.parallel_dims as titan_dims
        from torchtitan.distributed.parallel_dims import ParallelDims

        if not torch.cuda.is_available():
            # NOTE: torchtitan's device_type falls back to "cuda" when no accelerator is present
            # (tools.utils.get_device_info), and ParallelDims.build_mesh would then init CUDA;
            # on a CPU-only machine its mesh must be a gloo "cpu" mesh.
            titan_dims.device_type = "cpu"
        dims = ParallelDims(
            dp_replicate=1,
            dp_shard=ep,
            cp=1,
            tp=1,
            pp=1,
            ep=ep,
            world_size=dist.get_world_size(),
            spmd_backend="partial_dtensor",
        )
        dims.build_mesh()
        _TITAN_DIMS[ep] = dims
    return _TITAN_DIMS[ep]


def _keep_dtype(
    self: torch.Tensor, memory_format: torch.memory_format = torch.preserve_format
) -> torch.Tensor:
    return self


def _titan_experts_in_input_dtype(experts: nn.Module) -> None:
    """Make torchtitan's ``GroupedExperts`` compute in its input's dtype (used for fp32 rows).

    NOTE: torchtitan 0.3.0's ``GroupedExperts.forward`` hard-codes ``.bfloat16()`` on the GEMM
    inputs and weights (no option turns it off), so an fp32 layer would compute its experts in
    bf16 while forge computes in fp32. While the experts' forward runs, ``Tensor.bfloat16``
    returns its tensor unchanged (restored when the forward returns, also on error), so both
    sides do the same fp32 arithmetic; the backward never calls it.
    """
    saved: list[Any] = []

    def enter(module: nn.Module, args: Any) -> None:
        saved.append(torch.Tensor.bfloat16)
        torch.Tensor.bfloat16 = _keep_dtype  # type: ignore[assignment,method-assign]

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        torch.Tensor.bfloat16 = saved.pop()  # type: ignore[method-assign]

    experts.register_forward_pre_hook(enter)
    experts.register_forward_hook(leave, always_call=True)


def _titan_gate_in_fp32(gate: nn.Linear) -> None:
    """Run torchtitan's router gate in fp32 on a CPU bf16 row (weights kept in fp32).

    NOTE: torchtitan computes the gate under ``torch.autocast(dtype=torch.float32)``, which CUDA
    honours but CPU autocast refuses ("only supports bf16/fp16", it disables itself), so on CPU
    the bf16 rows would route with bf16 scores. Casting the gate's input to fp32 (its weight
    holds the same bf16-rounded values as forge's) gives what torchtitan computes on a GPU and
    what forge's fp32 router computes: the same top-k choices.
    """

    def to_fp32(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (args[0].float(), *args[1:])

    gate.register_forward_pre_hook(to_fp32)


def build_torchtitan(
    shape: Shape, forge: MoE, dtype: torch.dtype, device: torch.device, ep: int
) -> Any:
    """torchtitan's MoE with ``forge``'s (unsharded) weights; parallelized over EP when ep > 1."""
    import spmd_types as spmd
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    # NOTE: torchtitan's default SPMD backend ("spmd_types") needs the trainer's SPMD mesh
    # context: a standalone MoE fails in AllToAllTokenDispatcher.dispatch
    # (current_spmd_mesh() is None). "partial_dtensor" is the DTensor backend it also supports.
    set_spmd_backend("partial_dtensor")
    d, h, e, k = shape.dim, shape.hidden, shape.experts, shape.top_k
    cfg = make_moe_config(
        num_experts=e,
        router=make_router_config(
            dim=d,
            num_experts=e,
            gate_param_init={},
            top_k=k,
            score_func=shape.score,
            route_norm=shape.score == "sigmoid",
            route_scale=1.0,
        ),
        routed_experts=make_routed_experts_config(
            dim=d, hidden_dim=h, num_experts=e, top_k=k, param_init={}, comm_backend="standard"
        ),
        shared_experts=make_ffn_config(
            dim=d, hidden_dim=h * shape.shared, w1_param_init={}, w2w3_param_init={}
        )
        if shape.shared
        else None,
    )
    if ep > 1:
        set_moe_sharding_config(
            cfg,
            enable_ep=True,
            enable_sp=False,
            expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)},
        )
    with torch.device("meta"):
        titan = cfg.build()
    gate_fp32 = device.type == "cpu" and dtype == torch.bfloat16
    if device.type == "cpu":
        # NOTE: its router's autocast(float32) warns on CPU at every forward; fp32 rows need no
        # autocast and bf16 rows get _titan_gate_in_fp32 instead, so the warning is noise here.
        warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
    for name, p in titan.named_parameters():
        keep = gate_fp32 and name == "router.gate.weight"
        p.data = p.data.to(torch.float32 if keep else dtype)
    titan.to_empty(device=device)
    with torch.no_grad():
        for b in titan.buffers():
            b.zero_()
        inner = titan.routed_experts.inner_experts
        inner.w1_EFD.copy_(forge.experts.w1.transpose(1, 2))
        inner.w2_EDF.copy_(forge.experts.w2.transpose(1, 2))
        inner.w3_EFD.copy_(forge.experts.w3.transpose(1, 2))
        titan.router.gate.weight.copy_(forge.router.gate.weight)
        if shape.shared:
            for w in ("w1", "w2", "w3"):
                getattr(titan.shared_experts, w).weight.copy_(
                    getattr(forge.shared_expert, w).weight
                )
    if dtype == torch.float32:
        _titan_experts_in_input_dtype(inner)
    if gate_fp32:
        _titan_gate_in_fp32(titan.router.gate)
    if ep > 1:
        titan.parallelize(_titan_parallel_dims(ep))
    titan.train()
    return titan


# --------------------------------------------------------------------------- forge
_FORGE_MESH: dict[int, Any] = {}


def _forge_config(shape: Shape, dispatch: str) -> MoEModelConfig:
    return MoEModelConfig(
        vocab_size=256,
        dim=shape.dim,
        n_layers=1,
        n_heads=max(1, shape.dim // 64),
        moe_every=1,
        num_experts=shape.experts,
        top_k=shape.top_k,
        moe_ffn_dim=shape.hidden,
        num_shared_experts=shape.shared,
        router=shape.score,
        moe_dispatch=dispatch,
        capacity_factor=CAPACITY_FACTOR,
    )


def build_forge(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> MoE:
    """forge's dropless MoE, unsharded, deterministic weights (std 0.02), parameters in ``dtype``.

    NOTE: built on the meta device and materialized in ``dtype``: an fp32 DeepSeek-V3-size layer
    would need 45 GB for its experts before the cast. Only the parameters are cast (as FSDP2's
    param_dtype does); the router's fp32 buffers stay fp32.
    """
    with torch.device("meta"):
        moe = MoE(_forge_config(shape, "dropless"), 0)
    for p in moe.parameters():
        p.data = p.data.to(dtype)
    moe.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for b in moe.buffers():
            b.zero_()
        for _, p in sorted(moe.named_parameters()):
            p.normal_(0.0, 0.02, generator=gen)
    moe.train()
    return moe


def forge_capacity_sharing(shape: Shape, base: MoE, device: torch.device) -> MoE:
    """A capacity-mode MoE on ``base``'s router, experts and shared expert (their EP hooks come
    with them: the capacity layer's experts take the equal-split exchange, with no host sync)."""
    with torch.device("meta"):
        moe = MoE(_forge_config(shape, "capacity"), 0)
    moe.router, moe.experts, moe.shared_expert = base.router, base.experts, base.shared_expert
    # NOTE: not to_empty(): that would re-materialize the shared modules; only the counters are
    # the capacity layer's own.
    moe.tokens_routed = torch.zeros((), dtype=torch.int64, device=device)
    moe.tokens_dropped = torch.zeros((), dtype=torch.int64, device=device)
    moe.train()
    return moe


def forge_expert_parallel(moe: MoE, ep: int, num_experts: int) -> None:
    """Shard ``moe``'s experts over an ``ep`` axis of ``dp_shard = ep`` CPU/CUDA ranks."""
    from forge_mesh import build_device_mesh
    from forge_moe_ep import apply_expert_parallel

    if ep not in _FORGE_MESH:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        _FORGE_MESH[ep] = build_device_mesh(
            {"dp_shard": ep, "ep": ep}, device_type, num_experts=num_experts
        )
    apply_expert_parallel(moe, _FORGE_MESH[ep])


# --------------------------------------------------------------------------- one row
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _counter(moe: MoE, name: str) -> int:
    """One of the layer's 0-d counter buffers, read on the host (outside the timed calls)."""
    return int(getattr(moe, name))


def _param_pairs(forge: MoE, titan: Any) -> Iterator[tuple[str, Any, Any]]:
    """(label, forge parameter, torchtitan parameter in forge's layout) for the gradient check."""
    inner = titan.routed_experts.inner_experts
    yield "gate", forge.router.gate.weight, (titan.router.gate.weight, False)
    for w, tw in (("w1", "w1_EFD"), ("w2", "w2_EDF"), ("w3", "w3_EFD")):
        yield w, getattr(forge.experts, w), (getattr(inner, tw), True)
    if forge.shared_expert is not None:
        for w in ("w1", "w2", "w3"):
            fw = getattr(forge.shared_expert, w).weight
            yield f"shared {w}", fw, (getattr(titan.shared_experts, w).weight, False)


@contextmanager
def _capture_topk(router: nn.Module, position: int, into: list[torch.Tensor]) -> Iterator[None]:
    """Record the top-k expert ids (output ``position`` of ``router``) of each forward."""

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        ids = _local(out[position]).detach()
        into.append(ids.reshape(-1, ids.shape[-1]))

    handle = router.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


class Runner:
    """A layer's timed calls on fixed inputs: ``forward`` and ``train_step`` (forward+backward).

    ``barrier``: end every call with ``dist.barrier()`` (EP: a call is timed until every rank has
    finished it). Gradients are dropped after each step, so at most one variant holds them.
    """

    def __init__(
        self, layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, barrier: bool
    ) -> None:
        self.layer, self.grad, self.barrier = layer, grad, barrier
        self.input = x.detach().clone().requires_grad_()
        self.params = list(layer.parameters())

    def _done(self) -> None:
        if self.barrier:
            dist.barrier()

    def forward(self) -> None:
        self.layer(self.input)
        self._done()

    def train_step(self) -> None:
        self.layer(self.input).backward(self.grad)
        for p in self.params:
            p.grad = None
        self.input.grad = None
        self._done()

    def checked_step(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, str]:
        """One forward+backward under ``count_host_syncs``: (out, dx, syncs, ops); keeps grads."""
        self.input.grad = None
        with count_host_syncs(device) as counter:
            out = self.layer(self.input)
            out.backward(self.grad)
        sync(device)
        assert self.input.grad is not None
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(counter.ops.items()))
        return out.detach().float(), self.input.grad.detach().float(), counter.count, ops

    def drop_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self.input.grad = None


def compare(
    forge: MoE,
    titan: Any,
    ids: dict[str, list[torch.Tensor]],
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, float]:
    """Forge dropless vs torchtitan after one forward+backward each (gradients still held)."""
    a = torch.sort(ids[DROPLESS][0], dim=-1).values
    b = torch.sort(ids[TITAN][0], dim=-1).values
    res = {
        "topk_agree": (a == b).all(-1).float().mean().item(),
        "out_diff": (outs[DROPLESS][0] - outs[TITAN][0]).abs().max().item(),
        "dx_diff": (outs[DROPLESS][1] - outs[TITAN][1]).abs().max().item(),
        "out_scale": outs[DROPLESS][0].abs().max().item(),
        "dw_diff": 0.0,
    }
    for _, fp, (tp, transposed) in _param_pairs(forge, titan):
        fg, tg = _local(fp.grad), _local(tp.grad)
        res["dw_diff"] = max(res["dw_diff"], _max_abs_diff(fg, tg, transposed))
    return res


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor, transposed: bool) -> float:
    """max |a - b| (``b`` transposed in its last two dims when asked), one leading slice at a
    time in fp32: a DeepSeek-V3-size expert gradient is 7.5 GB in bf16, and converting it whole
    ran a 141 GB GPU out of memory (H200, 2026-11-27)."""
    if a.dim() < 3:  # router gate, shared expert: stored alike on both sides
        return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    worst = torch.zeros((), device=a.device)
    for x, y in zip(a, b, strict=True):
        y = y.t() if transposed else y
        worst = torch.maximum(worst, (x.float() - y.float()).abs().max())
    return worst.item()


def run_point(
    point: Point, ep: int, reps: int, warmup: int, with_titan: bool, with_capacity: bool = True
) -> dict[str, Any]:
    """Build, check and time one row in this process (every rank runs it under EP)."""
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = DTYPES[point.dtype]
    shape = point.shape
    rank = dist.get_rank() if ep > 1 else 0
    forge = build_forge(shape, dtype, device)
    titan = build_torchtitan(shape, forge, dtype, device, ep) if with_titan else None
    if ep > 1:
        forge_expert_parallel(forge, ep, shape.experts)
    capacity = forge_capacity_sharing(shape, forge, device)
    layers: dict[str, nn.Module] = {DROPLESS: forge}
    if titan is not None:
        layers[TITAN] = titan
    if with_capacity:
        layers[CAPACITY] = capacity
    gen = torch.Generator(device="cpu").manual_seed(1000 + rank)  # EP: each rank its own tokens
    x = torch.randn(point.batch, point.seq, shape.dim, generator=gen).to(device, dtype)
    grad = torch.randn(point.batch, point.seq, shape.dim, generator=gen).to(device, dtype)
    runners = {name: Runner(layer, x, grad, barrier=ep > 1) for name, layer in layers.items()}

    # Correctness, host syncs, and the first warm-up: one checked forward+backward per variant.
    # NOTE: capacity shares the dropless layer's parameters, so its checked step runs after the
    # gradient comparison (it would add its gradients to the same .grad tensors).
    res: dict[str, Any] = {"syncs": {}, "ops": {}}
    ids: dict[str, list[torch.Tensor]] = {DROPLESS: [], TITAN: []}
    outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in runners:
        routed0, dropped0 = (
            _counter(capacity, "tokens_routed"),
            _counter(capacity, "tokens_dropped"),
        )
        router = {DROPLESS: forge.router, TITAN: titan.router if titan else None}.get(name)
        with _capture_topk(router, 1, ids[name]) if router is not None else nullcontext():
            out, dx, count, ops = runners[name].checked_step(device)
        res["syncs"][name], res["ops"][name] = count, ops
        outs[name] = (out, dx)
        if name == TITAN:
            assert titan is not None
            res.update(compare(forge, titan, ids, outs))
            runners[DROPLESS].drop_grads()
        if name == CAPACITY:
            routed = _counter(capacity, "tokens_routed") - routed0
            res["dropped"] = (_counter(capacity, "tokens_dropped") - dropped0) / max(routed, 1)
        if name != DROPLESS or titan is None:  # dropless keeps its gradients for compare()
            runners[name].drop_grads()
    del outs, ids

    fns: dict[str, Callable[[], object]] = {}
    for name, runner in runners.items():
        fns[f"{name}|{FWD}"] = runner.forward
        fns[f"{name}|{FWDBWD}"] = runner.train_step
    timed = time_interleaved(fns, device, reps, warmup)
    res["ms"] = {key: med for key, (med, _) in timed.items()}
    return res


def run_point_safe(
    point: Point, ep: int, reps: int, warmup: int, with_titan: bool, with_capacity: bool
) -> dict[str, Any]:
    """:func:`run_point`, with a failure (e.g. out of memory) reported in the result instead."""
    try:
        return run_point(point, ep, reps, warmup, with_titan, with_capacity)
    except Exception as exc:  # noqa: BLE001 -- keep the other rows
        traceback.print_exc()
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    # NOTE: out of the except block, so the traceback's frames (and their tensors) are gone.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"error": error}


def merge_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """EP: the larger of the ranks' medians, worst agreement and differences, max sync count."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    first = results[0]
    merged: dict[str, Any] = {
        "ms": {k: max(r["ms"][k] for r in results) for k in first["ms"]},
        "syncs": {k: max(r["syncs"][k] for r in results) for k in first["syncs"]},
        "ops": first["ops"],
        "sync_ranks": {k: [r["syncs"][k] for r in results] for k in first["syncs"]},
    }
    if "dropped" in first:
        merged["dropped"] = sum(r["dropped"] for r in results) / len(results)
    if "topk_agree" in first:
        merged["topk_agree"] = min(r["topk_agree"] for r in results)
        for key in ("out_diff", "dx_diff", "dw_diff", "out_scale"):
            merged[key] = max(r[key] for r in results)
    return merged


def grouped_mm_layout_probe() -> str:
    """CPU: one ``torch._grouped_mm`` of the same bf16 operands in three memory layouts, and fp32.

    NOTE: both sides call the same CPU kernel, whose bf16 speed depends on the layout:
    torchtitan passes its ``[E, N, K]`` weights as stored (forward: a column-major weight;
    dX: a row-major one, both with row-major activations); forge's torch path copies the rows
    into a column-major operand for 16-bit GEMMs on CPU (forge_kernels.grouped_gemm,
    ``_CPU_COLUMN_MAJOR_FWD`` / ``_DX``). This explains the CPU bf16 ratios.
    """
    e, m, k, n = 128, 8192, 512, 192  # Qwen3-like reduced, 1,024 tokens x top-8: the w1 GEMM
    gen = torch.Generator().manual_seed(0)
    offs = (torch.arange(1, e + 1) * (m // e)).to(torch.int32)
    times = {}
    for dtype, name, x_col, w_col in (
        (torch.bfloat16, "bf16 rows x row-major weights", False, False),
        (torch.bfloat16, "bf16 rows x column-major weights", False, True),
        (torch.bfloat16, "bf16 column-major rows x row-major weights", True, False),
        (torch.float32, "fp32 rows x row-major weights", False, False),
    ):
        x = torch.randn(m, k, generator=gen).to(dtype)
        x = x.t().contiguous().t() if x_col else x
        w = torch.randn(e, n, k, generator=gen).to(dtype).transpose(1, 2)
        w = w if w_col else w.contiguous()
        torch._grouped_mm(x, w, offs=offs)
        t0 = time.perf_counter()
        torch._grouped_mm(x, w, offs=offs)
        times[name] = (time.perf_counter() - t0) * 1e3
    return (
        f"one `torch._grouped_mm` of {m}x{k} rows by {e} experts' {k}x{n} weights on this CPU: "
        + ", ".join(f"{name} {ms:.0f} ms" for name, ms in times.items())
    )


# --------------------------------------------------------------------------- report
def _ms(v: float | None) -> str:
    return "—" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def results_table(rows: list[dict[str, Any]], layout: str, titan_note: str) -> list[str]:
    lines = [
        "| shape | tokens | dtype | pass | forge dropless ms | torchtitan ms | "
        "forge/torchtitan | forge capacity ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["layout"] != layout:
            continue
        p: Point = row["point"]
        head = f"| {p.shape.name} | {p.tokens} | {p.dtype}"
        if "error" in row:
            lines.append(f"{head} | — | error: {row['error']} | | | | |")
            continue
        for pas in PASSES:
            f = row["ms"].get(f"{DROPLESS}|{pas}")
            t = row["ms"].get(f"{TITAN}|{pas}")
            c = row["ms"].get(f"{CAPACITY}|{pas}")
            ratio = (
                f"**{f / t:.2f}**"
                if f and t and f / t > 1.0
                else (f"{f / t:.2f}" if f and t else "—")
            )
            cap = _ms(c) if c else "skipped"
            lines.append(
                f"{head} | {pas} | {_ms(f)} | {_ms(t) if t else titan_note} | {ratio} | {cap} |"
            )
    return lines


def check_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| layout | shape | tokens | dtype | top-k agree | max abs diff out (max abs out) | "
        "input grad | param grads | capacity dropped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            continue
        p: Point = row["point"]
        head = f"| {row['layout']} | {p.shape.name} | {p.tokens} | {p.dtype}"
        dropped = f"{100 * row['dropped']:.1f}%" if "dropped" in row else "—"
        if "topk_agree" not in row:
            lines.append(f"{head} | — | — | — | — | {dropped} |")
            continue
        lines.append(
            f"{head} | {100 * row['topk_agree']:.2f}% | {row['out_diff']:.1e} "
            f"({row['out_scale']:.2f}) | {row['dx_diff']:.1e} | {row['dw_diff']:.1e} | {dropped} |"
        )
    return lines


def sync_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| layout | shape | forge dropless | forge capacity | torchtitan |",
        "|---|---|---|---|---|",
    ]
    seen: dict[tuple[str, str], dict[str, set[str]]] = {}
    for row in rows:
        if "error" in row:
            continue
        cell = seen.setdefault((row["layout"], row["point"].shape.name), {})
        for name, count in row["syncs"].items():
            ops = row["ops"][name]
            ranks = row.get("sync_ranks", {}).get(name)
            per_rank = f" (ranks {'/'.join(map(str, ranks))})" if ranks else ""
            cell.setdefault(name, set()).add(f"{count}{per_rank}" + (f": {ops}" if ops else ""))
    for (layout, shape), cell in seen.items():
        vals = ["; ".join(sorted(cell.get(v, {"—"}))) for v in (DROPLESS, CAPACITY, TITAN)]
        lines.append(f"| {layout} | {shape} | " + " | ".join(vals) + " |")
    return lines


def evaluate(rows: list[dict[str, Any]], titan_missing: str | None) -> dict[str, Any]:
    """The three targets: (met or None, measured text) each, plus the per-row ratio list."""
    ratios = []
    for row in rows:
        if "error" in row:
            continue
        for pas in PASSES:
            f, t = row["ms"].get(f"{DROPLESS}|{pas}"), row["ms"].get(f"{TITAN}|{pas}")
            if f and t:
                p: Point = row["point"]
                label = f"{row['layout']}, {p.shape.name}, {p.tokens} tokens, {p.dtype}, {pas}"
                ratios.append((f / t, label, p.dtype, pas))
    out: dict[str, Any] = {"ratios": ratios}
    if titan_missing or not ratios:
        out["ratio"] = (None, f"no torchtitan column ({titan_missing or 'no rows'})")
    else:
        worst = max(ratios)
        meeting = sum(r[0] <= 1.0 for r in ratios)
        out["ratio"] = (
            worst[0] <= 1.0,
            f"worst {worst[0]:.2f} ({worst[1]}); {meeting} of {len(ratios)} rows <= 1.0",
        )
    ep_rows = [r for r in rows if r["layout"] == EP2 and "error" not in r]
    if not ep_rows:
        out["dropless"] = out["capacity"] = (None, "no EP=2 rows ran")
    else:
        dl = max(r["syncs"][DROPLESS] for r in ep_rows)
        cap = max(r["syncs"][CAPACITY] for r in ep_rows if CAPACITY in r["syncs"])
        titan = [r["syncs"][TITAN] for r in ep_rows if TITAN in r["syncs"]]
        peer = f"; torchtitan {max(titan)}" if titan else ""
        out["dropless"] = (dl <= 1, f"forge dropless {dl} (max over rows and ranks){peer}")
        out["capacity"] = (cap == 0, f"forge capacity {cap} (max over rows and ranks)")
    return out


def backward_ratios(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per dtype: forge/torchtitan of (forward+backward median - forward median) per row."""
    out: dict[str, list[float]] = {}
    for row in rows:
        ms = row.get("ms", {})
        keys = [f"{v}|{p}" for v in (DROPLESS, TITAN) for p in PASSES]
        if all(k in ms for k in keys):
            f = ms[f"{DROPLESS}|{FWDBWD}"] - ms[f"{DROPLESS}|{FWD}"]
            t = ms[f"{TITAN}|{FWDBWD}"] - ms[f"{TITAN}|{FWD}"]
            if f > 0 and t > 0:
                out.setdefault(row["point"].dtype, []).append(f / t)
    return out


def reading(
    rows: list[dict[str, Any]],
    ev: dict[str, Any],
    titan_missing: str | None,
    on_cuda: bool,
    probe: str | None,
    info: dict[str, str],
) -> list[str]:
    lines = []
    if titan_missing:
        lines.append(
            f"- **The torchtitan column is missing**: torchtitan does not import here "
            f"({titan_missing}); install it with `uv sync --group bench` (on the lent GPU "
            "machine, carry a virtual environment that has it). The forge rows still ran."
        )
    else:
        met, measured = ev["ratio"]
        lines.append(f'- Target "{TARGET_RATIO}": **{"met" if met else "not met"}** ({measured}).')
        groups: dict[tuple[str, str], list[float]] = {}
        for r, _, dtype, pas in ev["ratios"]:
            groups.setdefault((dtype, pas), []).append(r)
        for (dtype, pas), rs in groups.items():
            lines.append(
                f"- {dtype} {pas}: {sum(r <= 1.0 for r in rs)} of {len(rs)} rows meet it "
                f"(ratios {min(rs):.2f} to {max(rs):.2f}, both layouts)."
            )
        bad = sorted(((r, lab) for r, lab, _, _ in ev["ratios"] if r > 1.0), reverse=True)
        if bad:
            lines.append(
                "- Rows over 1.0 (forge slower), worst first: "
                + "; ".join(f"{lab} ({r:.2f})" for r, lab in bad)
                + "."
            )
        backward = backward_ratios(rows)
        if backward:
            lines.append(
                "- The backward alone (forward+backward minus forward, per row): forge/torchtitan "
                + ", ".join(
                    f"{dtype} {min(rs):.2f} to {max(rs):.2f}" for dtype, rs in backward.items()
                )
                + "."
            )
    for key, target in (("dropless", TARGET_DROPLESS_SYNCS), ("capacity", TARGET_CAPACITY_SYNCS)):
        met, measured = ev[key]
        verdict = "n/a" if met is None else ("met" if met else "not met")
        lines.append(f'- Target "{target}": **{verdict}** ({measured}).')
    errors = [r for r in rows if "error" in r]
    if errors:
        lines.append(
            "- **Rows that failed**: "
            + "; ".join(
                f"{r['layout']}, {r['point'].shape.name}, {r['point'].tokens} tokens, "
                f"{r['point'].dtype}: {r['error']}"
                for r in errors
            )
            + "."
        )
    if not on_cuda:
        lines.append(
            f"- Noise: a shared 2-core machine (load average "
            f"{info.get('load average at start (1/5/15 min)', '?')} at the start, "
            f"{info.get('load average at end (1/5/15 min)', '?')} at the end). The variants run "
            "round-robin, so they share the disturbance, but with this few rounds read ratios "
            "within ~0.9 to 1.1 as ties."
        )
        lines.append(
            "- CPU caveats: both sides run their expert GEMMs through the same "
            "`torch._grouped_mm` CPU kernel, so fp32 ratios measure the layer around the GEMMs "
            "(router, permutation, all-to-alls, combine) plus GEMM noise. A host sync costs "
            "nothing on CPU (no device queue to drain): the sync counts are the ops that *would* "
            "sync a GPU."
        )
        lines.append(
            "- **GPU rows are missing**: this run had no GPU. On one, the script runs the "
            "full-size expert shapes in bf16 in one process: "
            + "; ".join(
                f"{p.shape.label()} at {p.tokens} tokens"
                for p in plan_points(on_cuda=True, quick=False)
            )
            + "."
        )
    else:
        lines.append(
            "- EP=2 is not run on a single GPU (it needs two devices); the EP sync counts and "
            "EP timings come from the CPU run."
        )
    if probe:
        lines.append(
            f"- CPU bf16 rows are decided by the GEMM kernel's operand layout ({probe}). "
            "forge's torch path gives 16-bit GEMMs on CPU the fast layout (a column-major copy "
            "of the rows: forward and dX); torchtitan passes its `[E, N, K]` weights as "
            "stored, so its forward gets the column-major weight and its dX GEMMs the "
            "row-major one, the slowest. That, not the MoE plumbing, decides the CPU bf16 "
            "ratios; it says nothing about a GPU."
        )
    return lines


def write_markdown(
    out: Path,
    info: dict[str, str],
    rows: list[dict[str, Any]],
    layouts: list[str],
    titan_missing: str | None,
    on_cuda: bool,
    reps: int,
    wall_s: float,
    ev: dict[str, Any],
    probe: str | None,
) -> list[str]:
    titan_note = "missing" if titan_missing else "—"
    method = [
        '- Variants: `forge dropless` (`moe_dispatch="dropless"`), `forge capacity` '
        f"(`capacity_factor={CAPACITY_FACTOR}`, sharing the dropless layer's weights), and "
        "`torchtitan`: `torchtitan.models.common.moe.MoE` built with torchtitan's own "
        "`make_moe_config` / `make_router_config` / `make_routed_experts_config` / "
        '`make_ffn_config` (`comm_backend="standard"`), holding the same weights (experts '
        "transposed into torchtitan's `w1_EFD` / `w2_EDF` / `w3_EFD` layout).",
        "- Router settings both support identically: Qwen3-like: softmax, top-k weights not "
        "renormalized (torchtitan `route_norm=False`; real Qwen3 renormalizes, forge's softmax "
        "router does not). DeepSeek-V3-like: sigmoid, normalized over the top-k "
        "(`route_norm=True`), `route_scale=1.0`, no node-limited routing (DeepSeek-V3 uses 2.5 "
        "and 8 groups / 4 limited; forge has neither). Expert bias present and zero on both; the "
        "gate in fp32 on both.",
        "- EP=2: 2 gloo processes (`forge_core.testing.RankPool(2)`, one torch thread each); "
        "forge's `ep` group from `forge_mesh.build_device_mesh({dp_shard: 2, ep: 2})` + "
        "`forge_moe_ep.apply_expert_parallel`; torchtitan's from `set_moe_sharding_config("
        "enable_ep=True)` + `MoE.parallelize(ParallelDims(dp_shard=2, ep=2, "
        'spmd_backend="partial_dtensor"))` (its `AllToAllTokenDispatcher`; the default '
        "`spmd_types` backend needs the trainer's SPMD mesh context and fails standalone). Each "
        "rank holds half the experts and routes its own tokens. Every timed call ends with a "
        "barrier; a row shows the larger of the two ranks' medians.",
        "- Patches to torchtitan (in this script, each with a NOTE): fp32 rows make "
        "`Tensor.bfloat16` a no-op while `GroupedExperts.forward` runs, because it hard-codes "
        "bf16 expert GEMMs (no option); CPU bf16 rows feed its router gate fp32 (weight kept in "
        "fp32 with the same bf16-rounded values), because its `autocast(dtype=float32)` "
        "disables itself on CPU; on a CPU-only machine its `ParallelDims` mesh is made a `cpu` "
        "mesh (it falls back to `cuda`).",
        "- Passes: `forward` is the forward of a training step (input requires grad, autograd "
        "records, the graph is dropped); `forward+backward` adds the backward into the input "
        "and all parameters (gradients dropped after each call). The six (variant, pass) calls "
        f"of a row run round-robin in one `time_interleaved` call: medians of {reps} rounds, "
        "after one checked forward+backward per variant (correctness and host syncs) and "
        + (
            "3 warm-up rounds. "
            if on_cuda
            else "1 warm-up round for fp32 rows (none for bf16 rows: a CPU bf16 round takes "
            "~25 s and the checked step already ran every path). "
        )
        + ("CUDA events, synchronized." if on_cuda else "`time.perf_counter`."),
        "- Correctness (same run, forge dropless vs torchtitan): top-k expert sets per token, "
        "max abs difference of the output, the input gradient and every parameter gradient; "
        "host syncs: `forge_core.testing.count_host_syncs` around the checked "
        "forward+backward on every rank.",
        f"- Wall time of this run: {wall_s / 60:.1f} min.",
    ]
    cap_skipped = any("ms" in r and f"{CAPACITY}|{FWD}" not in r["ms"] for r in rows)
    if not on_cuda and cap_skipped:
        method.insert(
            -1,
            "- CPU bf16 rows run at 1,024 tokens only and without the capacity column (no "
            "target; ~40% of a bf16 round): CPU bf16 grouped GEMMs are slow, and a 4,096-token "
            "bf16 round takes minutes. `--cpu-bf16-full` runs both (~+30 min).",
        )
    lines = [
        "# MoE layer: forge vs torchtitan " + (info.get("torchtitan", "")),
        "",
        "Written by `uv run python tools/bench_moe.py`; rerun it to refresh this page.",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in info.items()],
        "",
        "## Method",
        "",
        *method,
        "",
    ]
    for layout in layouts:
        lines += [
            f"## {layout}: median ms per call",
            "",
            *results_table(rows, layout, titan_note),
            "",
        ]
    lines += [
        "## Correctness (forge dropless vs torchtitan, same run)",
        "",
        *check_table(rows),
        "",
        "## Host syncs per MoE forward+backward (`count_host_syncs`, every rank)",
        "",
        *sync_table(rows),
        "",
        "## Reading",
        "",
        *reading(rows, ev, titan_missing, on_cuda, probe, info),
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return lines


# --------------------------------------------------------------------------- main
def _progress(t_start: float, layout: str, point: Point, res: dict[str, Any]) -> None:
    ms = res.get("ms", {})
    times = ", ".join(f"{k} {v:.1f}" for k, v in ms.items()) or res.get("error", "")
    print(
        f"[{time.perf_counter() - t_start:5.0f} s] {layout} | {point.shape.name} | "
        f"{point.tokens} tokens | {point.dtype}: {times}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--reps", type=int, default=None, help="timed rounds (default 5 CPU, 20 GPU)"
    )
    parser.add_argument("--quick", action="store_true", help="one tiny shape, 3 reps (seconds)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--out", type=Path, default=OUT_MD, help=f"the page to write (default {OUT_MD.name})"
    )
    parser.add_argument(
        "--cpu-bf16-full",
        action="store_true",
        help="CPU: bf16 rows at 4,096 tokens too and with capacity (slow CPU bf16 GEMMs: ~+30 min)",
    )
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        torch.set_num_threads(1)  # NOTE: as each EP rank; stable on a shared machine
    titan_missing = torchtitan_missing()
    with_titan = titan_missing is None
    points = plan_points(on_cuda, args.quick, args.cpu_bf16_full)
    reps = args.reps or (3 if args.quick else 20 if on_cuda else 5)

    def with_capacity(point: Point) -> bool:
        # NOTE: the capacity column is an extra (no target); on CPU a bf16 capacity call costs
        # ~40% of a bf16 round, so CPU bf16 rows skip it unless --cpu-bf16-full.
        return on_cuda or args.quick or point.dtype == "fp32" or args.cpu_bf16_full

    # NOTE: EP=2 needs two devices; on one GPU the single-process rows are what can be measured.
    layouts = [SINGLE] if on_cuda else [SINGLE, EP2]
    info = machine_facts(("triton", "torchtitan"))
    if titan_missing:
        info["torchtitan"] = f"missing ({titan_missing})"
    print(info, flush=True)

    rows: list[dict[str, Any]] = []
    for point in points:
        warmup = warmup_rounds(on_cuda, point.dtype)
        res = run_point_safe(point, 1, reps, warmup, with_titan, with_capacity(point))
        rows.append({"layout": SINGLE, "point": point, **res})
        _progress(t_start, SINGLE, point, res)
    if EP2 in layouts:
        with RankPool(2) as pool:
            for point in points:
                warmup = warmup_rounds(on_cuda, point.dtype)
                try:
                    per_rank = pool.run(
                        run_point_safe,
                        point,
                        2,
                        reps,
                        warmup,
                        with_titan,
                        with_capacity(point),
                        timeout=900.0,
                    )
                    res = merge_ranks(per_rank)
                except Exception as exc:  # noqa: BLE001 -- e.g. a hang: the pool restarts
                    res = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                rows.append({"layout": EP2, "point": point, **res})
                _progress(t_start, EP2, point, res)
    probe = None if on_cuda or args.quick else grouped_mm_layout_probe()
    info["load average at end (1/5/15 min)"] = "/".join(f"{x:.1f}" for x in os.getloadavg())
    wall_s = time.perf_counter() - t_start

    ev = evaluate(rows, titan_missing)
    titan_note = "missing" if titan_missing else "—"
    for layout in layouts:
        print(f"\n{layout}: median ms per call")
        print("\n".join(results_table(rows, layout, titan_note)))
    print("\n" + "\n".join(check_table(rows)))
    print("\n" + "\n".join(sync_table(rows)))
    print("\n" + "\n".join(reading(rows, ev, titan_missing, on_cuda, probe, info)))
    print(f"\nwall time {wall_s:.0f} s")
    for key, target in (
        ("ratio", TARGET_RATIO),
        ("dropless", TARGET_DROPLESS_SYNCS),
        ("capacity", TARGET_CAPACITY_SYNCS),
    ):
        met, measured = ev[key]
        record_target(BENCH, target, measured, met)
    if not args.no_write:
        write_markdown(
            args.out, info, rows, layouts, titan_missing, on_cuda, reps, wall_s, ev, probe
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    # NOTE: run main() from this file imported as ``bench_moe`` (tools/ is on sys.path as the
    # script's folder): RankPool's workers unpickle run_point_safe and Point by module name, and
    # names of __main__ would not resolve in them.
    sys.exit(importlib.import_module("bench_moe").main())

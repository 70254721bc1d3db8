"""``forge plan --search``: the layouts of a config on N ranks, ranked by predicted tokens/s per
GPU among those that fit the GPU's memory (:mod:`forge.plan_predict`'s model).

Candidates: tp in 1, 2, 4, 8 (within a node), pp in 1, 2, 4, 8, cp in 1, 2, 4 for long
sequences (:data:`LONG_CONTEXT`, or a config that asks for cp), and the data
ranks left over sharded by FSDP2 over all of them or, as HSDP, within a node (replicated
across nodes); ep as the config says (``-1``: the largest that divides). A candidate whose
rules break (:func:`forge.checks.config_problems`) is left out.

Each candidate is planned on a few ranks instead of N: its data-parallel degree cut to at most
8 (the global batch cut with it, so that each rank keeps its micro-batch), which keeps the
meta-model build to well under a second. What changes with the data-parallel degree is then
put back: the static bytes FSDP2 shards scale as ``1 / dp_shard``, and every collective's group
takes its real size and its real place on the N ranks (inside a node or across).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

from forge_core import ForgeConfigError
from forge_mesh import mesh_layout

from .checks import config_problems
from .config import ForgeConfig, load_config
from .plan import check_moe_skew, fmt_bytes, plan_layout
from .plan_predict import GPUProfile, load_gpu, predict_memory, predict_time

__all__ = ["SearchRow", "candidate_layouts", "print_search", "run_search", "search_layouts"]

#: The data-parallel degree each candidate is planned at (the rest is scaled).
PLANNED_DP = 8
#: From this sequence length on (or when the config asks for cp), cp 2 and 4 are tried too.
LONG_CONTEXT = 32768


@dataclass(frozen=True)
class SearchRow:
    """One layout's prediction: its degrees, peak bytes, whether it fits, speed, and what
    limits it (the dominant part of its step, or the memory)."""

    layout: dict[str, Any]
    peak_bytes: int
    fits: bool
    step_seconds: float
    tokens_per_second_per_gpu: float
    mfu: float
    limit: str


def candidate_layouts(cfg: ForgeConfig, world_size: int, gpu: GPUProfile) -> list[dict[str, Any]]:
    """The ``[parallelism]`` tables to try (rules checked), FSDP2 and HSDP per degree mix."""
    out = []
    long = cfg.training.seq_len >= LONG_CONTEXT or cfg.parallelism.cp > 1
    for tp, pp, cp in product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4) if long else (1,)):
        fixed = tp * pp * cp
        if world_size % fixed or tp > gpu.gpus_per_node:
            continue
        dp = world_size // fixed
        base: dict[str, Any] = {"tp": tp, "pp": pp, "cp": cp, "data": "fsdp2"}
        tables = [{**base, "dp_shard": dp, "dp_replicate": 1}]
        inside = max(1, gpu.gpus_per_node // (tp * cp))
        if dp > inside and dp % inside == 0:
            tables.append({**base, "dp_shard": inside, "dp_replicate": dp // inside})
        for table in tables:
            trial = dataclasses.replace(
                cfg, parallelism=dataclasses.replace(cfg.parallelism, **table)
            )
            if not config_problems(trial, world_size):
                out.append(table)
    return out


def _planned_at(
    cfg: ForgeConfig, table: dict[str, Any], world_size: int
) -> tuple[ForgeConfig, int, float]:
    """The config planned for ``table`` (its dp cut to :data:`PLANNED_DP`, the global batch
    with it), its world size, and the factor FSDP2's static bytes scale by back to N ranks."""
    shard, replicate = table["dp_shard"], table["dp_replicate"]
    small_shard = min(shard, PLANNED_DP)
    small_replicate = min(replicate, max(1, PLANNED_DP // small_shard))
    cut = (shard * replicate) // (small_shard * small_replicate)
    t = cfg.training
    if t.global_batch_size % cut:
        raise ForgeConfigError(f"global batch {t.global_batch_size} does not split by {cut}")
    small = {**table, "dp_shard": small_shard, "dp_replicate": small_replicate}
    planned = dataclasses.replace(
        cfg,
        parallelism=dataclasses.replace(cfg.parallelism, **small),
        training=dataclasses.replace(t, global_batch_size=t.global_batch_size // cut),
    )
    return planned, world_size // cut, small_shard / shard


def _row(
    cfg: ForgeConfig,
    table: dict[str, Any],
    world_size: int,
    gpu: GPUProfile,
    moe_skew: float = 1.0,
) -> SearchRow | None:
    """``table``'s prediction on ``world_size`` ranks (None: it does not plan)."""
    try:
        planned, ranks, scale = _planned_at(cfg, table, world_size)
        plan = plan_layout(planned, ranks, moe_skew=moe_skew)
    except ForgeConfigError:
        return None
    if not plan.ok or not plan.param_bytes:
        return None
    memory = predict_memory(plan, static_scale=scale)
    real = dataclasses.replace(cfg.parallelism, **table)
    names, sizes = mesh_layout(real, world_size, cfg.routed_experts)
    time = predict_time(plan, gpu, mesh=tuple(zip(names, sizes, strict=True)), parallelism=real)
    fits = memory.peak_bytes <= gpu.memory_bytes
    limit = time.dominant if fits else "memory: does not fit"
    return SearchRow(
        table,
        memory.peak_bytes,
        fits,
        time.step_seconds,
        time.tokens_per_second_per_gpu,
        time.mfu,
        limit,
    )


def search_layouts(
    cfg: ForgeConfig, world_size: int, gpu: GPUProfile, moe_skew: float = 1.0
) -> tuple[list[SearchRow], int]:
    """Every candidate's row, the fitting ones first by tokens/s per GPU (then the rest by peak
    bytes), and how many candidates were tried (``moe_skew``: see ``forge.plan.plan_layout``)."""
    check_moe_skew(moe_skew)
    candidates = candidate_layouts(cfg, world_size, gpu)
    rows = [
        r for table in candidates if (r := _row(cfg, table, world_size, gpu, moe_skew)) is not None
    ]
    rows.sort(key=lambda r: (not r.fits, -r.tokens_per_second_per_gpu if r.fits else r.peak_bytes))
    return rows, len(candidates)


def print_search(
    cfg: ForgeConfig,
    world_size: int,
    gpu: GPUProfile,
    output: str,
    top: int = 5,
    moe_skew: float = 1.0,
) -> int:
    """``forge plan --search``'s output: the best ``top`` layouts that fit, how many were
    tried; 0 when one fits, 2 when none does."""
    start = time.perf_counter()
    rows, tried = search_layouts(cfg, world_size, gpu, moe_skew)
    fitting = [r for r in rows if r.fits]
    shown = (fitting or rows)[:top]
    if output == "json":
        keys = ("layout", "peak_bytes", "fits", "step_seconds", "tokens_per_second_per_gpu")
        body = [{k: getattr(r, k) for k in (*keys, "mfu", "limit")} for r in shown]
        print(json.dumps({"gpu": gpu.name, "tried": tried, "fitting": len(fitting), "best": body}))
        return 0 if fitting else 2
    print(
        f"forge plan --search: {world_size} ranks on {gpu.description}: {tried} layouts tried, "
        f"{len(fitting)} fit ({time.perf_counter() - start:.1f} s)"
    )
    for r in shown:
        degrees = " x ".join(
            f"{k}={r.layout[k]}"
            for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
            if r.layout[k] > 1
        )
        print(
            f"  {degrees or 'one rank':<40} {r.tokens_per_second_per_gpu:>10,.0f} tok/s/GPU  "
            f"MFU {r.mfu:5.1%}  peak {fmt_bytes(r.peak_bytes):>10}  limited by {r.limit}"
        )
    if not fitting:
        print("none fits the GPU's memory: shown by peak; lower the batch or sequence, or add AC")
    return 0 if fitting else 2


def run_search(
    config: ForgeConfig | str | None,
    world_size: int,
    overrides: Sequence[str] = (),
    *,
    gpu: str | None = None,
    output: str = "text",
    moe_skew: float = 1.0,
) -> int:
    """``forge plan --search``: rank the layouts of ``config`` on ``world_size`` ranks on
    ``gpu`` (required); exit status 0 when one fits, 2 when none does or the input is bad."""
    try:
        if gpu is None:
            raise ForgeConfigError(
                "--search ranks layouts by predicted speed on a GPU: add --gpu NAME"
            )
        profile = load_gpu(gpu)
        cfg = config if isinstance(config, ForgeConfig) else load_config(config, overrides)
        return print_search(cfg, world_size, profile, output, moe_skew=moe_skew)
    except ForgeConfigError as err:
        print(f"forge plan: config error: {err}", file=sys.stderr)
        return 2

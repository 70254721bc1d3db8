"""Pre-launch checks of pipeline settings (no torch import at module level).

:func:`pp_problems` returns every problem of a ``[pp]`` section with its layout as a one-line
message naming the field and the fix; :func:`schedule_problems` whether the installed torch has
the schedule (imports torch). :func:`check_pp` raises the first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from forge_core.errors import refuse

from .config import SCHEDULES, PPConfig

__all__ = [
    "HF_PP_FAMILIES",
    "check_pp",
    "hf_pp_problems",
    "pp_problems",
    "schedule_problems",
    "stage_count",
    "stages_per_rank_problems",
]


def stage_count(pp_cfg: PPConfig, pp: int) -> int:
    """Pipeline stages in all: ``pp x stages_per_rank``."""
    return pp * pp_cfg.local_stages()


def stages_per_rank_problems(pp_cfg: PPConfig) -> list[str]:
    """``[message]`` when ``pp.stages_per_rank`` is not what ``pp.schedule`` runs (pure): the
    config check and ``pipeline_split`` (so ``ParallelPlan``) say these words."""
    info, spr = pp_cfg.info, pp_cfg.local_stages()
    if info.stages_per_rank == "one" and spr != 1:
        return [
            f"pp.schedule={pp_cfg.schedule!r} runs one stage per rank, but pp.stages_per_rank="
            f"{spr}; set stages_per_rank=1, or pick an interleaved schedule (Interleaved1F1B, "
            "InterleavedZeroBubble, LoopedBFS)"
        ]
    if info.stages_per_rank == "several" and spr < 2:
        return [
            f"pp.schedule={pp_cfg.schedule!r} interleaves several stages per rank, but "
            "pp.stages_per_rank=1; set stages_per_rank >= 2, or use 1F1B / GPipe"
        ]
    if info.stages_per_rank == "two" and spr != 2:
        return [
            f"pp.schedule={pp_cfg.schedule!r} places exactly two stages per rank (a V), but "
            f"pp.stages_per_rank={spr}; set stages_per_rank=2 (or 0)"
        ]
    return []


def pp_problems(
    pp_cfg: PPConfig,
    *,
    pp: int,
    n_layers: int,
    batch_per_rank: int,
    grad_accum: int = 1,
    tie_embeddings: bool = False,
) -> list[str]:
    """Every setting that cannot work with ``pp`` pipeline ranks (pure: no torch).

    ``batch_per_rank`` is a data-parallel rank's share of the global batch (what the schedule
    splits into micro-batches); ``n_layers`` the model's blocks.
    """
    if pp <= 1:
        return []
    info, spr = pp_cfg.info, pp_cfg.local_stages()
    problems = stages_per_rank_problems(pp_cfg)
    stages = pp * spr
    if stages > n_layers:
        problems.append(
            f"parallelism.pp={pp} x pp.stages_per_rank={spr} = {stages} stages, but the model has "
            f"{n_layers} blocks (every stage needs one); lower pp or stages_per_rank, or use a "
            f"deeper model"
        )
    points = pp_cfg.split_points
    if points and (
        len(points) != stages - 1
        or list(points) != sorted(set(points))
        or points[0] < 1
        or points[-1] >= n_layers
    ):
        problems.append(
            f"pp.split_points={list(points)} must be {stages - 1} increasing block indices in "
            f"1..{n_layers - 1} (where stages 1..{stages - 1} begin), or [] for a balanced split"
        )
    micro = pp_cfg.num_microbatches(pp)
    if info.one_f_one_b and micro < pp:
        problems.append(
            f"pp.microbatches={micro} with {pp_cfg.schedule}: a 1F1B-family schedule needs at "
            f"least one micro-batch per pipeline rank; set pp.microbatches >= {pp}"
        )
    if pp_cfg.schedule == "DualPipeV" and micro < stages:
        problems.append(
            f"pp.microbatches={micro} with DualPipeV: it needs at least one micro-batch per "
            f"stage; set pp.microbatches >= {stages}"
        )
    rounds = max(1, micro // pp)
    if pp_cfg.schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and micro % rounds:
        problems.append(
            f"pp.microbatches={micro} with {pp_cfg.schedule} on pp={pp}: torch runs it in "
            f"rounds of pp micro-batches and needs a whole number of rounds ({micro} is not a "
            f"multiple of {rounds}); use a multiple of {pp}, or fewer than {2 * pp}"
        )
    if batch_per_rank % micro:
        fits = [m for m in range(1, batch_per_rank + 1) if batch_per_rank % m == 0]
        problems.append(
            f"pp.microbatches={micro} does not divide the {batch_per_rank} samples each "
            f"data-parallel rank gets (training.global_batch_size / dp); choose one of {fits}, "
            "or change the batch size"
        )
    if grad_accum != 1:
        problems.append(
            f"training.grad_accum={grad_accum} with parallelism.pp={pp}: the pipeline's "
            "micro-batches already accumulate gradients; set grad_accum=1 and use pp.microbatches"
        )
    if tie_embeddings:
        problems.append(
            f"model.tie_embeddings=true with parallelism.pp={pp}: the embedding (first stage) and "
            "the head (last stage) cannot share one weight across pipeline ranks; use untied "
            "embeddings or pp=1"
        )
    return problems


def schedule_problems(pp_cfg: PPConfig) -> list[str]:
    """``[message]`` when the installed torch lacks the schedule class (imports torch)."""
    import torch
    import torch.distributed.pipelining.schedules as schedules

    if hasattr(schedules, pp_cfg.info.torch_class):
        if pp_cfg.info.placement == "v" and _torch_release(torch.__version__) < (2, 15):
            # NOTE: the two adjacent stages of a V share a rank; torch 2.11's stage set-up sends
            # a tensor from that rank to itself, which gloo refuses ("Pair is not connected"),
            # measured on 2.11; 2.15 skips that send. Releases in between are not tested.
            return [
                f"pp.schedule={pp_cfg.schedule!r} needs torch >= 2.15 here: torch "
                f"{torch.__version__}'s pipeline stages send from a rank to itself between the "
                "two adjacent stages of a V, which fails on gloo; use a loop-placed schedule "
                "(Interleaved1F1B, InterleavedZeroBubble) or torch 2.15"
            ]
        return []
    have = [name for name, info in SCHEDULES.items() if hasattr(schedules, info.torch_class)]
    return [
        f"pp.schedule={pp_cfg.schedule!r}: torch {torch.__version__} has no "
        f"{pp_cfg.info.torch_class}; this torch has {have}"
    ]


def _torch_release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_pp(
    pp_cfg: PPConfig,
    *,
    pp: int,
    n_layers: int,
    batch_per_rank: int,
    grad_accum: int = 1,
    tie_embeddings: bool = False,
) -> None:
    """Raise :class:`~forge_core.errors.ForgeConfigError` with the first of :func:`pp_problems`."""
    refuse(
        pp_problems(
            pp_cfg,
            pp=pp,
            n_layers=n_layers,
            batch_per_rank=batch_per_rank,
            grad_accum=grad_accum,
            tie_embeddings=tie_embeddings,
        )
    )


#: Hugging Face families (``config.model_type``) whose decoders forge-pp cuts into stages: their
#: forward is embedding -> rotary -> layers -> norm -> head, checked against one device in loss
#: and gradient norm (tests/integration/pp/test_pp_hf.py).
HF_PP_FAMILIES: tuple[str, ...] = ("llama", "qwen3", "qwen3_moe")


def hf_pp_problems(config: Mapping[str, Any], pp: int, *, model: str | None = None) -> list[str]:
    """Why a Hugging Face model with ``config`` (its config.json as a dict) cannot be cut into
    ``pp`` pipeline stages (pure: the config check before launch and the split say these words):
    a family not in :data:`HF_PP_FAMILIES`, tied embeddings, sliding-window layers, router logits
    transformers would turn into an auxiliary loss over all layers at once."""
    if pp <= 1:
        return []
    family = config.get("model_type")
    name = f"Hugging Face {family!r} model" + (f" ({model})" if model else "")
    if family not in HF_PP_FAMILIES:
        return [
            f"{name} at parallelism.pp={pp}: forge-pp cuts only {list(HF_PP_FAMILIES)} decoders "
            "into pipeline stages (their forward checked against one device); set "
            "parallelism.pp=1"
        ]
    problems = []
    if config.get("tie_word_embeddings"):
        problems.append(
            f"{name} with tie_word_embeddings=true at parallelism.pp={pp}: the embedding (first "
            "stage) and lm_head (last stage) cannot share one weight across pipeline ranks; use "
            "a model with untied embeddings or set parallelism.pp=1"
        )
    # NOTE: a config with layer_types says which layers slide (Qwen3's first max_window_layers
    # do not); one without slides everywhere once sliding_window is set (Qwen3-MoE's mask).
    layer_types = config.get("layer_types")
    if layer_types:
        windowed = any(t != "full_attention" for t in layer_types)
    else:
        windowed = config.get("sliding_window") is not None and bool(
            config.get("use_sliding_window", True)
        )
    if windowed:
        problems.append(
            f"{name} with sliding-window attention at parallelism.pp={pp}: pipeline stages mask "
            "causally only; set use_sliding_window=false (or sliding_window=null) or "
            "parallelism.pp=1"
        )
    if config.get("output_router_logits"):
        problems.append(
            f"{name} with output_router_logits=true at parallelism.pp={pp}: transformers adds its "
            "router auxiliary loss from every layer's logits at once, which pipeline stages do "
            "not gather; set output_router_logits=false or parallelism.pp=1"
        )
    return problems

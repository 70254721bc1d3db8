"""Cutting a model into pipeline stages on the meta device.

A model class that declares ``forge_pipeline_parts`` (``forge_core.contracts``: forge's
Transformer and its MoE variant do) is cut by blocks; a Hugging Face decoder of
:data:`~forge_pp.checks.HF_PP_FAMILIES` is first made to declare them (:mod:`forge_pp.hf`, its
names unchanged). Each rank keeps only what its stages need:

- the **rank model**: the model itself, pruned in place to the union of this rank's stages
  (blocks of other ranks deleted, the embedding kept only with stage 0, the final norm and head
  only with the last stage). Its parameter and state-dict names are the unsplit model's
  (``layers.5.attention.wq.weight`` stays that on whichever rank holds block 5), so checkpoints
  move between pipeline layouts. Optimizers and checkpoints use it; it is not called itself.
- one **stage module** per local stage: a new instance of the model's class holding the very
  same submodules (no copies) for that stage's blocks; the pipeline schedule calls it, and
  forge's later stages (TP, EP, Float8, AC, compile, FSDP2) apply to it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from forge_core.errors import ForgeConfigError, refuse
from forge_core.stages import check_stage, record_stage
from torch.distributed.device_mesh import DeviceMesh

from .checks import HF_PP_FAMILIES, stages_per_rank_problems
from .config import PPConfig
from .hf import is_hf_causal_lm, pipeline_hf_model

__all__ = ["PipelineSplit", "balanced_blocks", "pipeline_split", "split_model", "stage_indices"]

PARTS_ATTR = "forge_pipeline_parts"


def balanced_blocks(
    n_blocks: int, n_stages: int, split_points: tuple[int, ...] = ()
) -> list[range]:
    """The blocks of each stage: at ``split_points`` if given, else balanced.

    Balanced: the embedding (stage 0) and the final norm + head (last stage) weigh one block
    each; every stage gets at least one block; the stages' weights differ by at most one where
    that leaves every stage a block (the heavier ones first).
    """
    if not 1 <= n_stages <= n_blocks:
        raise ForgeConfigError(
            f"{n_stages} pipeline stages for {n_blocks} blocks: every stage needs a block; "
            f"use at most {n_blocks} stages"
        )
    if split_points:
        edges = [0, *split_points, n_blocks]
        if len(edges) != n_stages + 1 or any(a >= b for a, b in itertools.pairwise(edges)):
            raise ForgeConfigError(
                f"split_points={list(split_points)} must be {n_stages - 1} increasing block "
                f"indices in 1..{n_blocks - 1}"
            )
        return [range(a, b) for a, b in itertools.pairwise(edges)]
    # Weights as even as they go (differing by at most one, the heavier stages first), then
    # the embedding and the head taken out of the first and last stage's share.
    base, extra = divmod(n_blocks + 2, n_stages)
    ends = [(s == 0) + (s == n_stages - 1) for s in range(n_stages)]
    sizes = [max(1, base + (s < extra) - ends[s]) for s in range(n_stages)]
    while sum(sizes) > n_blocks:  # a stage raised to its one block: take it back elsewhere
        heaviest = max(range(n_stages), key=lambda s: (sizes[s] + ends[s], sizes[s] > 1, -s))
        sizes[heaviest] -= 1
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def stage_indices(rank: int, pp: int, stages_per_rank: int, placement: str) -> list[int]:
    """The stages pipeline rank ``rank`` holds, in increasing order.

    ``"loop"``: stage ``s`` on rank ``s % pp``. ``"v"`` (two per rank): rank ``r`` holds ``r`` and
    ``2 pp - 1 - r``, so the first and the last stage share rank 0.
    """
    if placement == "v":
        return sorted({rank, 2 * pp - 1 - rank})
    return [rank + i * pp for i in range(stages_per_rank)]


@dataclass
class PipelineSplit:
    """A rank's share of a model: the pruned rank model and its stage modules (in stage order).

    ``views``: the module paths (``""`` the root; ``"decoder"`` in a VLM) of which each stage
    module holds its own object sharing the rank model's children."""

    model: nn.Module
    stages: list[nn.Module]
    indices: list[int]
    num_stages: int
    views: list[str]


def _parts(model: nn.Module, pp: int) -> dict[str, Any]:
    parts = getattr(type(model), PARTS_ATTR, None)
    if parts is None and is_hf_causal_lm(model):
        parts = pipeline_hf_model(model, pp)  # NOTE: refuses a family it does not cut
    blocks = None
    if isinstance(parts, dict):
        try:
            blocks = model.get_submodule(str(parts.get("blocks")))
        except AttributeError:
            blocks = None
    if not isinstance(blocks, nn.ModuleDict):
        raise ForgeConfigError(
            f"{type(model).__name__} cannot be cut into pipeline stages: pipeline parallelism "
            "needs a model class that declares forge_pipeline_parts (forge's Transformer, its "
            "MoE variant and forge_vlm's VLMWrapper do) or a Hugging Face decoder of "
            f"{list(HF_PP_FAMILIES)}; set parallelism.pp=1"
        )
    assert isinstance(parts, dict)
    return parts


def _parent(path: str) -> tuple[str, str]:
    parent, _, leaf = path.rpartition(".")
    return parent, leaf


def _new_like(module: nn.Module) -> nn.Module:
    """A new object of ``module``'s class holding the same children, buffers and attributes.

    Every instance attribute is shared except nn.Module's own registries (hooks, parameters,
    children: the new object's are fresh) and forge's records (``_forge_*``: the stages applied
    to one object); a Hugging Face model's private ones (its ``_tp_plan``) come along.
    """
    view = type(module).__new__(type(module))
    nn.Module.__init__(view)  # fresh hooks and registries; the class's own __init__ is not run
    fresh = set(vars(view))
    for name, value in vars(module).items():  # plain attributes (config, ...)
        if name not in fresh and not name.startswith("_forge"):
            view.__dict__[name] = value
    view.train(module.training)
    for name, child in module.named_children():
        setattr(view, name, child)
    for name, buffer in module.named_buffers(recurse=False):
        view.register_buffer(name, buffer, persistent=False)
    return view


def _view_paths(parts: dict[str, Any]) -> list[str]:
    """Every module path a stage needs its own object of: the parents of the parts it changes."""
    paths = {""}
    for path in (parts["blocks"], *parts["first"], *parts["last"]):
        parent = _parent(path)[0]
        while parent:
            paths.add(parent)
            parent = _parent(parent)[0]
    return sorted(paths, key=lambda p: (p.count("."), p) if p else (-1, ""))


def _stage_module(
    model: nn.Module, parts: dict[str, Any], blocks: list[str], first: bool, last: bool
) -> nn.Module:
    """A stage: new objects for the root and the parents of what it changes, sharing the rest."""
    views: dict[str, nn.Module] = {}
    for path in _view_paths(parts):
        views[path] = _new_like(model.get_submodule(path))
        if path:
            parent, leaf = _parent(path)
            setattr(views[parent], leaf, views[path])
    parent, leaf = _parent(parts["blocks"])
    own = model.get_submodule(parts["blocks"])
    assert isinstance(own, nn.ModuleDict)
    setattr(views[parent], leaf, nn.ModuleDict({k: own[k] for k in blocks}))
    for path in (() if first else parts["first"]) + (() if last else parts["last"]):
        parent, leaf = _parent(path)
        setattr(views[parent], leaf, None)
    return views[""]


def split_model(
    model: nn.Module,
    *,
    pp_rank: int,
    pp: int,
    stages_per_rank: int = 1,
    placement: str = "loop",
    split_points: tuple[int, ...] = (),
) -> PipelineSplit:
    """Prune ``model`` (on meta) in place to pipeline rank ``pp_rank``'s stages and build them.

    Buffers are shared with the stage modules as registered; once the stages are materialized,
    :func:`forge_pp.share_buffers` gives the rank model theirs. A model that holds values (not
    on meta) is refused before anything is pruned.
    """
    _check_on_meta(model)
    parts = _parts(model, pp)
    blocks = model.get_submodule(parts["blocks"])
    assert isinstance(blocks, nn.ModuleDict)
    keys = list(blocks.keys())
    n_stages = pp * stages_per_rank
    ranges = balanced_blocks(len(keys), n_stages, split_points)
    local = stage_indices(pp_rank, pp, stages_per_rank, placement)
    stage_keys = {s: [keys[i] for i in ranges[s]] for s in local}
    stages = [_stage_module(model, parts, stage_keys[s], s == 0, s == n_stages - 1) for s in local]
    kept = {k for s in local for k in stage_keys[s]}
    for key in keys:
        if key not in kept:
            del blocks[key]
    dropped = (() if 0 in local else tuple(parts["first"])) + (
        () if n_stages - 1 in local else tuple(parts["last"])
    )
    for path in dropped:
        parent, leaf = _parent(path)
        setattr(model.get_submodule(parent), leaf, None)
    return PipelineSplit(model, stages, local, n_stages, _view_paths(parts))


def _check_on_meta(model: nn.Module) -> None:
    """Refuse a materialized model: the stages are parallelized, then materialized from a seed.

    NOTE: checked before pruning, which deletes this rank's other blocks from the model in place.
    """
    held = sum(not t.is_meta for t in (*model.parameters(), *model.buffers()))
    if held:
        raise ForgeConfigError(
            f"pipeline parallelism cuts a model on the meta device, but this "
            f"{type(model).__name__} holds values ({held} parameters or buffers are not on meta; "
            "cutting would delete this rank's other blocks from it); build the model under "
            "torch.device('meta') and let ParallelPlan.parallelize(model, device=..., seed=...) "
            "materialize each stage"
        )


def pipeline_split(
    model: nn.Module, device_mesh: DeviceMesh, pp_cfg: PPConfig, *, pp_rank: int | None = None
) -> PipelineSplit:
    """The first stage of forge's order: cut ``model`` (on meta) for this rank's place on the
    mesh's ``pp`` axis (or for pipeline rank ``pp_rank``: a planner building every rank's share
    in one process) as ``pp_cfg`` says, and record ``pp`` on the rank model and every stage
    module (TP, EP, Float8, AC, compile and FSDP2 then apply to each stage module)."""
    check_stage(model, "pp")
    refuse(stages_per_rank_problems(pp_cfg))
    pp_mesh = device_mesh["pp"]
    split = split_model(
        model,
        pp_rank=pp_mesh.get_local_rank() if pp_rank is None else pp_rank,
        pp=pp_mesh.size(),
        stages_per_rank=pp_cfg.local_stages(),
        placement=pp_cfg.info.placement,
        split_points=pp_cfg.split_points,
    )
    for module in (split.model, *split.stages):
        record_stage(module, "pp")
    return split

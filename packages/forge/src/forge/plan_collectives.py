"""``forge plan``'s collectives of one training step on a rank: the layers' terms
(``forge_fsdp_wrap.costs``, ``forge_tp_plans.costs``, ``forge_moe_ep.costs``, ``forge_cp.costs``,
``forge_pp.costs``) counted over what the rank holds and runs, plus the step's own reductions
(loss average, gradient norm)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn as nn
from forge_core import ParallelismConfig
from forge_core.costs import Collective, CollectiveTally
from forge_core.stages import unwrap
from forge_cp.costs import cp_collectives
from forge_fsdp_wrap.costs import ddp_collectives, fsdp_collectives
from forge_mesh.per_rank import SHARD_PLACEMENTS, unique_params
from forge_moe_ep.costs import ep_collectives, expert_load_collectives, routed_rows
from forge_pp.costs import pp_collectives
from forge_tp_plans import applied_tp_plan
from forge_tp_plans.costs import tp_collectives
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .config import ForgeConfig
from .kinds import model_kind
from .layout import Layout
from .plan_memory import PipelinePlan, itemsize_of


@dataclass(frozen=True)
class _Share:
    """What one pipeline rank runs per step (the whole model without pp): its decoder blocks,
    its forward passes (``grad_accum``, or the pipeline's micro-batches of ``micro_batch``), the
    head (last stage) or not, and its stages' neighbours on other pipeline ranks."""

    blocks: tuple[int, ...]
    passes: int
    micro_batch: int
    head: bool
    pipelined: bool = False
    sends_to: tuple[int, ...] = ()  # stages whose next stage lives on another pipeline rank
    recvs_from: tuple[int, ...] = ()  # stages whose previous stage lives on another rank


def whole_model_share(cfg: ForgeConfig, layout: Layout) -> _Share:
    passes = cfg.training.grad_accum
    return _Share(tuple(range(cfg.model.n_layers)), passes, layout.micro_batch, head=True)


def pipeline_share(pipe: PipelinePlan, r: int) -> _Share:
    """Pipeline rank ``r``'s share: its stages' blocks, one pass per micro-batch."""
    local, last = pipe.rank_stages[r], pipe.num_stages - 1
    owner = {s: q for q, stages in enumerate(pipe.rank_stages) for s in stages}
    return _Share(
        blocks=tuple(i for s in local for i in pipe.stage_blocks[s]),
        passes=pipe.microbatches,
        micro_batch=pipe.micro_batch,
        head=last in local,
        pipelined=True,
        sends_to=tuple(s for s in local if s < last and owner[s + 1] != r),
        recvs_from=tuple(s for s in local if s > 0 and owner[s - 1] != r),
    )


def step_collectives(
    cfg: ForgeConfig, layout: Layout, modules: Sequence[nn.Module], share: _Share
) -> list[Collective]:
    """Every collective of one training step on a rank holding ``modules`` (a model, or a
    pipeline rank's stage modules) and running ``share``; the rank's view where its group's
    ranks differ (rank 0's without pp, each pipeline rank's with it)."""
    m, tr, par = cfg.decoder, cfg.training, layout.parallelism
    e, b, s, acc = itemsize_of(cfg), share.micro_batch, tr.seq_len // par.cp, share.passes
    tally = CollectiveTally(group_sizes(par))
    fsdp_collectives(tally, modules, passes=acc, pipelined=share.pipelined, itemsize=e)
    params = unique_params(modules)
    if layout.data == "ddp":
        ddp_collectives(tally, params)
    top = unwrap(modules[0])
    applied = applied_tp_plan(getattr(top, "decoder", top))
    # AC full recomputes each block's forward up to its last saved tensor (w2's input / the MoE
    # combine): the attention's collectives again, the FFN's output reduction not. (What
    # selective and op AC run again is not counted yet: docs/planning.md's limits.)
    ac = int(tr.ac_mode == "full" and "decoder" in model_kind(cfg).checkpointed_components())
    moe_blocks = sum(m.is_moe_layer(i) for i in share.blocks)
    block_passes = len(share.blocks) * acc
    if par.tp > 1 and applied is not None:
        tp_collectives(
            tally,
            applied,
            dim=m.dim,
            vocab_size=m.vocab_size,
            tie_embeddings=m.tie_embeddings,
            block_passes=block_passes,
            replicated_passes=moe_blocks * acc,  # an MoE slot runs replicated: no TP inside
            head_passes=acc if share.head else 0,  # the final norm + head (the last stage's)
            ac=ac,
            tokens=b * s,
            itemsize=e,
        )
    if par.cp > 1:
        kv_dim = (m.n_kv_heads or m.n_heads) * m.head_dim
        cp_collectives(
            tally,
            b=b,
            seq_len=tr.seq_len,
            kv_dim=kv_dim,
            tp=par.tp,
            itemsize=e,
            block_passes=block_passes,
            ac=ac,
            variant=cfg.cp.variant,
            dim=m.dim,
            head_dim=m.head_dim,
            cp=par.cp,
        )
    if par.ep > 1 and moe_blocks:
        ep_collectives(tally, m, moe_blocks * acc, routed_rows(m, b, s) * m.dim * e, ac)
    _step_collectives(tally, cfg, par, params, moe_blocks)
    if share.pipelined:
        hidden = b * s * m.dim * e
        sends, recvs = len(share.sends_to), len(share.recvs_from)
        pp_collectives(tally, sends=sends, recvs=recvs, passes=acc, hidden_bytes=hidden)
    return tally.table()


def group_sizes(par: ParallelismConfig) -> dict[str, int]:
    """The size of each group name the cost terms count on (also forge.plan_predict's)."""
    return {
        "tp": par.tp,
        "ep": par.ep,
        "dp": par.dp_degree,
        "dp_replicate": par.dp_replicate,
        "dp_shard": par.dp_shard,
        "pp": par.pp,
        "cp": par.cp,
        "dp_cp": par.dp_degree * par.cp,
    }


def _step_collectives(
    tally: CollectiveTally,
    cfg: ForgeConfig,
    par: ParallelismConfig,
    params: Sequence[nn.Parameter],
    moe_blocks: int,
) -> None:
    """The step's scalar reductions: loss average, MoE expert loads, grad norm partial sums."""
    for axis in ("dp_replicate", "dp_shard", "cp"):
        tally.add("step all_reduce", axis, 4, 1, "loss average (fp32 scalar)")
    expert_load_collectives(tally, cfg.decoder, moe_blocks, cp=par.cp)
    sharded = {  # a gradient norm sums over every mesh dim some gradient is sharded on
        (_dim_name(p.device_mesh, j), p.device_mesh.shape[j]): None
        for p in params
        if isinstance(p, DTensor) and p.requires_grad
        for j, pl in enumerate(p.placements)
        if isinstance(pl, SHARD_PLACEMENTS)
    }
    for axis, size in sharded:
        tally.add("step all_reduce", axis, 4, 1, "grad norm partial sum (fp32 scalar)", size)


def mesh_dim_index(mesh: DeviceMesh, name: str) -> int:
    names = mesh.mesh_dim_names
    assert names is not None, "forge's meshes name their dims"
    return names.index(name)


def _dim_name(mesh: DeviceMesh, j: int) -> str:
    """The name of ``mesh``'s dim ``j`` (forge names every dim of the meshes it builds)."""
    names = mesh.mesh_dim_names
    assert names is not None, "forge's meshes name their dims"
    return names[j]

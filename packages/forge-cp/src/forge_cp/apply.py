"""``apply_context_parallel``: a model trains on load-balanced slices of each sequence.

What it changes, through forge_core's contracts (the model's code stays as it is):

- every attention module whose class declares ``forge_attention = "causal"`` attends through
  :class:`~forge_cp.attention.ContextParallelAttention` (exact attention across the shards),
  and is left out of per-block ``torch.compile`` (the rest of each block is compiled);
- the model gets a sequence shard function (:func:`forge_core.contracts.set_sequence_shard`):
  forge_core's training step passes inputs and targets through it, gives the model the global
  positions of its tokens (``positions=``), and sums the token count and the loss over the cp
  ranks.

Parameters are not touched: they stay replicated over cp until FSDP2 shards them over
``dp_shard x cp`` (or DDP averages over ``dp x cp``), which also sums their gradients over the
cp ranks. Order: after TP, before EP, Float8, AC, compile and FSDP2 (``forge_core.stages``).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from forge_core.contracts import (
    ATTENTION_ATTR,
    cp_problems_of,
    declared_components,
    set_attention_kernel,
    set_sequence_shard,
)
from forge_core.errors import ForgeConfigError, refuse
from forge_core.mesh_dims import axis_size, sub_mesh
from forge_core.model import check_sequence_length
from forge_core.stages import stage, unwrap
from torch.distributed.device_mesh import DeviceMesh

from .attention import ContextParallelAttention
from .checks import cp_pipeline_problems
from .config import CPConfig
from .heads import HeadParallelAttention
from .hf import HF_CP_FAMILIES, hf_config_dict, hf_cp_problems, install_hf_kernel, is_hf_model
from .sequence import balanced_order, check_shardable, shard_sequence

__all__ = ["LoadBalancedShard", "apply_context_parallel"]


class LoadBalancedShard:
    """``shard(x [B, S, ...]) -> [B, S / cp, ...]``: rank ``rank``'s two chunks of each row
    (:func:`forge_cp.sequence.shard_sequence`). With ``max_seq_len`` (the model's rotary tables'
    length) a longer ``S`` is refused in one line: only here is the whole length known.

    Packed documents: :meth:`for_documents` deals the tokens by their work instead."""

    def __init__(self, cp: int, rank: int, max_seq_len: int | None = None) -> None:
        self.cp, self.rank, self.max_seq_len = cp, rank, max_seq_len

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_seq_len is not None:
            check_sequence_length(x.shape[1], self.max_seq_len)
        return shard_sequence(x, self.cp, self.rank, dim=1)

    def for_documents(self, positions_BS: torch.Tensor) -> tuple[_IndexShard, torch.Tensor]:
        """The shard of a batch of packed documents at ``positions_BS [B, S]`` (on the CPU: read
        on the host) and the order of the whole row over the ranks (``index [S]``, what
        :class:`forge_core.documents.Documents` carries): tokens dealt by their attention work,
        ``position + 1`` summed over the rows (:func:`forge_cp.sequence.balanced_order`), in
        blocks as fine as the length allows (up to 8 per rank)."""
        length = positions_BS.shape[1]
        if self.max_seq_len is not None:
            check_sequence_length(length, self.max_seq_len)
        check_shardable(length, self.cp)
        per_rank = next(k for k in (8, 4, 2) if length % (k * self.cp) == 0)
        index = balanced_order((positions_BS + 1).sum(0), self.cp, per_rank)
        local = length // self.cp
        return _IndexShard(index[self.rank * local : (self.rank + 1) * local]), index

    def __repr__(self) -> str:
        return f"LoadBalancedShard(cp={self.cp}, rank={self.rank}, max_seq_len={self.max_seq_len})"


class _IndexShard:
    """``shard(x [B, S, ...]) -> x[:, index]``: the tokens :meth:`LoadBalancedShard.for_documents`
    dealt to this rank."""

    def __init__(self, index: torch.Tensor) -> None:
        self.index = index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(1, self.index.to(x.device))


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(type(m), ATTENTION_ATTR, None) == "causal"]


def apply_context_parallel(
    model: nn.Module, device_mesh: DeviceMesh, *, variant: str = "allgather"
) -> nn.Module:
    """Shard the sequences of ``model`` over ``device_mesh``'s ``cp`` axis; returns ``model``.

    ``variant``: how attention runs across the shards (:data:`forge_cp.config.CP_VARIANTS`):
    ``"allgather"`` (:class:`~forge_cp.attention.ContextParallelAttention`) or ``"heads"``
    (:class:`~forge_cp.heads.HeadParallelAttention`; the heads per tp rank must split over cp).

    ``device_mesh`` is the full forge mesh (``forge_mesh.build_device_mesh``) with a ``cp`` axis
    of size > 1. The model's forward must take ``positions=`` (the global position of each
    token, for RoPE) and its attention must go through forge_core's attention contract:
    forge's Transformer and MoE transformer do. A Hugging Face decoder of
    :data:`forge_cp.hf.HF_CP_FAMILIES` attends through transformers' attention interface
    instead (:mod:`forge_cp.hf`; it takes ``position_ids=``). Refused, with the reason: a model
    made of components (a vision-language model), one without such attention modules (another
    Hugging Face family), a mesh without cp, a pipeline stage (the config check's words:
    :func:`forge_cp.checks.cp_pipeline_problems`), a model with modules that cannot compute on
    sequence shards (``forge_core.contracts.cp_problems_of``: forge's MoE with the capacity
    dispatch). A model whose ``config.max_seq_len`` is set
    refuses longer sequences in one line (:class:`LoadBalancedShard`).
    """
    CPConfig(variant=variant)  # one line for an unknown variant
    cp = axis_size(device_mesh, "cp")
    if cp <= 1:
        raise ForgeConfigError(
            "apply_context_parallel needs a mesh with a cp axis of size > 1 (parallelism.cp)"
        )
    inner = unwrap(model)
    name = type(inner).__name__
    refuse(cp_pipeline_problems(cp, axis_size(device_mesh, "pp")) + cp_problems_of(inner, cp))
    hf = is_hf_model(inner)
    if hf:  # another family, dropout or soft-capping in the attention: one line
        refuse(hf_cp_problems(hf_config_dict(inner), cp))
    if declared_components(inner):
        raise ForgeConfigError(
            f"context parallelism on {name}, a model made of components (vision-language), is "
            "not supported: its image tokens would be split across ranks; set parallelism.cp=1"
        )
    attention = [] if hf else _attention_modules(inner)
    if not hf and not attention:
        raise ForgeConfigError(
            f"{name} has no attention module forge-cp can run across sequence shards (a class "
            "declaring forge_attention = 'causal', whose attention goes through "
            "forge_core.contracts.causal_attention, or a Hugging Face decoder of "
            f"{', '.join(HF_CP_FAMILIES.values())}); set parallelism.cp=1 for this model "
            "(docs/context.md says why)"
        )
    if not hf and "positions" not in inspect.signature(inner.forward).parameters:
        raise ForgeConfigError(
            f"{name}.forward takes no positions= argument: a context-parallel rank must give "
            "RoPE the global positions of its tokens; set parallelism.cp=1 for this model"
        )
    mesh = sub_mesh(device_mesh, "cp")
    rank = mesh.get_local_rank()
    with stage(inner, "cp"):
        group = mesh.get_group()
        kernel: ContextParallelAttention | HeadParallelAttention = (
            HeadParallelAttention(group, rank, cp)
            if variant == "heads"
            else ContextParallelAttention(group, rank, cp)
        )
        if hf:  # transformers' attention interface hands q, k, v to the kernel
            attention = install_hf_kernel(inner, kernel, cp)
        for module in attention:
            if not hf:
                set_attention_kernel(module, kernel)
            # NOTE: its collectives cannot be traced into a graph: per-block compile compiles
            # the block's other parts and runs the attention module eagerly (forge_core's
            # "left out of torch.compile" contract).
            module.__dict__["forge_no_compile"] = True
        config = getattr(inner, "config", None)
        max_seq_len = getattr(config, "max_seq_len", None)
        if hf:
            max_seq_len = getattr(config, "max_position_embeddings", None)
        limit = max_seq_len if isinstance(max_seq_len, int) else None
        set_sequence_shard(inner, LoadBalancedShard(cp, rank, limit))
    return model

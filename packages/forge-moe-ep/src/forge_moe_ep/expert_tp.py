"""Expert tensor parallelism: each expert's hidden dimension split over the ``tp`` axis.

Under tensor parallelism the tp ranks of a group hold the same tokens, and forge's MoE runs
whole on each of them (``MoE.forge_tp_skip``): every tp rank keeps every expert. With expert
tensor parallelism (``ParallelPlan(expert_tp=True)``, ``parallelism.expert_tp``) each tp rank
keeps ``1 / tp`` of every expert instead, as Megatron's column / row split of an MLP does:

- ``w1`` and ``w3`` ``[E, dim, hidden]`` are ``Shard(2)`` and ``w2`` ``[E, hidden, dim]`` is
  ``Shard(1)`` over ``tp`` (DTensors: checkpoints keep the unsharded shapes and reshard);
- the rows reach the experts unchanged (their gradient is summed over tp on the way back), each
  rank computes its slice of the hidden units and a partial output, and the partial outputs are
  summed over tp (a forward hook on ``experts``) before the layer weights and combines them.

The router, the shared expert and the combine stay whole on every tp rank. With an ``ep`` axis as
well, the weights are placed on the 2-D ``(ep, tp)`` mesh (``Shard(0)`` over ep, the hidden dim
over tp: :class:`~forge_moe_ep.parallel.ExpertParallel`), the tokens go to their experts' ep rank
and back as under expert parallelism alone, and the same two hooks sum over tp. Refused, in one
line: experts with biases (the output bias would be added on every tp rank), a hidden size the tp
degree does not divide, ep carved out of ``dp_shard x cp`` (no ``(ep, tp)`` mesh).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core.errors import ForgeConfigError
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .checks import expert_tp_problems
from .moe import MoE

__all__ = ["HIDDEN_DIM", "apply_expert_tensor_parallel", "layer_problems"]

#: The experts' weights and the dim of each that holds the hidden units.
HIDDEN_DIM = {"w1": 2, "w3": 2, "w2": 1}


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; the gradient summed over the tp group (the rows feed every rank's
    slice of the hidden units)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class _SumOverTP(torch.autograd.Function):
    """The partial outputs summed over the tp group; the gradient passes as it is (every tp
    rank's loss sees the same sum, so each partial output's gradient is the sum's)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def layer_problems(moe: MoE, tp: int, ep: int, cp: int = 1) -> list[str]:
    """:func:`~forge_moe_ep.checks.expert_tp_problems` of ``moe``'s experts (a converted
    Hugging Face block's hidden size and biases are its own)."""
    hidden = moe.experts.w2.shape[1]
    return expert_tp_problems(tp, ep, cp, hidden=hidden, bias=moe.experts.b2 is not None)


def apply_expert_tensor_parallel(moe: MoE, tp_mesh: DeviceMesh, *, shard: bool = True) -> MoE:
    """Split ``moe``'s experts' hidden units over ``tp_mesh`` (1-D) and install the two hooks
    (see the module docstring); returns ``moe``. Before FSDP2, once per layer. ``shard=False``:
    the weights are placed already (over ``(ep, tp)`` by :class:`~forge_moe_ep.parallel.
    ExpertParallel`); only the hooks are installed."""
    experts = moe.experts
    for name, dim in HIDDEN_DIM.items() if shard else ():
        param = getattr(experts, name, None)
        if param is None:
            continue  # w3 of experts that are not gated
        if isinstance(param, DTensor):
            raise ForgeConfigError(
                f"expert weight {name} is already a DTensor ({param.placements}); split the "
                "experts over tp before FSDP2 and only once"
            )
        sharded = distribute_tensor(param.data, tp_mesh, [Shard(dim)])
        setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    group = tp_mesh.get_group()

    def rows_in(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_SumGradOverTP.apply(args[0], group), *args[1:])

    def partial_out(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return _SumOverTP.apply(out, group)

    experts.register_forward_pre_hook(rows_in)
    experts.register_forward_hook(partial_out)
    return moe

"""The MoE layer's experts: ``E`` feed-forward networks as stacked weights, run by grouped GEMMs.

:class:`GroupedExperts` computes each expert's ``(act(x w1 + b1) * (x w3 + b3)) w2 + b2`` (gated,
forge's default: SwiGLU without biases) or ``act(x w1 + b1) w2 + b2`` (not gated: no ``w3``);
the activations are :data:`~forge_moe_ep.config.EXPERT_ACTIVATIONS`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from forge_kernels.grouped_gemm import grouped_gemm
from torch.distributed.tensor import DTensor

from .config import MoEModelConfig

__all__ = ["GroupedExperts", "expert_activation", "grouped_experts"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def expert_activation(
    h1: torch.Tensor,
    h3: torch.Tensor | None,
    act: str,
    alpha: float = 1.702,
    limit: float = 7.0,
    up_limit: float | None = None,
) -> torch.Tensor:
    """The experts' activation of gate rows ``h1`` and up rows ``h3`` (None: experts that are
    not gated, ``act(h1)``), as ``EXPERT_ACTIVATIONS`` defines each."""
    if act == "relu2":
        gate = F.relu(h1).square()
    elif act == "silu":
        gate = F.silu(h1)
    elif act in ("gelu", "gelu_tanh"):
        gate = F.gelu(h1, approximate="tanh" if act == "gelu_tanh" else "none")
    else:
        assert h3 is not None, act  # config: these read the up rows, gated experts only
        return _with_up(h1, h3, act, alpha, limit, limit if up_limit is None else up_limit)
    return gate if h3 is None else gate * h3


def _with_up(
    h1: torch.Tensor, h3: torch.Tensor, act: str, alpha: float, limit: float, up_limit: float
) -> torch.Tensor:
    """The activations that change the up rows too (clamped, soft-capped)."""
    if act == "clamped_swiglu":
        gate, up = h1.clamp(max=limit), h3.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)
    if act == "clamped_silu":
        return F.silu(h1.clamp(max=limit)) * h3.clamp(-limit, limit)
    # softcapped_swiglu, in float32: the sigmoid sees the raw gate
    gate, up = h1.float(), h3.float()
    out = _softcap(gate, limit) * torch.sigmoid(gate) * _softcap(up, up_limit)
    return out.to(h1.dtype)


class GroupedExperts(nn.Module):
    """``E`` experts as stacked weights; ``forward(rows, offs)`` runs grouped GEMMs.

    Each expert computes ``(act(x w1 + b1) * (x w3 + b3)) w2 + b2``, or without ``w3`` when not
    ``gated`` (``act`` and the optional biases: ``MoEModelConfig.expert_act`` /
    ``expert_linear_bias``; default SwiGLU, no bias). ``rows`` are expert-major; ``offs`` holds
    each expert's cumulative end row and ``offs[-1]`` must equal the number of rows (every row in
    an expert's group), as forge's dispatch modes guarantee; ``offs=None`` means equal groups
    (``rows / E`` each). See ``dispatch.ExpertsFn``.

    Under expert parallelism (applied from outside) the weights are DTensors sharded
    ``Shard(0)`` over ``ep``, each rank computes with its local ``E / ep`` experts, and forward
    hooks bring the rows of every rank's tokens routed to them in and send the results back.
    """

    w3: nn.Parameter | None
    b3: nn.Parameter | None

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        *,
        act: str = "silu",
        bias: bool = False,
        alpha: float = 1.702,
        limit: float = 7.0,
        up_limit: float | None = None,
        gated: bool = True,
    ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden)) if gated else None
        self.b1 = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, dim)) if bias else None
        self.b3 = nn.Parameter(torch.empty(num_experts, hidden)) if bias and gated else None
        self.act, self.alpha, self.limit, self.up_limit = act, alpha, limit, up_limit

    def forward(self, x: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
        w1, w2 = _local(self.w1), _local(self.w2)
        w3 = None if self.w3 is None else _local(self.w3)
        experts = w1.shape[0]
        if offs is None:
            if x.shape[0] % experts:
                raise ValueError(
                    f"GroupedExperts: {x.shape[0]} rows do not form {experts} equal groups"
                )
            offs = torch.arange(1, experts + 1, device=x.device, dtype=torch.int32)
            offs = offs * (x.shape[0] // experts)
        if torch.is_autocast_enabled(x.device.type):
            # grouped_gemm is outside autocast's op lists: cast by hand to the autocast dtype.
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
            w3 = None if w3 is None else w3.to(dtype)
        elif x.dtype != w1.dtype:
            x = x.to(w1.dtype)
        # NOTE: dense: forge's dispatch puts every row in a group (offs[-1] == rows), so no
        # masked pass over rows past offs[-1] is needed (dispatch.ExpertsFn).
        h1 = grouped_gemm(x, w1, offs, dense=True)
        h3 = None if w3 is None else grouped_gemm(x, w3, offs, dense=True)
        if self.b1 is None:
            return grouped_gemm(self._act(h1, h3), w2, offs, dense=True)
        # Each row's expert, from the group ends (no host sync): the row's bias is its expert's.
        rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
        expert = torch.searchsorted(offs, rows, right=True).clamp_(max=experts - 1)
        assert self.b2 is not None  # all or none (__init__)
        b1, b2 = (_local(b).to(h1.dtype)[expert] for b in (self.b1, self.b2))
        if h3 is not None:
            assert self.b3 is not None
            h3 = h3 + _local(self.b3).to(h1.dtype)[expert]
        return grouped_gemm(self._act(h1 + b1, h3), w2, offs, dense=True) + b2

    def _act(self, h1: torch.Tensor, h3: torch.Tensor | None) -> torch.Tensor:
        return expert_activation(h1, h3, self.act, self.alpha, self.limit, self.up_limit)


def grouped_experts(config: MoEModelConfig, dim: int) -> GroupedExperts:
    """The experts ``config`` describes, working at width ``dim`` (the model's, or a latent
    width between projections)."""
    assert config.moe_ffn_dim is not None  # NOTE: MoEModelConfig.__post_init__ fills it
    return GroupedExperts(
        config.num_experts,
        dim,
        config.moe_ffn_dim,
        act=config.expert_act,
        bias=config.expert_linear_bias,
        alpha=config.expert_act_alpha,
        limit=config.expert_act_limit,
        up_limit=config.expert_act_up_limit,
        gated=config.expert_gated,
    )

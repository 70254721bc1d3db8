"""The MoE layer's top-k token-choice router (:class:`Router`), in float32.

Its variants are :class:`~forge_moe_ep.config.MoEConfig`'s ``router_*`` fields: forge's own MoE
uses the defaults; the other values express the Hugging Face families
:mod:`forge_moe_ep.hf` converts (the scores, what the choice is made on, the group-limited
choice and how it leaves groups out, renormalisation and scale, a bias on the linear layer,
and hash routing, where a fixed table chooses the experts).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Router"]


def _score(logits: torch.Tensor, score: str) -> torch.Tensor:
    """The router's scores of ``logits`` (``MOE_ROUTERS``)."""
    if score == "softmax":
        return logits.softmax(-1)
    if score == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


class Router(nn.Module):
    """Top-k token-choice router, float32, with an expert bias used only for choosing.

    ``score``: ``softmax``, ``sigmoid`` or ``sqrtsoftplus`` of the logits. The variants
    (``MoEModelConfig``'s ``router_*`` fields): ``renormalize`` the chosen weights to sum to one
    (None: for sigmoid with ``top_k > 1``; the sum clamped below at ``renormalize_min``),
    multiply them by ``scale``, choose only within the ``topk_groups`` best of ``groups`` equal
    expert groups (a group scores the sum of its ``group_top`` best biased scores; the others
    are left out as ``group_mask`` says), choose on the biased scores or the biased raw logits
    (``choice``), a ``bias`` on the linear layer, and a factor on the logits (``logit_scale``).
    """

    expert_bias: torch.Tensor  # buffers (typed for checkers: register_buffer sets them)
    tokens_per_expert: torch.Tensor

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score: str,
        *,
        renormalize: bool | None = None,
        scale: float = 1.0,
        groups: int = 1,
        topk_groups: int = 1,
        group_top: int = 2,
        bias: bool = False,
        choice: str = "scores",
        group_mask: str = "exclude",
        renormalize_min: float = 0.0,
        logit_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.score = num_experts, top_k, score
        self.renormalize = score == "sigmoid" and top_k > 1 if renormalize is None else renormalize
        self.scale, self.groups, self.topk_groups = scale, groups, topk_groups
        self.group_top, self.choice, self.group_mask = group_top, choice, group_mask
        self.renormalize_min, self.logit_scale = renormalize_min, logit_scale
        self.gate = nn.Linear(dim, num_experts, bias=bias)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False
        )

    def forward(
        self, x_TD: torch.Tensor, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, D] -> (weights [T, K] fp32, expert ids [T, K] int64, scores [T, E] fp32)``.

        ``ids``: the experts chosen already (hash routing: a fixed table of the tokens); the
        router then only weights them.
        """
        bias = self.gate.bias
        with torch.autocast(x_TD.device.type, enabled=False):
            logits = F.linear(
                x_TD.float(), self.gate.weight.float(), None if bias is None else bias.float()
            )
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        scores = _score(logits, self.score)
        if ids is None:
            ids = self._choose(logits if self.choice == "logits" else scores)
        weights = scores.gather(-1, ids)
        if self.renormalize:
            total = weights.sum(-1, keepdim=True)
            weights = weights / (
                total.clamp(min=self.renormalize_min) if self.renormalize_min else total
            )
        if self.scale != 1.0:
            weights = weights * self.scale
        return weights, ids, scores

    def _choose(self, values: torch.Tensor) -> torch.Tensor:
        """The top-k experts of each token by ``values`` plus the expert bias (no gradient)."""
        choice = values.detach() + self.expert_bias.float()
        if self.groups > 1:
            choice = self._within_best_groups(choice)
        return torch.topk(choice, self.top_k, dim=-1).indices

    def _within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with every expert outside each token's ``topk_groups`` best groups left
        out: at -inf (``exclude``) or at 0.0 (``zero``)."""
        grouped = choice.view(choice.shape[0], self.groups, -1)
        group_scores = grouped.topk(min(self.group_top, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_groups, dim=-1).indices, True)
        fill = float("-inf") if self.group_mask == "exclude" else 0.0
        return grouped.masked_fill(~keep.unsqueeze(-1), fill).view_as(choice)

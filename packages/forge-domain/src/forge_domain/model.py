"""FieldNet: a small image-like model that ``forge train`` trains with domain parallelism.

It maps a field ``[B, C, H, W]`` to the field one step later as ``x + head(body(stem(x)))``.
Every layer has a domain form (see :func:`forge_domain.apply_domain_parallel`): 3x3 convs with
zero padding in height, width-wrapping 3x3 convs (a periodic longitude), GroupNorm over the whole
field, a 1x1 head. It knows nothing about parallelism; build it on the meta device, parallelize,
then ``to_empty`` + :meth:`FieldNet.init_weights` (same values sharded or not).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from forge_core.init import fill_param_

from .config import FieldConfig
from .layers import WidthCircularConv2d

__all__ = ["FieldBlock", "FieldNet"]


class FieldBlock(nn.Module):
    """GroupNorm -> SiLU -> width-wrapping 3x3 conv, added to the input."""

    def __init__(self, hidden: int, groups: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(groups, hidden)
        self.conv = WidthCircularConv2d(hidden, hidden, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(F.silu(self.norm(x)))


class FieldNet(nn.Module):
    """``forward(x [B, C, H, W]) -> [B, C, H, W]``; blocks in ``self.blocks`` (FSDP2 and AC units)."""

    def __init__(self, config: FieldConfig) -> None:
        super().__init__()
        self.config = config
        self.stem = nn.Conv2d(config.channels, config.hidden, 3, padding=1)
        self.blocks = nn.ModuleList(
            FieldBlock(config.hidden, config.groups) for _ in range(config.n_blocks)
        )
        self.head = nn.Conv2d(config.hidden, config.channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return x + self.head(h)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Conv weights ~ U(+-1/sqrt(fan_in)), biases 0, norms 1/0, the head scaled by 0.1 so
        the untrained model starts near the identity map."""
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif ".norm." in name:
                param.fill_(1.0)
            else:
                fan_in = math.prod(param.shape[1:])  # the global shape, also for a DTensor
                bound = (0.1 if name.startswith("head") else 1.0) / math.sqrt(fan_in)

                def uniform(t: torch.Tensor, g: torch.Generator, b: float = bound) -> torch.Tensor:
                    return t.uniform_(-b, b, generator=g)

                fill_param_(param, name, seed, uniform)

"""The two collectives of domain parallelism, as autograd functions.

- :func:`halo_exchange` adds ``top`` rows from the rank above and ``bottom`` rows from the rank
  below to a height slab (zeros past the physical edge). Point-to-point sends, batched. Its
  backward sends each halo's gradient back to the rank that owns those rows, which adds it to
  its edge rows: without that, every row near a slab edge would lose part of its gradient.
- :func:`all_reduce_sum` sums a tensor over the domain group in forward and sums the incoming
  gradients in backward. Statistics combined with a plain ``dist.all_reduce`` (CREDIT's
  GroupNorm) get a forward that looks right and input gradients that are wrong, because the
  gradient of every rank's loss with respect to the shared statistic is never summed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["all_reduce_sum", "halo_exchange"]


def _exchange(
    group: ProcessGroup,
    send_up: torch.Tensor | None,
    send_down: torch.Tensor | None,
    recv_up: torch.Tensor | None,
    recv_down: torch.Tensor | None,
) -> None:
    """Send to / receive from the rank above (``up``, lower index) and below, in one batch."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ops = []
    if rank > 0:
        peer = dist.get_global_rank(group, rank - 1)
        if send_up is not None:
            ops.append(dist.P2POp(dist.isend, send_up.contiguous(), peer, group))
        if recv_up is not None:
            ops.append(dist.P2POp(dist.irecv, recv_up, peer, group))
    if rank < size - 1:
        peer = dist.get_global_rank(group, rank + 1)
        if send_down is not None:
            ops.append(dist.P2POp(dist.isend, send_down.contiguous(), peer, group))
        if recv_down is not None:
            ops.append(dist.P2POp(dist.irecv, recv_down, peer, group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,  # untyped like backward's: it carries the attributes set below
        x: torch.Tensor,
        top: int,
        bottom: int,
        group: ProcessGroup,
    ) -> torch.Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        H = x.shape[-2]
        ctx.top, ctx.bottom, ctx.group, ctx.H = top, bottom, group, H
        shape = list(x.shape)
        recv_top = x.new_zeros(shape[:-2] + [top, shape[-1]])  # zeros stay at the top edge
        recv_bottom = x.new_zeros(shape[:-2] + [bottom, shape[-1]])
        _exchange(
            group,
            send_up=x[..., :bottom, :] if bottom else None,  # the rank above's bottom halo
            send_down=x[..., H - top :, :] if top else None,  # the rank below's top halo
            recv_up=recv_top if top and rank > 0 else None,
            recv_down=recv_bottom if bottom and rank < size - 1 else None,
        )
        return torch.cat([recv_top, x, recv_bottom], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        top, bottom, H = ctx.top, ctx.bottom, ctx.H
        grad = grad.contiguous()
        g_top, g_mid, g_bottom = grad.split([top, H, bottom], dim=-2)
        g_mid = g_mid.clone()
        from_below = g_mid.new_zeros(g_mid[..., H - top :, :].shape)  # for my last `top` rows
        from_above = g_mid.new_zeros(g_mid[..., :bottom, :].shape)  # for my first `bottom` rows
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        _exchange(
            ctx.group,
            send_up=g_top if top else None,  # the rank above owns my top halo's rows
            send_down=g_bottom if bottom else None,
            recv_up=from_above if bottom and rank > 0 else None,
            recv_down=from_below if top and rank < size - 1 else None,
        )
        if top:
            g_mid[..., H - top :, :] += from_below
        if bottom:
            g_mid[..., :bottom, :] += from_above
        return g_mid, None, None, None


def halo_exchange(x: torch.Tensor, top: int, bottom: int, group: ProcessGroup) -> torch.Tensor:
    """``x [..., H_local, W]`` with ``top`` rows of the rank above and ``bottom`` rows of the rank
    below concatenated on the height dim (zeros at the first and last rank's outer edge)."""
    if top > x.shape[-2] or bottom > x.shape[-2]:
        raise ValueError(
            f"a halo of {max(top, bottom)} rows is wider than the local slab of {x.shape[-2]} rows"
        )
    return _HaloExchange.apply(x, top, bottom, group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # NOTE: every rank's loss depends on the summed value, so the gradient of the total loss
        # with respect to one rank's contribution is the sum of all ranks' incoming gradients.
        out = grad.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Differentiable sum of ``x`` over ``group`` (every rank gets the sum)."""
    return _AllReduceSum.apply(x, group)

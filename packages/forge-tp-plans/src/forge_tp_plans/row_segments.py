"""Row segments of a fused projection, and the all-to-all that moves its output rows between
the contiguous weight shards and the segments' layout (private to forge_tp_plans; the styles
that use it are in :mod:`forge_tp_plans.fused_styles`, which says why).

Provides :data:`Segments` (``(rows, split over tp ranks?)`` pairs in output order),
:func:`needed` (the rows a rank computes with), :func:`exchange` (one rank's all-to-all plan,
:class:`Exchange`), :class:`Regroup` (the autograd function that runs it, both ways) and
:func:`check_rows` (a layout that cannot split, refused in the model path's words).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from forge_core.errors import ForgeConfigError

__all__ = ["Exchange", "Regroup", "Segments", "check_rows", "exchange", "needed"]

#: Row segments of a fused projection's output: ``(rows, split over tp ranks?)`` in order.
Segments = tuple[tuple[int, bool], ...]


@dataclass(frozen=True)
class Exchange:
    """One rank's all-to-all between the contiguous layout (rank ``s`` holds rows
    ``[s*c, (s+1)*c)`` of the fused output, as ``Shard`` stores the weight) and the segments'
    layout (its slice of each split segment, all of each replicated one, in order)."""

    #: ``(local start, rows)`` ranges of this rank's contiguous rows, grouped by destination
    send: tuple[tuple[int, int], ...]
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    local_rows: int
    #: the two layouts agree on every rank: nothing to move
    identity: bool = field(default=False)


def needed(rows: Segments, tp: int, rank: int) -> list[tuple[int, int]]:
    """``(global start, rows)`` ranges rank ``rank`` computes with, in output order."""
    out, offset = [], 0
    for size, split in rows:
        out.append((offset + rank * (size // tp), size // tp) if split else (offset, size))
        offset += size
    return out


def _clip(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    clipped = [(max(s, lo), min(s + n, hi) - max(s, lo)) for s, n in ranges]
    return [(s, n) for s, n in clipped if n > 0]


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, n in ranges:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((s, n))
    return out


def exchange(rows: Segments, tp: int, rank: int) -> Exchange:
    c = sum(size for size, _ in rows) // tp
    held = (rank * c, (rank + 1) * c)
    send: list[tuple[int, int]] = []
    send_counts = []
    for dest in range(tp):
        parts = _clip(needed(rows, tp, dest), *held)
        send += [(s - held[0], n) for s, n in parts]
        send_counts.append(sum(n for _, n in parts))
    mine = needed(rows, tp, rank)
    recv_counts = [sum(n for _, n in _clip(mine, s * c, (s + 1) * c)) for s in range(tp)]
    identity = all(_merged(needed(rows, tp, r)) == [(r * c, c)] for r in range(tp))
    return Exchange(tuple(send), tuple(send_counts), tuple(recv_counts), c, identity)


def _to_segments(y: torch.Tensor, ex: Exchange, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's contiguous rows (``y``'s last dimension) -> the rows it computes with."""
    moved = y.movedim(-1, 0)
    send = torch.cat([moved.narrow(0, s, n) for s, n in ex.send]).contiguous()
    recv = send.new_empty((sum(ex.recv_counts), *moved.shape[1:]))
    dist.all_to_all_single(recv, send, list(ex.recv_counts), list(ex.send_counts), group=group)
    return recv.movedim(0, -1).contiguous()


def _to_contiguous(x: torch.Tensor, ex: Exchange, group: dist.ProcessGroup) -> torch.Tensor:
    """The rows this rank computes with -> back to their owners' contiguous rows, summed where
    several ranks held one (a replicated segment)."""
    if x.shape[-1] != sum(ex.recv_counts):
        raise ForgeConfigError(
            f"a tensor-parallel input of local size {x.shape[-1]} is not this rank's "
            f"{sum(ex.recv_counts)} rows of its segments (its slice of every part, in order)"
        )
    moved = x.movedim(-1, 0).contiguous()
    back = moved.new_empty((sum(ex.send_counts), *moved.shape[1:]))
    dist.all_to_all_single(back, moved, list(ex.send_counts), list(ex.recv_counts), group=group)
    out = moved.new_zeros((ex.local_rows, *moved.shape[1:]))
    pos = 0
    for s, n in ex.send:
        out.narrow(0, s, n).add_(back.narrow(0, pos, n))
        pos += n
    return out.movedim(0, -1)


class Regroup(torch.autograd.Function):
    """Forward: this rank's contiguous output rows -> the rows it computes with (all-to-all), or
    the other way with ``inverse``; backward moves the gradient back (contiguous: summed where
    several ranks used a row, a replicated segment)."""

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, x: torch.Tensor, ex: Exchange, group: dist.ProcessGroup, inverse: bool
    ) -> torch.Tensor:
        ctx.args = (ex, group, inverse)
        return (_to_contiguous if inverse else _to_segments)(x, ex, group).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # noqa: ANN001
        ex, group, inverse = ctx.args
        return (_to_segments if inverse else _to_contiguous)(grad, ex, group), None, None, None


def check_rows(rows: Segments, out_features: int, tp: int, path: str) -> None:
    total = sum(size for size, _ in rows)
    problems = []
    if total != out_features:
        problems.append(
            f"the segments {list(rows)} add up to {total}, not its {out_features} outputs"
        )
    if out_features % tp:
        problems.append(f"its {out_features} outputs do not split over tp={tp}")
    problems += [
        f"split segment of {size} rows does not split over tp={tp}"
        for size, split in rows
        if split and size % tp
    ]
    if problems:
        raise ForgeConfigError(f"'{path}' cannot be split by heads: {'; '.join(problems)}")

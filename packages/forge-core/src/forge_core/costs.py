"""The unit every layer's cost terms are counted in: a training step's collectives.

Each layer owns the cost terms of what it adds to a model (``forge_fsdp_wrap.costs``,
``forge_tp_plans.costs``, ``forge_moe_ep.costs``, ``forge_cp.costs``, ``forge_pp.costs``,
``forge_vlm.costs``); ``forge plan`` composes them. The layers count their collectives into one
:class:`CollectiveTally`, keyed by the mesh axis names of forge's meshes. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Collective", "CollectiveTally"]


@dataclass(frozen=True)
class Collective:
    """``count`` calls per training step in ``phase`` (forward, backward, step); ``bytes`` per
    call on the unsharded side (all-gather output, reduce-scatter input); ``group`` names the
    mesh axis of ``group_size`` ranks."""

    phase: str
    kind: str
    group: str
    group_size: int
    bytes: int
    count: int
    what: str


class CollectiveTally:
    """Collectives of one step counted by (phase, kind, group, group size, bytes, what).

    ``sizes``: the size of each group name the terms use (forge's mesh axes: ``tp``, ``ep``,
    ``dp``, ``dp_replicate``, ``dp_shard``, ``pp``, ``cp``, ``dp_cp``).
    """

    def __init__(self, sizes: Mapping[str, int]) -> None:
        self.sizes = dict(sizes)
        self.counts: dict[tuple[str, str, str, int, int, str], int] = {}

    def add(self, op: str, group: str, nbytes: int, n: int, what: str, size: int = 0) -> None:
        """``n`` calls of ``op`` ("phase kind") moving ``nbytes`` each on ``group`` (of
        ``size`` ranks, the axis size unless given); nothing on a group of one rank."""
        size = size or self.sizes[group]
        if size > 1 and n > 0:
            phase, kind = op.split()
            key = (phase, kind, group, size, nbytes, what)
            self.counts[key] = self.counts.get(key, 0) + n

    def table(self) -> list[Collective]:
        """The rows in step order (forward, backward, step), then by group and purpose."""
        order = {"forward": 0, "backward": 1, "step": 2}
        ranked = sorted(self.counts.items(), key=lambda kv: (order[kv[0][0]], kv[0][2], kv[0][5]))
        return [
            Collective(phase, kind, group, size, nbytes, count=n, what=what)
            for (phase, kind, group, size, nbytes, what), n in ranked
        ]

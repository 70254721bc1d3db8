"""Pipeline parallelism's communication in a training step, for ``forge plan``: point to point
with the neighbouring stages' ranks per micro-batch, and the step's scalar sums over the
stages. (Bubbles and in-flight micro-batches are :mod:`forge_pp.theory`'s.)"""

from __future__ import annotations

from forge_core.costs import CollectiveTally

__all__ = ["pp_collectives"]


def pp_collectives(
    tally: CollectiveTally, *, sends: int, recvs: int, passes: int, hidden_bytes: int
) -> None:
    """A pipeline rank's sends and receives on the ``pp`` axis: ``sends`` of its stages pass
    activations to a next stage on another rank, ``recvs`` take them from a previous one, each
    once per micro-batch (``passes``) of ``hidden_bytes``, the gradients coming back the other
    way; then the loss report and the grad norm summed over the stages."""
    for _ in range(sends):
        tally.add("forward send", "pp", hidden_bytes, passes, "PP: activations to the next stage")
        tally.add("backward recv", "pp", hidden_bytes, passes, "PP: their gradients back")
    for _ in range(recvs):
        tally.add(
            "forward recv", "pp", hidden_bytes, passes, "PP: activations from the previous stage"
        )
        tally.add("backward send", "pp", hidden_bytes, passes, "PP: their gradients back")
    tally.add("step all_reduce", "pp", 4, 1, "PP: loss report summed over stages (fp32 scalar)")
    tally.add("step all_reduce", "pp", 8, 1, "PP: grad norm of the other stages (fp64 scalar)")

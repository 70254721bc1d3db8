"""The validation loss of ``forge train`` (``[metrics] validation_every``): the model's mean
token loss over the first ``validation_batches`` global batches of the held-out documents
(``data.validation_fraction``), the same batches every time, so that the points of one run
(and of runs under other layouts) compare.

Every rank takes part (the forward is collective under TP, CP and FSDP2); nothing is trained: no
gradient is kept, and FSDP2's units are resharded afterwards, so that the optimizer keeps
updating the shards (:func:`forge_fsdp_wrap.reshard`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from forge_core.contracts import sequence_shard
from forge_core.mesh_dims import axis_size
from forge_core.training import IGNORE_INDEX, micro_batches, reduce_over_tokens
from forge_fsdp_wrap import reshard
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .data import Batch, StepData

__all__ = ["validation_loss"]


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    data: StepData[Batch],
    batches: int,
    mesh: DeviceMesh | None,
    device: torch.device,
) -> float:
    """The mean token loss over global batches ``0 .. batches - 1`` of ``data`` (this rank's
    slices; sums reduced over the data-parallel ranks)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        for step in range(batches):
            batch = data.batch(step)
            tokens = batch.tokens.to(device)
            targets = tokens[:, 1:]
            if batch.loss_mask is not None:
                targets = targets.masked_fill(~batch.loss_mask.to(device), IGNORE_INDEX)
            # NOTE: fed as the training step feeds it: a context-parallel rank's tokens, packed
            # documents' positions (positions= for forge's model, position_ids= for transformers')
            ((inputs, kept, at),) = micro_batches(
                model, tokens[:, :-1], targets, batch.positions, 1
            )
            out = model(inputs, **at)
            logits = out if isinstance(out, torch.Tensor) else out.logits
            if isinstance(logits, DTensor):
                logits = logits.full_tensor()
            loss = F.cross_entropy(
                logits.float().flatten(0, 1),
                kept.flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            total += torch.stack([loss.double(), (kept != IGNORE_INDEX).sum().double()])
    finally:
        model.train(was_training)
        reshard(model)
    cp = axis_size(mesh, "cp") if sequence_shard(model) is not None else 1
    reduce_over_tokens(total, mesh, cp)  # the data-parallel ranks, and the cp ranks' tokens
    return float(total[0] / total[1].clamp_min(1))

"""The pieces of a training step every forge job uses: the step itself and its helpers.

- :func:`forward_backward`: one optimizer step's forward and backward of a token model, token-
  weighted over the global batch (forge build's parity check, forge train and every parity test
  run it)
- :func:`local_batch`, :func:`reduce_over_dp`: a rank's data-parallel slice, sums over the DP axes
- :func:`set_gradient_sync`: gradient accumulation on FSDP2 / DDP
- :func:`global_grad_norm`: the norm of gradients on several meshes
- :func:`synthetic_tokens`: a learnable token stream, the same on every rank

The parity harness built on them is :mod:`forge_core.testing`.
"""

from __future__ import annotations

import inspect
import logging
import math
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from .contracts import documents_refused, pipeline_step, pop_aux_losses, sequence_shard, unwrap
from .documents import Documents, position_problem
from .errors import ForgeConfigError
from .mesh_dims import DP_AXES, axis_size, dp_rank_and_size, has_axis, sub_mesh

__all__ = [
    "IGNORE_INDEX",
    "forward_backward",
    "global_grad_norm",
    "local_batch",
    "micro_batches",
    "reduce_over_dp",
    "reduce_over_tokens",
    "set_gradient_sync",
    "step_generator",
    "synthetic_tokens",
]


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of step ``step``'s synthetic data: the same whether the steps are made
    together or one at a time."""
    return torch.Generator().manual_seed((seed + 1) * 1_000_003 + step)


def synthetic_tokens(
    seed: int, steps: int, batch_size: int, seq_len: int, vocab_size: int, *, first_step: int = 0
) -> torch.Tensor:
    """Learnable token ids ``[steps, batch_size, seq_len + 1]``, the same on every rank.

    Each sequence starts at a random token and follows one fixed random bigram map (with 10%
    random tokens mixed in), so the loss falls as the model trains: a parity check over several
    steps then depends on every optimizer update, not only on the first gradient. Every step
    draws from its own generator, so the batches of steps ``first_step ..`` are the same whether
    generated together or one at a time (a resumed run sees the data it would have seen).
    """
    next_token = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    tokens = torch.empty(steps, batch_size, seq_len + 1, dtype=torch.long)
    for i in range(steps):
        g = step_generator(seed, first_step + i)
        start = torch.randint(0, vocab_size, (batch_size,), generator=g)
        noise = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
        use_noise = torch.rand((batch_size, seq_len + 1), generator=g) < 0.1
        tokens[i] = _bigram_chains(start, noise, use_noise, next_token)
    return tokens


def _bigram_chains(
    start: torch.Tensor, noise: torch.Tensor, use_noise: torch.Tensor, next_token: torch.Tensor
) -> torch.Tensor:
    """Rows where token ``t`` is ``noise[:, t]`` where ``use_noise[:, t]`` (t >= 1), else
    ``next_token`` of token ``t - 1``; token 0 is ``start``.

    The recurrence is sequential, but each token is ``next_token`` applied ``d`` times to the
    row's last anchor (token 0 or a noise token), ``d`` positions back. So the loop runs over
    ``d``, up to the longest run between anchors (about 90 at 10% noise over 8k tokens), rather
    than over every position: forge train's first H200 profile spent ~40 ms of a 170 ms step
    drawing 4 x 2048 tokens position by position. The tokens are the same, bit for bit.
    """
    rows, width = noise.shape
    anchor = use_noise.clone()
    anchor[:, 0] = True
    values = torch.where(anchor, noise, 0)
    values[:, 0] = start
    position = torch.arange(width).expand(rows, width)
    last_anchor = torch.where(anchor, position, 0).cummax(dim=1).values
    steps_from_anchor = position - last_anchor
    out = values.gather(1, last_anchor)
    for d in range(1, int(steps_from_anchor.max()) + 1):
        out = torch.where(steps_from_anchor >= d, next_token[out], out)
    return out


def local_batch(tokens_BS: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """This rank's data-parallel slice of a global batch (ranks along tp/cp share it)."""
    index, count = dp_rank_and_size(mesh)
    if tokens_BS.shape[0] % count:
        raise ForgeConfigError(
            f"global batch size {tokens_BS.shape[0]} is not divisible by the {count} data-parallel "
            f"ranks; choose a multiple of {count}"
        )
    return tokens_BS.chunk(count)[index]


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient reduction on or off for the next backward (gradient accumulation).

    FSDP2: ``set_requires_gradient_sync`` (no reduce-scatter or all-reduce; unsharded gradients
    accumulate locally). DDP: ``require_backward_grad_sync`` (what ``no_sync()`` toggles).
    Plain modules: nothing to do.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    elif isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = enabled


def _check_norm_type(norm_type: float) -> float:
    p = float(norm_type)
    if not (p > 0):  # NOTE: also refuses NaN
        raise ForgeConfigError(f"norm_type={norm_type!r} must be a positive number or inf")
    return p


def global_grad_norm(
    parameters: list[nn.Parameter] | object,
    norm_type: float = 2.0,
    *,
    mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """The ``norm_type``-norm (default L2; ``inf``: the largest magnitude) of all gradients across
    every shard (DTensor gradients are reduced over their mesh), as a float64 CPU scalar.

    With a ``mesh`` that has a ``pp`` axis, ``parameters`` are this rank's pipeline stages' and
    the other stages' parts are added (one all-reduce over the pipeline ranks).
    """
    p = _check_norm_type(norm_type)
    grads = [q.grad for q in parameters if q.grad is not None]  # type: ignore[union-attr]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    parts: list[torch.Tensor] = [torch.zeros((), dtype=torch.float64)]  # float64 CPU norms
    if plain:
        parts.append(torch.nn.utils.get_total_norm(plain, p).double().cpu())
    # Group by mesh: a norm of DTensors on one mesh reduces with one collective.
    by_mesh: dict[int, list[DTensor]] = {}
    for g in sharded:
        by_mesh.setdefault(id(g.device_mesh), []).append(g)
    # NOTE: reducing a norm that is partial over 2 mesh axes takes 2 all-reduces; DTensor logs a
    # performance warning per call for that, which is noise for this diagnostic.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        for group in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(group, p)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            parts.append(norm.double().cpu())
    finally:
        redistribute_log.setLevel(level)
    if math.isinf(p):
        total = torch.stack(parts).max()
    elif p == 2.0:  # NOTE: the sum of squares, as before norm_type existed (parity records)
        total = torch.zeros((), dtype=torch.float64)
        for part in parts:
            total += part**2
    else:
        total = torch.stack(parts).pow(p).sum()
    if axis_size(mesh, "pp") > 1:  # every pipeline rank joins, with or without gradients
        device = grads[0].device if grads else torch.device("cpu")
        summed = total.to(device)
        op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
        dist.all_reduce(summed, op=op, group=sub_mesh(mesh, "pp").get_group())
        total = summed.cpu()
    if math.isinf(p):
        return total
    return total.sqrt() if p == 2.0 else total.pow(1.0 / p)


def reduce_over_dp(
    value: torch.Tensor, mesh: DeviceMesh | None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """All-reduce ``value`` in place over every data-parallel axis of ``mesh`` (none: no-op)."""
    for name in DP_AXES:
        if has_axis(mesh, name) and sub_mesh(mesh, name).size() > 1:
            dist.all_reduce(value, op=op, group=sub_mesh(mesh, name).get_group())
    return value


IGNORE_INDEX = -100


def forward_backward(
    model: nn.Module,
    tokens_BS: torch.Tensor,
    *,
    mesh: DeviceMesh | None,
    grad_accum: int = 1,
    images: torch.Tensor | None = None,
    ignore_token: int | None = None,
    positions_BS: torch.Tensor | None = None,
    loss_mask_BS: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step's forward and backward of a token model: the step forge build's parity
    check, forge train and every layer's parity test run.

    ``tokens_BS [b, S+1]`` is this rank's slice of the global batch (``images [b, ...]`` with it
    for a vision-language model, called as ``model(tokens, images)``); it is split into
    ``grad_accum`` micro-batches, gradients synchronized on the last one only. The loss is next-
    token cross entropy weighted by token: each rank back-propagates its summed token losses x
    ``dp / tokens of the global batch`` (the count all-reduced on the device, no host wait), so
    that FSDP2/DDP's gradient average over the data-parallel ranks is the gradient of the global
    mean, however unevenly targets equal to ``ignore_token`` fall. Vocab-sharded logits (loss
    parallel) keep the loss context through backward; auxiliary losses the model registered
    (``forge_core.contracts.pop_aux_losses``, e.g. MoE balancing) are added per micro-batch.

    A context-parallel model (``forge_core.contracts.set_sequence_shard``) gets this rank's
    slices of every sequence and their global ``positions``; its token count and loss are
    summed over the ``cp`` ranks as well, and the gradient scale counts them among the ranks
    FSDP2 / DDP average over (they shard and reduce over ``dp x cp``).

    Packed documents (``forge.text_data``, a token file's EOS): ``positions_BS [b, S]`` (best on
    the CPU: it is read on the host) is each input token's position in its document, restarting
    at 0 where one starts; attention then stays inside each document. forge's model gets them as
    ``positions=`` (:mod:`forge_core.documents`); under context parallelism its tokens are dealt
    to the ranks by their attention work (the shard's ``for_documents``) and it also gets the
    whole row's ``documents=``. A Hugging Face model gets ``position_ids`` (from which
    transformers keeps attention inside each document). ``loss_mask_BS [b, S]`` says which
    targets count (False: a document boundary, padding, a prompt token). A model may return
    transformers' output object: its ``logits`` are taken.

    Returns ``(loss sum, token count)`` over the global batch (both reduced over the
    data-parallel and context-parallel ranks, on the device): their ratio is the step's loss.
    """
    step = pipeline_step(model)
    shard = sequence_shard(model)
    if step is not None and shard is not None:
        raise ForgeConfigError(
            "a model split into pipeline stages cannot also shard its sequences (context "
            "parallelism): set parallelism.pp=1 or parallelism.cp=1"
        )
    if step is not None and grad_accum != 1:
        raise ForgeConfigError(
            "a model split into pipeline stages runs its micro-batches through the schedule: "
            "use pp.microbatches instead of grad_accum (set grad_accum=1)"
        )
    if tokens_BS.shape[0] % grad_accum:
        raise ForgeConfigError(
            f"per-rank batch {tokens_BS.shape[0]} is not divisible by grad_accum={grad_accum}"
        )
    inputs_BS, targets = tokens_BS[:, :-1], tokens_BS[:, 1:]
    if ignore_token is not None:
        targets = targets.masked_fill(targets == ignore_token, IGNORE_INDEX)
    if loss_mask_BS is not None:
        targets = targets.masked_fill(~loss_mask_BS.to(targets.device, torch.bool), IGNORE_INDEX)
    if positions_BS is not None and step is not None:
        raise ForgeConfigError(
            "packed documents (per-token positions) cannot run split into pipeline stages yet: "
            "set parallelism.pp=1"
        )
    cp = axis_size(mesh, "cp") if shard is not None else 1
    if step is None:
        micros = micro_batches(model, inputs_BS, targets, positions_BS, grad_accum)
        local = sum((y != IGNORE_INDEX).sum() for _, y, _ in micros)
    else:
        local = (targets != IGNORE_INDEX).sum()
    count = reduce_over_tokens(torch.as_tensor(local).to(torch.int64), mesh, cp)
    scale = dp_rank_and_size(mesh)[1] * cp / count

    def token_loss(logits: torch.Tensor, micro_targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.float().flatten(0, 1),
            micro_targets.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )

    if step is not None:  # the schedule runs every micro-batch (auxiliary losses included)

        def pipeline_loss(
            logits: torch.Tensor, micro_targets: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            micro_sum = token_loss(logits, micro_targets)
            return micro_sum * scale, micro_sum.detach()

        inputs = (inputs_BS,) if images is None else (inputs_BS, images)
        return reduce_over_dp(step(inputs, targets, pipeline_loss), mesh), count
    micro_images = images.chunk(grad_accum) if images is not None else [None] * grad_accum
    loss_sum = torch.zeros((), device=tokens_BS.device)
    for i, ((micro, micro_targets, at), pixels) in enumerate(
        zip(micros, micro_images, strict=True)
    ):
        set_gradient_sync(model, i == grad_accum - 1)
        out = model(micro, **at) if pixels is None else model(micro, pixels, **at)
        logits = out if isinstance(out, torch.Tensor) else out.logits  # transformers' output
        # Vocab-sharded logits (loss parallel): the cross entropy reduces over the tp ranks
        # without gathering the logits; forward and backward both need the context.
        with loss_parallel() if isinstance(logits, DTensor) else nullcontext():
            micro_sum = token_loss(logits, micro_targets)
            loss = micro_sum * scale
            aux = pop_aux_losses(model)  # e.g. the MoE balancing loss: a mean over micro-batches
            if aux is not None:
                if isinstance(loss, DTensor):  # loss parallel: the loss is replicated over tp
                    aux = DTensor.from_local(
                        aux, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim
                    )
                loss = loss + aux / grad_accum
            loss.backward()
        loss_sum += (
            micro_sum.full_tensor() if isinstance(micro_sum, DTensor) else micro_sum
        ).detach()
    return reduce_over_tokens(loss_sum, mesh, cp), count


def micro_batches(
    model: nn.Module,
    inputs_BS: torch.Tensor,
    targets_BS: torch.Tensor,
    positions_BS: torch.Tensor | None,
    grad_accum: int,
) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """``(inputs, targets, keyword arguments)`` of each of ``grad_accum`` micro-batches as this
    rank feeds ``model`` (the training step's, and the validation loss's):
    its sequence shard's tokens (context parallelism) and their global ``positions``, or packed
    documents' positions: ``positions`` (with the whole row's ``documents`` under context
    parallelism) for a model that masks documents itself (forge's), ``position_ids`` for a
    Hugging Face model (transformers keeps attention inside each document from them)."""
    shard = sequence_shard(model)
    pieces = zip(inputs_BS.chunk(grad_accum), targets_BS.chunk(grad_accum), strict=True)
    params = inspect.signature(unwrap(model).forward).parameters
    # NOTE: forge's models take positions=, transformers' position_ids= ([B or 1, S])
    name = "positions" if "positions" in params else "position_ids"
    if positions_BS is None and shard is None:
        return [(x, y, {}) for x, y in pieces]
    refused = documents_refused(model) if positions_BS is not None else None
    if refused:
        raise ForgeConfigError(
            f"packed documents (positions_BS) on {type(unwrap(model)).__name__}, which cannot "
            f"keep attention inside them: {refused}"
        )
    if name not in params:
        raise ForgeConfigError(
            f"{type(unwrap(model)).__name__}.forward takes neither positions= nor position_ids=: "
            "it cannot train on packed documents or on context-parallel shards"
        )
    if positions_BS is None:
        assert shard is not None  # NOTE: returned above otherwise
        where = shard(torch.arange(inputs_BS.shape[1], device=inputs_BS.device)[None])
        at = {name: where[0] if name == "positions" else where}
        return [(shard(x), shard(y), at) for x, y in pieces]
    positions = positions_BS.cpu()  # NOTE: read on the host; the data gives CPU tensors
    problem = position_problem(positions)
    if problem:
        raise ForgeConfigError(f"positions_BS: {problem}")
    micros = []
    for (x, y), pos in zip(pieces, positions.chunk(grad_accum), strict=True):
        device = x.device
        if shard is None:  # forge's model masks from them; transformers too
            micros.append((x, y, {name: pos.to(device)}))
        else:
            deal = getattr(shard, "for_documents", None)
            if deal is None:
                raise ForgeConfigError(
                    f"the sequence shard {type(shard).__name__} cannot deal packed documents "
                    "over the context-parallel ranks (it has no for_documents)"
                )
            mine, index = deal(pos)
            starts = torch.arange(pos.shape[1]) - pos
            docs = Documents(index, starts[:, index]).to(device)
            kwargs: dict[str, Any] = {name: mine(pos).to(device), "documents": docs}
            micros.append((mine(x), mine(y), kwargs))
    return micros


def reduce_over_tokens(value: torch.Tensor, mesh: DeviceMesh | None, cp: int) -> torch.Tensor:
    """Sum ``value`` over every rank holding other tokens: the data-parallel ranks and, for a
    model that shards its sequences (``cp > 1``), the context-parallel ones."""
    reduce_over_dp(value, mesh)
    if cp > 1:
        dist.all_reduce(value, group=sub_mesh(mesh, "cp").get_group())
    return value

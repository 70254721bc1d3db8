"""Parallel styles for attention split by heads where q, k and v come from one fused projection,
and for transformers' ``Conv1D`` (GPT-2's Linear with a transposed weight).

A fused q/k/v projection's output rows are laid out by the model's own code (``[q; k; v]`` end
to end in GPT-2, per head ``[heads, 3, head_dim]`` in Bloom, per kv group in Falcon's new
architecture, ``[q; k; v]`` with a single k/v head in multi-query models). Split column-wise
into tp contiguous slices, the first layout would give rank 0 all of q and rank 1 all of v. So
the split is described by *row segments* (:class:`HeadSplit`): ``(size, split)`` pairs in output
order, each either split over the tp ranks (a rank gets its slice: its heads) or replicated (a
single shared k/v head: every rank needs all of it, and the gradients of its rank copies are
summed). A rank computes its output rows from its contiguous weight shard, and one all-to-all
moves them where the segments say (nothing moves when the layout is contiguous by heads).

Which segments a model needs, and which of its attention attributes count heads (read in
forward to reshape), depends on the model and often on its config (multi-query or not), so
:class:`SplitAttentionHeads` is applied to the attention module itself with a function of that
module that returns a :class:`HeadSplit`; it sets the attributes to one rank's values, tells
the fused projection's :class:`FusedQKVColwise` its segments, and can hand the attention only
its heads' part of per-head inputs (ALiBi biases). No transformers import: ``Conv1D`` is matched
by class name and weight shape.

The fused ("packed") Linears of :mod:`forge_tp_plans.styles` (``[gate; up]``) are the same split:
``parts`` equal segments, each split over tp, so they build on :class:`_ColwiseRows` and
:class:`_RowwiseRows` here, with the local-shard collectives every style of forge's own shares.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from forge_core.errors import ForgeConfigError
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module

from .row_segments import Regroup, Segments, check_rows, exchange

__all__ = [
    "ColwiseConv1D",
    "FusedQKVColwise",
    "HeadSplit",
    "RowwiseConv1D",
    "RowwiseParallelInplaceSafe",
    "SplitAttentionHeads",
    "is_conv1d",
]

#: Where :class:`SplitAttentionHeads` leaves a fused projection its segments (module ``__dict__``).
_ROWS_ATTR = "_forge_fused_rows"


class _CopyToParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (a replicated input feeding shards)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """All-reduce forward (sum of partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad, None


@overload
def _local(t: torch.Tensor) -> torch.Tensor: ...
@overload
def _local(t: torch.Tensor | None) -> torch.Tensor | None: ...
def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def _replicated_local(x: torch.Tensor) -> torch.Tensor:
    """A replicated input as a plain tensor (a DTensor input is gathered whole first)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (``y = x @ W + b``, ``W`` of shape
    ``[in, out]``): matched by class name and weight shape, without importing transformers."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and weight.ndim == 2
        and tuple(weight.shape) == (getattr(module, "nx", None), getattr(module, "nf", None))
    )


def _out_dim(module: nn.Module, path: str) -> int:
    """The weight dimension of the output features: 0 for ``nn.Linear``, 1 for ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return 0
    if is_conv1d(module):
        return 1
    raise ForgeConfigError(
        f"'{path}' is a {type(module).__name__}: this style splits nn.Linear and transformers' "
        "Conv1D only"
    )


def _check_conv1d(module: nn.Module, path: str, style: str, linear_style: str) -> None:
    if not is_conv1d(module):
        raise ForgeConfigError(
            f"'{path}' is a {type(module).__name__}: {style} splits transformers' Conv1D only "
            f"(nn.Linear: {linear_style})"
        )


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    """The module's parameter ``name`` (None when it has none, e.g. no bias)."""
    value = getattr(module, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _weight(module: nn.Module) -> torch.Tensor:
    weight = _tensor(module, "weight")
    assert weight is not None  # checked by _out_dim / is_conv1d
    return weight


def _out_features(module: nn.Module, path: str) -> int:
    return int(_weight(module).shape[_out_dim(module, path)])


def _in_features(module: nn.Module, path: str) -> int:
    return int(_weight(module).shape[1 - _out_dim(module, path)])


def _distribute(module: nn.Module, mesh: DeviceMesh, weight: Placement, other: Placement) -> None:
    """Turn ``module``'s own parameters into DTensors of their unsharded values (names kept):
    ``weight`` placed as ``weight`` says, the others (the bias) as ``other``. Parameters that are
    DTensors already are left as they are."""

    def partition(name: str, mod: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, param in list(mod.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                placement = weight if pname == "weight" else other
                sharded = distribute_tensor(param, device_mesh, [placement])
                mod.register_parameter(
                    pname, nn.Parameter(sharded, requires_grad=param.requires_grad)
                )

    distribute_module(module, mesh, partition)


def _project(
    module: nn.Module, x: torch.Tensor, conv1d: bool, *, bias: bool = True
) -> torch.Tensor:
    """The module's own product on local shards (``Conv1D``: ``addmm`` as transformers does),
    without the bias when ``bias`` is false (a row-parallel layer adds it after the sum)."""
    weight = _local(_weight(module))
    b = _local(_tensor(module, "bias")) if bias else None
    if not conv1d:
        return F.linear(x, weight, b)
    flat = x.reshape(-1, x.size(-1))
    y = flat @ weight if b is None else torch.addmm(b, flat, weight)
    return y.view(*x.shape[:-1], -1)


# ---------------------------------------------------------------------------------------------
# Styles
# ---------------------------------------------------------------------------------------------


class _ColwiseRows(ParallelStyle):
    """Column parallel ``nn.Linear`` / ``Conv1D`` whose local output is the rows ``_rows``
    gives (one split segment: the plain contiguous slice)."""

    def _known_rows(self, module: nn.Module, path: str) -> Segments | None:
        return ((_out_features(module, path), True),)

    def _rows(self, module: nn.Module, path: str) -> Segments:
        rows = self._known_rows(module, path)
        if rows is None:
            raise ForgeConfigError(
                f"'{path}': {type(self).__name__} needs its row segments: give rows=..., or put "
                "SplitAttentionHeads on the attention module that holds it before it in the plan"
            )
        return rows

    def check(self, module: nn.Module, path: str, tp: int) -> None:
        """Raise ``ForgeConfigError`` unless ``module`` can be split over ``tp`` ranks (by its
        row segments, where they are known yet)."""
        _out_dim(module, path)
        rows = self._known_rows(module, path)
        if rows is not None:
            check_rows(rows, _out_features(module, path), tp, path)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        path = type(self).__name__
        tp, group = device_mesh.size(), device_mesh.get_group()
        self.check(module, path, tp)
        dim = _out_dim(module, path)
        ex = exchange(self._rows(module, path), tp, device_mesh.get_local_rank())
        conv1d = dim == 1
        _distribute(module, device_mesh, Shard(dim), Shard(0))

        def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            x = _CopyToParallel.apply(_replicated_local(x), group)
            y = _project(self, x, conv1d)
            return y if ex.identity else Regroup.apply(y, ex, group, False)

        module.forward = types.MethodType(forward, module)
        return module


class ColwiseConv1D(_ColwiseRows):
    """Column parallel transformers ``Conv1D`` (GPT-2's ``c_fc``): weight ``[in, out]`` stored as
    a ``Shard(1)`` DTensor, bias ``Shard(0)`` (the unsharded values and names).

    Input replicated (its gradient all-reduced over tp); output ``[..., out / tp]``, local.
    torch's ``ColwiseParallel`` would shard dim 0 of the weight, which for ``Conv1D`` is the
    input dimension, so ``Conv1D`` gets its own style.
    """

    def check(self, module: nn.Module, path: str, tp: int) -> None:
        """Raise ``ForgeConfigError`` unless ``module`` is a ``Conv1D`` that splits over ``tp``."""
        _check_conv1d(module, path, "ColwiseConv1D", "ColwiseParallel")
        super().check(module, path, tp)


class FusedQKVColwise(_ColwiseRows):
    """Column parallel fused q/k/v projection (``nn.Linear`` or ``Conv1D``) split by heads.

    Each rank's output is its part of every row segment, in order: for ``[q; k; v]`` with every
    segment split, ``[q_r; k_r; v_r]`` (the model's own ``split``/``view`` on it then gives this
    rank's heads); for a replicated segment (a multi-query model's single k/v head) all of it.
    The segments are ``rows`` when given, else the ones :class:`SplitAttentionHeads` on the
    attention module holding this projection left (it must come first in the plan).

    NOTE (design): the weight (``Shard(0)`` for ``nn.Linear``, ``Shard(1)`` for ``Conv1D``) and
    bias (``Shard(0)``) are DTensors of the unsharded values in the unsharded layout, so
    ``full_tensor()``, state dicts and checkpoints are the unsharded model's, and FSDP2 composes
    with them as with ``ColwiseParallel``'s. A rank computes the output rows of its contiguous
    shard and an all-to-all moves them to the segments' layout (backward moves the gradient
    back, summing a replicated segment's over the ranks that used it); a layout contiguous by
    heads moves nothing. The price, per layer, is an all-to-all of the fused activation forward
    and of its gradient backward (``[q; k; v]``: about ``(tp - 1) / tp`` of a rank's rows move;
    one k/v head: each rank's slice of it goes to every rank). The alternatives: storing the rows each rank computes with under a
    ``Shard`` placement (``full_tensor()`` would be a permutation of the weight: checkpoints
    wrong for the unsharded model), torch's private ``_StridedShard`` (private, and it cannot
    describe a replicated segment), or gathering the weight each step (a saved copy per layer).
    """

    def __init__(self, rows: Sequence[tuple[int, bool]] | None = None) -> None:
        super().__init__()
        self.rows: Segments | None = None if rows is None else tuple(rows)

    def _known_rows(self, module: nn.Module, path: str) -> Segments | None:
        return self.rows if self.rows is not None else module.__dict__.get(_ROWS_ATTR)


class _RowwiseRows(ParallelStyle):
    """Row parallel ``nn.Linear`` / ``Conv1D``: the weight's input dimension a ``Shard`` DTensor,
    the bias replicated (the unsharded values and names).

    Input: this rank's rows of the input features in the layout ``_known_rows`` gives (one split
    segment: the plain contiguous slice), moved to the contiguous layout by an all-to-all (its
    gradient back by another); a DTensor input is taken in torch's contiguous ``Shard(-1)``
    layout instead. Output: the partial products all-reduced, the bias added once, replicated.
    """

    def _known_rows(self, module: nn.Module, path: str) -> Segments:
        return ((_in_features(module, path), True),)

    def check(self, module: nn.Module, path: str, tp: int) -> None:
        """Raise ``ForgeConfigError`` unless ``module``'s input features split over ``tp``."""
        features = _in_features(module, path)
        if features % tp:
            raise ForgeConfigError(f"'{path}': {features} input features do not split over tp={tp}")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        path = type(self).__name__
        tp, group = device_mesh.size(), device_mesh.get_group()
        self.check(module, path, tp)
        conv1d = _out_dim(module, path) == 1
        ex = exchange(self._known_rows(module, path), tp, device_mesh.get_local_rank())
        _distribute(module, device_mesh, Shard(0 if conv1d else 1), Replicate())

        def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            if isinstance(x, DTensor):
                x = x.redistribute(device_mesh, [Shard(x.ndim - 1)]).to_local()
            elif not ex.identity:
                x = Regroup.apply(x, ex, group, True)
            y = _ReduceFromParallel.apply(_project(self, x, conv1d, bias=False), group)
            bias = _local(_tensor(self, "bias"))
            return y if bias is None else y + bias

        module.forward = types.MethodType(forward, module)
        return module


class RowwiseConv1D(_RowwiseRows):
    """Row parallel transformers ``Conv1D`` (GPT-2's ``c_proj``): weight ``[in, out]`` stored as
    a ``Shard(0)`` DTensor, bias replicated (the unsharded values and names).

    Input ``[..., in / tp]``, this rank's part (a DTensor input is taken as ``Shard(-1)``);
    output: the partial products all-reduced, the bias added once, replicated.
    """

    def check(self, module: nn.Module, path: str, tp: int) -> None:
        """Raise ``ForgeConfigError`` unless ``module`` is a ``Conv1D`` that splits over ``tp``."""
        _check_conv1d(module, path, "RowwiseConv1D", "RowwiseParallel")
        super().check(module, path, tp)


class RowwiseParallelInplaceSafe(RowwiseParallel):
    """torch's ``RowwiseParallel`` whose output the model may modify in place.

    ``RowwiseParallel`` hands back ``DTensor.to_local()``: a view made inside a custom autograd
    function, which autograd refuses to modify in place (Falcon's parallel attention does
    ``mlp_output += attention_output`` on its MLP's output). A forward hook returns a copy.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        plain = RowwiseParallel(
            input_layouts=self.input_layouts[0],
            output_layouts=self.output_layouts[0],
            use_local_output=self.use_local_output,
        )
        parallelize_module(module, device_mesh, plain)
        module.register_forward_hook(lambda mod, args, out: out.clone())
        return module


@dataclass(frozen=True)
class HeadSplit:
    """How one attention module splits over tp ranks, from :class:`SplitAttentionHeads`'s
    function (which raises ``ForgeConfigError`` for a module it cannot split exactly)."""

    #: the attributes the attention's forward reads to reshape into heads, at one rank's values
    counts: Mapping[str, int]
    #: the query heads over all ranks (to check per-head inputs)
    heads: int
    #: child name of a fused q/k/v projection styled ``FusedQKVColwise()``, and its segments
    fused: str | None = None
    rows: Segments = ()
    #: forward keyword arguments holding one slice per query head (ALiBi biases, masks with
    #: them): each rank gets its heads' (``[B, heads, ...]`` or ``[B * heads, ...]``; a size-1
    #: head dimension broadcasts and stays as it is)
    per_head_inputs: tuple[str, ...] = ()


def _own_heads(
    t: torch.Tensor, batch: int, heads: int, tp: int, rank: int, name: str
) -> torch.Tensor:
    """This rank's heads of a per-head tensor ``[B, heads, ...]`` or ``[B * heads, ...]``."""
    local = heads // tp
    if t.ndim == 4 and t.shape[1] == 1:
        return t  # broadcast over heads
    if t.ndim == 4 and t.shape[1] == heads:
        return t.narrow(1, rank * local, local)
    if t.ndim == 3 and t.shape[0] == batch * heads:
        per = t.view(batch, heads, *t.shape[1:]).narrow(1, rank * local, local)
        return per.reshape(batch * local, *t.shape[1:])
    if t.ndim in (3, 4):
        raise ForgeConfigError(
            f"tensor-parallel attention: input '{name}' of shape {tuple(t.shape)} is neither "
            f"[batch, {heads} heads, ...] nor [batch * {heads} heads, ...] (batch {batch})"
        )
    return t  # a padding mask [batch, seq] (flash attention): the same for every head


class SplitAttentionHeads(ParallelStyle):
    """Applied to an attention module: split it by heads over the tp ranks, as ``split(module,
    tp) -> HeadSplit`` says (a family's own function: which attributes count heads, how its
    fused projection's rows are laid out).

    Sets those attributes to one rank's values, leaves the fused projection its row segments for
    its :class:`FusedQKVColwise` (later in the plan), and, for ``per_head_inputs``, hands the
    forward only this rank's heads of each such tensor. The projections themselves keep their own
    plan entries (recorded, so a later stage sees their styles). Parameters are not touched.
    """

    def __init__(self, split: Callable[[nn.Module, int], HeadSplit]) -> None:
        super().__init__()
        self.split = split

    def check(self, module: nn.Module, path: str, tp: int) -> HeadSplit:
        """The split of ``module`` over ``tp`` ranks; raises ``ForgeConfigError`` if there is none."""
        plan = self.split(module, tp)
        for attr in plan.counts:
            if not hasattr(module, attr):
                raise ForgeConfigError(f"'{path}' ({type(module).__name__}) has no '{attr}'")
        if plan.heads % tp:
            raise ForgeConfigError(f"'{path}': {plan.heads} heads do not split over tp={tp}")
        if plan.fused is not None:
            fused = f"{path}.{plan.fused}"
            features = _out_features(module.get_submodule(plan.fused), fused)
            check_rows(plan.rows, features, tp, fused)
        return plan

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        plan = self.check(module, type(module).__name__, tp)
        for attr, value in plan.counts.items():
            setattr(module, attr, value)
        if plan.fused is not None:
            module.get_submodule(plan.fused).__dict__[_ROWS_ATTR] = plan.rows
        names, heads = plan.per_head_inputs, plan.heads
        if names:

            def own_heads(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                hidden = args[0] if args else kwargs.get("hidden_states")
                batch = hidden.shape[0] if isinstance(hidden, torch.Tensor) else 1
                for name in names:
                    t = kwargs.get(name)
                    if isinstance(t, torch.Tensor):
                        kwargs[name] = _own_heads(t, batch, heads, tp, rank, name)
                return args, kwargs

            module.register_forward_pre_hook(own_heads, with_kwargs=True)
        return module

"""``apply_expert_parallel``: shard the experts of every MoE layer over the ``ep`` mesh axis.

The ``ep`` axis is carved out of ``dp_shard`` (``forge_mesh.build_device_mesh`` makes the views):
EP peers are data-parallel ranks that see different tokens, so attention and the other dense
parts are never computed twice. Each EP rank holds ``num_experts / ep`` experts (a contiguous
range, DTensor ``Shard(0)``); ranks that hold the same experts form the experts' own
data-parallel axis (``expert_dp = dp_replicate x dp_shard_mod_ep``), over which FSDP2 shards and
reduces them. With more data-parallel ranks than experts, ``ep`` stays at most ``num_experts``
and the remaining ranks shard each expert's weights with FSDP2 instead.

Applied from outside, in the style of torchtitan's ``ExpertParallel``: the MoE layer is purely
local and holds no process group. :class:`ExpertParallel` partitions its experts' weights and
installs the token dispatch (a forward pre-hook on ``experts``: rows to the ranks owning their
experts) and the token return (a forward hook on ``experts``: results back to the senders; the
router-weighted combine then runs in the layer, on each token's own rank). Which exchange runs
is read from the experts' input: ``offs=None`` (equal groups, the capacity mode) moves rows with
equal splits and no host sync; group offsets (dropless) need the split sizes on the host, so for
dropless layers two more hooks start their exchange early: a forward pre-hook on the MoE arms
it, a forward hook on ``router`` counts the routed rows per expert, exchanges the counts and
starts their copy to the host, and the layer's permute and shared expert run while it flies.
The per-expert token counts for aux-loss-free balancing are summed over the data-parallel ranks
by a load hook (``MoE.register_load_hook``), with or without an ``ep`` axis.

The hooks keep the layer's module order (router, shared expert, experts), so FSDP2 applied
later (its hooks run around these: all-gather before the dispatch, reshard after the return)
and activation checkpointing (a recompute runs the same hooks in the same order) compose.

Gradient bookkeeping: an expert's gradient arrives (through the all-to-all backward) summed over
the tokens of its ``ep`` peers; FSDP2 divides it by the full data-parallel degree (see
``forge_core.contracts.mark_expert_parallel``), which makes it the same average the dense
parameters get.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from forge_core.contracts import mark_expert_parallel
from forge_core.errors import ForgeConfigError, refuse
from forge_core.mesh_dims import (
    axis_size,
    get_dp_group_mesh,
    get_ep_mesh,
    get_ep_tp_mesh,
    get_tp_mesh,
)
from forge_core.stages import stage
from forge_kernels.native import StagedSplits
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .checks import check_expert_parallel, dispatch_cp_problems, no_moe_problems
from .dispatch import (
    SendBack,
    dispatch_equal_rows,
    dispatch_rows,
    exchange_counts,
    expert_counts,
)
from .expert_tp import HIDDEN_DIM, apply_expert_tensor_parallel, layer_problems
from .moe import MoE

__all__ = ["ExpertParallel", "SumOverRanks", "apply_expert_parallel", "check_expert_parallel"]


class SumOverRanks:
    """A :meth:`MoE.register_load_hook` hook: sums the token counts over ``mesh``'s ranks."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def __call__(self, counts: torch.Tensor) -> None:
        dist.all_reduce(counts, group=self.mesh.get_group())


class ExpertParallel:
    """Expert parallelism of one MoE layer over a 1-D ``ep`` mesh, installed by :meth:`apply`.

    Holds the state the hooks share: the ``ep`` group, the split-size staging buffer, an
    exchange started by the router hook (dropless), and how to send the experts' results of the
    forward in progress back. ``apply`` is done once per layer, before FSDP2.
    """

    def __init__(
        self, ep_mesh: DeviceMesh, num_experts: int, ep_tp_mesh: DeviceMesh | None = None
    ) -> None:
        check_expert_parallel(num_experts, ep_mesh.size())
        self.mesh = ep_mesh
        #: ``(ep, tp)``: the experts' hidden units split over tp too (expert tensor parallelism)
        self.params_mesh = ep_tp_mesh
        self.group = ep_mesh.get_group()
        self.ranks = ep_mesh.size()
        self.num_experts = num_experts
        self._layer: MoE | None = None
        self._staged: StagedSplits | None = None
        self._armed = False  # the next router output starts a split-size exchange
        self._started: tuple[torch.Tensor, int] | None = None  # (recv counts, rows), staged
        self._send_back: SendBack | None = None

    # ------------------------------------------------------------------ install
    def apply(self, moe: MoE) -> MoE:
        """Shard ``moe.experts``' weights ``Shard(0)`` over the mesh (and their hidden dim over tp
        on an ``(ep, tp)`` mesh), mark them for FSDP2, and install the hooks (see the module
        docstring). Returns ``moe``."""
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                raise ForgeConfigError(
                    f"expert weight {name} is already a DTensor ({param.placements}); apply "
                    "expert parallelism before FSDP2 and only once"
                )
            if self.params_mesh is None:
                sharded = distribute_tensor(param.data, self.mesh, [Shard(0)])
            else:
                placements = [Shard(0), Shard(HIDDEN_DIM[name])]
                sharded = distribute_tensor(param.data, self.params_mesh, placements)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        mark_expert_parallel(experts, self.ranks)
        self._layer = moe
        experts.register_forward_pre_hook(self._dispatch)
        experts.register_forward_hook(self._return)
        if moe.config.moe_dispatch == "dropless":
            moe.register_forward_pre_hook(self._arm)
            moe.router.register_forward_hook(self._start_exchange)
        return moe

    # ------------------------------------------------------------------ hooks
    def _arm(self, moe: nn.Module, args: tuple[Any, ...]) -> None:
        """MoE forward pre-hook (dropless): this forward's router output starts the exchange."""
        if self._started is not None and self._staged is not None:
            # NOTE: an earlier forward stopped between its router and its experts (an exception):
            # drain its copy so the staging buffer can be reused. Never reached in a normal step.
            self._staged.wait()
        self._started = None
        self._armed = True

    def _start_exchange(self, router: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        """Router forward hook (dropless): count rows per expert, exchange the counts with the
        ``ep`` peers and start copying the split sizes to the host; nothing waits here."""
        if not self._armed:  # the router called on its own, not by its MoE: no exchange
            return
        self._armed = False
        ids = out[1]
        self._started = self._exchange(expert_counts(ids, self.num_experts), ids.numel())

    def _exchange(self, send_counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, int]:
        recv_counts, splits = exchange_counts(send_counts, self.group)
        self._staging(splits.device).start(splits)
        return recv_counts, rows

    def _staging(self, device: torch.device) -> StagedSplits:
        if self._staged is None or self._staged.device != device:
            self._staged = StagedSplits(2 * self.ranks, device=device)
        return self._staged

    def _dispatch(self, experts: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """Experts forward pre-hook: this rank's expert-major rows -> the rows of its experts."""
        x_rows, offs = _experts_args(args)
        if offs is None:
            x_local, self._send_back = dispatch_equal_rows(x_rows, self.group, self.num_experts)
            return (x_local, None)
        started, self._started = self._started, None
        if started is None:  # not started by the router hook: exchange the counts now
            send_counts = torch.diff(offs, prepend=offs.new_zeros(1))
            started = self._exchange(send_counts, x_rows.shape[0])
        recv_counts, rows = started
        if rows != x_rows.shape[0]:
            raise RuntimeError(
                f"expert parallelism: the router hook counted {rows} routed rows but the experts "
                f"got {x_rows.shape[0]}; call the experts through their MoE layer"
            )
        assert self._staged is not None  # _exchange staged the split sizes
        splits = self._staged.wait()  # the layer's one host sync
        if self._layer is not None:
            self._layer.host_syncs += 1
        x_local, offs_local, self._send_back = dispatch_rows(
            x_rows, self.group, recv_counts, splits
        )
        return (x_local, offs_local)

    def _return(self, experts: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> Any:
        """Experts forward hook: the experts' rows back to the ranks (and order) they came from."""
        send_back, self._send_back = self._send_back, None
        if send_back is None:
            raise RuntimeError("expert parallelism: experts output without a dispatch before it")
        return send_back(out)


def _experts_args(args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    if len(args) == 1:
        return args[0], None
    if len(args) != 2:
        raise TypeError(
            "expert parallelism: call the experts as experts(rows, offs) with positional "
            f"arguments; got {len(args)} positional arguments"
        )
    return args[0], args[1]


def apply_expert_parallel(
    model: nn.Module, device_mesh: DeviceMesh | None, *, expert_tp: bool = False
) -> nn.Module:
    """Shard every :class:`MoE`'s experts over ``device_mesh``'s ``ep`` axis; returns ``model``.

    ``device_mesh`` is the full forge mesh (``forge_mesh.build_device_mesh``). Each layer gets
    an :class:`ExpertParallel` (weights ``Shard(0)``, token dispatch and return hooks). Without
    an ``ep`` axis the experts stay whole on every rank; either way each MoE layer gets a load
    hook summing its token counts over the data-parallel ranks (aux-loss-free balancing). The
    layers themselves hold no process group. Order: after TP, before Float8 / AC / compile /
    FSDP2 (enforced). Works on meta-device or materialized models. Refused, with the fix: an
    ``ep`` that does not divide a layer's experts; the capacity dispatch on a mesh with a ``cp``
    axis (:func:`forge_moe_ep.checks.dispatch_cp_problems`).

    ``expert_tp``: on a mesh with a ``tp`` axis, split each expert's hidden units over it
    (:mod:`forge_moe_ep.expert_tp`), with an ``ep`` axis too on the ``(ep, tp)`` mesh.
    """
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    ep_mesh = get_ep_mesh(device_mesh)
    ep = 1 if ep_mesh is None else ep_mesh.size()
    refuse(no_moe_problems(ep, bool(moes)))
    cp = axis_size(device_mesh, "cp")
    tp_mesh = get_tp_mesh(device_mesh) if expert_tp else None
    tp = 1 if tp_mesh is None else tp_mesh.size()
    ep_tp_mesh = get_ep_tp_mesh(device_mesh) if tp > 1 and ep > 1 else None
    for moe in moes:
        check_expert_parallel(moe.num_experts, ep)
        refuse(dispatch_cp_problems(moe.config.moe_dispatch, cp))
        refuse(layer_problems(moe, tp, ep, cp))
    count_mesh = get_dp_group_mesh(device_mesh)
    with stage(model, "ep"):
        for moe in moes:
            if count_mesh is not None:
                moe.register_load_hook(SumOverRanks(count_mesh))
            if ep_mesh is not None:
                ExpertParallel(ep_mesh, moe.num_experts, ep_tp_mesh).apply(moe)
            if tp_mesh is not None and tp > 1:
                apply_expert_tensor_parallel(moe, tp_mesh, shard=ep_mesh is None)
    return model

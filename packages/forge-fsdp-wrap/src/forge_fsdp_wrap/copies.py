"""Optimizers never step FSDP2's unsharded copies: such a step stops with one line instead.

While an FSDP2 unit is gathered, FSDP2 registers its unsharded parameters (copies made by the
all-gather) on the module in place of the sharded ones, and registers the shards back when it
reshards: after the unit's backward, or after its forward for a unit that reshards then. A unit
that keeps its parameters after forward (forge's last block; every unit with
``reshard_after_forward=False``, as on pipeline stages; a reshard to a smaller group, which
registers yet another tensor) keeps the copies registered until a backward comes. A forward
that no backward follows (an evaluation, with or without grad) therefore leaves copies behind,
``model.parameters()`` yields them, and an optimizer built then captures them: FSDP2 writes
the gradients to the shards and frees the copies', so those parameters never train, silently
(the loss was 16-40 % off the single-device model after three AdamW steps).

NOTE: detection, not prevention. Making every unit reshard after forward would cost one more
all-gather per step (the last block's, at the start of backward) and would still leave
``reshard_after_forward=False`` (a user's choice, and pipeline stages') exposed. Instead:

- :func:`watch_for_copies` (``apply_fsdp2`` calls it) puts a forward hook on the FSDP2 root,
  after FSDP2's own, that marks every parameter it finds registered that is not one of FSDP2's
  shards (ignoring the parameters left out of FSDP2, a replicated frozen component);
  :func:`forge_fsdp_wrap.unshard_fsdp2_model` marks the copies it registers the same way;
- a step pre-hook common to all optimizers (``torch.optim.optimizer.
  register_optimizer_step_pre_hook``, registered once per process) refuses a step of an
  optimizer that holds a marked tensor, before anything is updated.

Correct programs see no change: one pass over the parameters per root forward and per step.
:func:`reshard` is the fix the message names.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from forge_core.errors import ForgeConfigError
from forge_core.torch_compat import fsdp_param_groups
from torch.distributed.fsdp import FSDPModule
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["COPY_MARK", "mark_copies", "reshard", "watch_for_copies"]

#: The attribute set (True) on a tensor FSDP2 registered in place of a shard.
COPY_MARK = "forge_fsdp_copy"
#: Where a watched root keeps the modules it left out of FSDP2 (their parameters are no copies).
_IGNORED_ATTR = "_forge_fsdp_ignored"
#: Where a watched root keeps its units that keep their parameters after forward.
_KEPT_ATTR = "_forge_fsdp_kept"
#: Where each unit keeps (a weak reference to) the watched root it belongs to.
_ROOT_ATTR = "_forge_fsdp_root"


def reshard(model: nn.Module) -> nn.Module:
    """Reshard every FSDP2 unit of ``model``, so that ``model.parameters()`` yields the shards
    again (``FSDPModule.reshard`` is not recursive); returns ``model``.

    Call it before building an optimizer when a forward without backward (an evaluation) ran
    since the model was sharded. A model whose units belong to other FSDP2 roots (a pipeline
    rank model: its stage modules are the roots, holding the embedding or the head themselves)
    has those roots resharded too.
    """
    roots = {id(model): model}
    for module in model.modules():
        root = module.__dict__.get(_ROOT_ATTR)
        if root is not None and root() is not None:
            roots.setdefault(id(root()), root())
    for root in roots.values():
        for module in root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    return model


def mark_copies(model: nn.Module, within: Iterable[nn.Module] | None = None) -> int:
    """Mark every parameter registered now under the modules ``within`` (default: the units of
    ``model`` that keep their parameters after forward, as :func:`watch_for_copies` recorded)
    that is not an FSDP2 shard; returns how many. Only on a watched ``model`` (it knows which
    parameters were left out of FSDP2 on purpose: a replicated frozen component's); 0 on any
    other."""
    ignored = model.__dict__.get(_IGNORED_ATTR)
    if ignored is None:
        return 0
    marked = 0
    for part in model.__dict__[_KEPT_ATTR] if within is None else within:
        # NOTE: typed here: torch leaves modules()' return type unannotated (Any)
        modules: list[nn.Module] = list(part.modules())
        shards = {
            id(fsdp_param.sharded_param)
            for unit in modules
            if isinstance(unit, FSDPModule)
            for group in fsdp_param_groups(unit)
            for fsdp_param in group.fsdp_params
        }
        shards.update(id(p) for module in ignored for p in module.parameters())
        for param in part.parameters():
            if id(param) not in shards:
                setattr(param, COPY_MARK, True)
                marked += 1
    return marked


def watch_for_copies(
    model: nn.Module, kept: Iterable[nn.Module], ignored: Iterable[nn.Module] = ()
) -> None:
    """After each forward of the FSDP2 root ``model``, mark the copies left registered in the
    ``kept`` units (those that keep their parameters after forward; the others reshard then) by
    :func:`mark_copies`, never the parameters of the ``ignored`` modules (left out of FSDP2),
    and refuse any optimizer step over a marked tensor (process-wide, installed once). Call it
    after ``fully_shard(model)``: its hook then runs after FSDP2's."""
    model.__dict__[_IGNORED_ATTR] = tuple(ignored)
    model.__dict__[_KEPT_ATTR] = tuple(kept)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):  # how reshard() finds this root from a shared unit
            unit.__dict__[_ROOT_ATTR] = weakref.ref(model)

    @torch.compiler.disable  # NOTE: host bookkeeping; a whole-model compile must not trace it
    def after_forward(module: nn.Module, args: Any, output: Any) -> None:
        mark_copies(module)

    model.register_forward_hook(after_forward)
    _install_step_guard()


@functools.cache
def _install_step_guard() -> RemovableHandle:
    """Register :func:`_refuse_copies` for every optimizer of this process, once.

    NOTE: process-wide by torch's design (an optimizer is built after ``apply_fsdp2``, anywhere);
    the cache makes repeated ``apply_fsdp2`` calls register it once.
    """
    return register_optimizer_step_pre_hook(_refuse_copies)


def _refuse_copies(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    copies = sum(
        1 for group in optimizer.param_groups for p in group["params"] if getattr(p, COPY_MARK, 0)
    )
    if copies:
        raise ForgeConfigError(
            f"this optimizer holds FSDP2's unsharded copies of {copies} parameters (a forward "
            "ran before it was built and no backward followed), so it would step tensors FSDP2 "
            "discards; build the optimizer before the first forward, or call "
            "forge_fsdp_wrap.reshard(model) before building it"
        )

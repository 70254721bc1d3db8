"""Small contracts through which layers cooperate without importing each other.

A layer marks modules or gives them a method; another layer (or the training loop) looks for the
mark. No registry, no global state: everything lives on the modules.

- **After the optimizer step.** A module with a method ``forge_after_optimizer_step()`` wants to
  run once after every ``optimizer.step()`` (the MoE expert-bias update, Float8 scale
  precompute). :func:`attach_optimizer_hooks` installs one post-step hook on an optimizer that
  calls them all, in module order.
- **Auxiliary losses.** A module with a method ``forge_pop_aux_loss() -> Tensor | None`` hands
  over the auxiliary loss of its last training forward (e.g. an MoE load-balancing loss) and
  forgets it. :func:`pop_aux_losses` sums them; the training loop adds the sum to the loss
  before dividing by the gradient-accumulation steps.
- **Expert-parallel parameters.** :func:`mark_expert_parallel` tags a module whose parameters
  are sharded over the ``ep`` mesh axis (DTensor ``Shard(0)``). Data-parallel wrappers must then
  (1) shard it on the experts' data-parallel mesh (:func:`forge_core.mesh_dims.get_expert_dp_mesh`)
  instead of the dense one, (2) divide its gradients by the full data-parallel degree (its own
  mesh is ``ep`` times smaller), and (3) wrap the block holding it per sub-module, so no
  reduce-scatter of the block runs between the expert-parallel all-to-alls of its backward.
- **Left out of torch.compile.** A module class with ``forge_no_compile = True`` cannot be traced
  as one graph (e.g. it reads split sizes on the host). Per-block compilation then compiles the
  block's other composite children and runs this module eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "AFTER_STEP_METHOD",
    "AUX_LOSS_METHOD",
    "attach_optimizer_hooks",
    "expert_parallel_modules",
    "expert_parallel_size",
    "mark_expert_parallel",
    "opts_out_of_compile",
    "pop_aux_losses",
]

AFTER_STEP_METHOD = "forge_after_optimizer_step"
AUX_LOSS_METHOD = "forge_pop_aux_loss"
_EP_ATTR = "_forge_expert_parallel"


def _with_method(model: nn.Module, method: str) -> list[nn.Module]:
    return [m for m in model.modules() if callable(getattr(m, method, None))]


def attach_optimizer_hooks(model: nn.Module, optimizer: torch.optim.Optimizer) -> RemovableHandle:
    """Call every ``forge_after_optimizer_step()`` of ``model`` after each ``optimizer.step()``.

    Returns the hook handle (``.remove()`` detaches it). With gradient accumulation the hook
    runs once per optimizer step, not per micro-batch, which is what per-step state (token
    counts, scales) needs.
    """
    modules = _with_method(model, AFTER_STEP_METHOD)

    def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for module in modules:
            getattr(module, AFTER_STEP_METHOD)()

    return optimizer.register_step_post_hook(after_step)


def pop_aux_losses(model: nn.Module) -> torch.Tensor | None:
    """Sum of the auxiliary losses the modules of ``model`` hold from their last forward."""
    losses = [getattr(m, AUX_LOSS_METHOD)() for m in _with_method(model, AUX_LOSS_METHOD)]
    losses = [loss for loss in losses if loss is not None]
    if not losses:
        return None
    return torch.stack([loss.float() for loss in losses]).sum()


def opts_out_of_compile(module: nn.Module) -> bool:
    """Whether ``module`` or a module inside it declares ``forge_no_compile = True``."""
    return any(getattr(m, "forge_no_compile", False) is True for m in module.modules())


def mark_expert_parallel(module: nn.Module, ep_size: int) -> None:
    """Tag ``module``: its parameters are sharded over an ``ep`` axis of ``ep_size`` ranks."""
    module.__dict__[_EP_ATTR] = ep_size


def expert_parallel_size(module: nn.Module) -> int:
    """The ``ep`` degree ``module`` was marked with (1 when unmarked)."""
    return module.__dict__.get(_EP_ATTR, 1)


def expert_parallel_modules(model: nn.Module) -> list[nn.Module]:
    """Modules of ``model`` marked by :func:`mark_expert_parallel` with an ep degree > 1."""
    return [m for m in model.modules() if expert_parallel_size(m) > 1]

"""A module's per-head parameters split with its heads: :class:`ShardedHeadParams`.

Some attention modules hold a parameter with one value per head, used in their forward beside
the projections: GPT-OSS's and GraniteSWA's attention sinks (one logit per query head), Doge's
``A`` (one per key/value head). Once ``q_proj`` (or ``v_proj``) is split column-wise, a tp
rank computes only its own heads, so it must see only its own heads' values: left whole, the
forward would pair every head's value with half of the heads (a shape error at best, the wrong
heads at worst).

The style stores each named parameter as a ``Shard(dim)`` DTensor over tp (so the state dict,
``full_tensor()`` and checkpoints are the unsharded model's, and FSDP2 composes as with
``ColwiseParallel``'s weights) and, while the module runs, puts the rank's local shard where the
forward reads the parameter (``to_local``, differentiable: the gradient lands on the rank's
shard). transformers names this split ``local_colwise`` on a parameter; forge's styles split
modules, so the style sits on the module that holds the parameter.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from forge_core.errors import ForgeConfigError
from forge_core.torch_compat import swap_parameter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ShardedHeadParams"]


class ShardedHeadParams(ParallelStyle):
    """Split ``names`` (parameters of the module, one value per head along ``dim``) over tp
    like the heads; the module's forward sees the rank's own shard as a plain tensor."""

    def __init__(self, names: tuple[str, ...], dim: int = 0) -> None:
        super().__init__()
        self.names, self.dim = tuple(names), dim

    def __repr__(self) -> str:
        return f"ShardedHeadParams({', '.join(self.names)}, dim={self.dim})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        own = dict(module.named_parameters(recurse=False))
        missing = [name for name in self.names if name not in own]
        if missing:
            raise ForgeConfigError(
                f"{type(module).__name__} has no parameter '{missing[0]}' for ShardedHeadParams"
            )
        tp = device_mesh.size()
        for name in self.names:
            param = own[name]
            if param.shape[self.dim] % tp:
                raise ForgeConfigError(
                    f"{type(module).__name__}.{name} has {param.shape[self.dim]} heads along dim "
                    f"{self.dim}, which tp={tp} does not divide; choose a tp that divides it"
                )
            if not isinstance(param, DTensor):
                sharded = distribute_tensor(param, device_mesh, [Shard(self.dim)])
                module.register_parameter(
                    name, nn.Parameter(sharded, requires_grad=param.requires_grad)
                )
        held: dict[str, torch.Tensor] = {}

        # NOTE: in the module's own pre-hook, as forge_tp_plans.styles.ReplicatedWithGradAllReduce:
        # it sees the parameter the forward would use (under FSDP2 the unsharded one) and puts
        # it back before that unit reshards.
        def local(mod: nn.Module, args: object) -> None:
            for name in self.names:
                param = getattr(mod, name)
                if isinstance(param, DTensor):
                    held[name] = swap_parameter(mod, name, param.to_local())

        def restore(mod: nn.Module, args: object, output: object) -> None:
            for name in self.names:
                if name in held:
                    swap_parameter(mod, name, held.pop(name))

        module.register_forward_pre_hook(local)
        module.register_forward_hook(restore, always_call=True)
        return module

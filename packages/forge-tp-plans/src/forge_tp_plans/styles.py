"""Parallel styles: Hugging Face style names translated to torch's, and 1x1-conv styles.

``translate_parallel_style`` maps the style strings of transformers 4.x and 5.x to torch
``ParallelStyle`` objects (or ``None`` for "keep this module replicated"). Styles that only make
sense for MoE experts or model-specific fused layouts are refused with the reason: silently
approximating them would give wrong numbers.

torch's DTensor convolution does not shard channels correctly (column-parallel raises,
row-parallel returns wrong values), so 1x1 ``nn.Conv2d`` layers get styles of their own that run
the convolution on local shards with explicit collectives: the column-parallel input gets an
identity forward / all-reduce backward, the row-parallel output an all-reduce forward / identity
backward, and the row-parallel bias is added once, after the reduction.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import overload

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from forge_core.errors import ForgeConfigError, did_you_mean
from forge_core.torch_compat import swap_parameter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "HF_STYLE_NAMES",
    "ColwiseConv1x1",
    "ReplicatedWithGradAllReduce",
    "RowwiseConv1x1",
    "describe_style",
    "translate_parallel_style",
]

# transformers 4.x and 5.x style names -> a factory of the torch style (None = replicated).
_TRANSLATIONS = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    # nn.Embedding: rowwise shards the vocabulary (masked lookup + all-reduce), colwise the dim.
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    # 4.5x "local_*": same sharding with plain-tensor params; forge keeps DTensor params (FSDP2
    # composes with them) and reduces in the layer, so a "gather" on the parent becomes a no-op.
    "local_colwise": lambda: ColwiseParallel(),
    "local_rowwise": lambda: RowwiseParallel(),
    "replicate": lambda: None,
    "replicated_with_grad_allreduce": lambda: ReplicatedWithGradAllReduce(),
}
_REFUSED = {
    "gather": "it all-reduces a parent's output; forge only accepts it over local_rowwise children",
    "local": "keeps expert weights unsharded inside MoE blocks: an MoE style, handled by forge-moe-ep",
    "isolated": "an MoE expert style, handled by forge-moe-ep",
    "ep_router": "an MoE router style, handled by forge-moe-ep",
    "grouped_gemm": "an MoE expert style, handled by forge-moe-ep",
    "moe_tp_experts": "an MoE expert style, handled by forge-moe-ep",
    "moe_identity_expert": "an MoE expert style, handled by forge-moe-ep",
    # transformers 5.x registers it once an MoE model with expert dispatch is imported
    "ep_dispatch_experts": "dispatches tokens to experts over an EP group: an MoE style, handled by forge-moe-ep",
    "all_reduce": "all-reduces partial MoE expert outputs: an MoE style, handled by forge-moe-ep",
    # transformers 5.17 (DeepGEMM's fused FP8xFP4 MoE, sm100)
    "megamoe_experts": "DeepGEMM's fused MoE experts: an MoE style, handled by forge-moe-ep",
    "megamoe_router": "DeepGEMM's fused MoE router: an MoE style, handled by forge-moe-ep",
    "packed_colwise": "shards fused [gate; up] weights half by half; give an explicit plan",
    "packed_rowwise": "shards fused weights half by half; give an explicit plan",
    "local_packed_rowwise": "shards fused weights half by half; give an explicit plan",
    "mla_kv_a_proj": "a DeepSeek MLA-specific layout; give an explicit plan",
    "local_params": "runs a module on raw local shards; give an explicit plan",
}
HF_STYLE_NAMES = frozenset(_TRANSLATIONS) | frozenset(_REFUSED)


def translate_parallel_style(name: str) -> ParallelStyle | None:
    """The torch ``ParallelStyle`` for a transformers style string (``None``: stay replicated).

    Raises ``ForgeConfigError`` for unknown names and for MoE-only or fused-layout styles.
    """
    if name in _TRANSLATIONS:
        return _TRANSLATIONS[name]()
    if name in _REFUSED:
        raise ForgeConfigError(
            f"tensor-parallel style '{name}' is not supported: it {_REFUSED[name]}"
        )
    raise ForgeConfigError(
        f"unknown tensor-parallel style '{name}'{did_you_mean(name, HF_STYLE_NAMES)}; "
        f"known: {sorted(_TRANSLATIONS)}"
    )


def _layout(placements: object) -> str:
    if placements is None:
        return "?"
    seq = placements if isinstance(placements, tuple | list) else (placements,)
    return ",".join(
        "R"
        if isinstance(p, Replicate)
        else f"S({p.dim})"
        if isinstance(p, Shard)
        else "-"
        if p is None
        else type(p).__name__
        for p in seq
    )


def describe_style(style: ParallelStyle | None) -> str:
    """Short readable form, e.g. ``ColwiseParallel(in R -> out S(-1))``."""
    if style is None:
        return "replicated"
    name = type(style).__name__
    if isinstance(style, ColwiseParallel | RowwiseParallel):
        return f"{name}(in {_layout(style.input_layouts)} -> out {_layout(style.output_layouts)})"
    if isinstance(style, PrepareModuleInput):
        return f"{name}({_layout(style.input_layouts)} -> {_layout(style.desired_input_layouts)})"
    return name


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


def _check_conv(module: nn.Module, path: str) -> None:
    ok = (
        isinstance(module, nn.Conv2d)
        and tuple(module.kernel_size) == (1, 1)
        and tuple(module.stride) == (1, 1)
        and module.groups == 1
        and tuple(module.dilation) == (1, 1)
        and module.padding in ((0, 0), 0, "valid")
    )
    if not ok:
        raise ForgeConfigError(
            f"'{path}' ({module!r}) cannot be tensor-parallel: only nn.Linear and 1x1 nn.Conv2d "
            "(stride 1, no padding, groups 1) are supported"
        )


class _Conv1x1Style(ParallelStyle):
    weight_dim: int
    bias_placement: Shard | Replicate
    # Each subclass's static method: the conv forward that runs on local shards over ``group``.
    _forward: Callable[[dist.ProcessGroup], Callable[[nn.Conv2d, torch.Tensor], torch.Tensor]]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_conv(module, type(self).__name__)

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                placement = Shard(self.weight_dim) if pname == "weight" else self.bias_placement
                mod.register_parameter(
                    pname,
                    nn.Parameter(
                        distribute_tensor(param, mesh, [placement]),
                        requires_grad=param.requires_grad,
                    ),
                )

        distribute_module(module, device_mesh, partition)
        module.forward = types.MethodType(self._forward(device_mesh.get_group()), module)
        return module


class ColwiseConv1x1(_Conv1x1Style):
    """Column parallel 1x1 conv: output channels sharded; input replicated, output channel-sharded.

    Input ``[B, C_in, H, W]`` (full) -> output ``[B, C_out / tp, H, W]`` (local shard).
    """

    weight_dim = 0
    bias_placement = Shard(0)

    @staticmethod
    def _forward(group: dist.ProcessGroup):  # noqa: ANN205
        def forward(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
            x = _CopyToParallel.apply(_local(x), group)
            return F.conv2d(x, _local(self.weight), _local(self.bias))

        return forward


class RowwiseConv1x1(_Conv1x1Style):
    """Row parallel 1x1 conv: input channels sharded; partial outputs all-reduced, bias added once.

    Input ``[B, C_in / tp, H, W]`` (local shard) -> output ``[B, C_out, H, W]`` (replicated).
    """

    weight_dim = 1
    bias_placement = Replicate()

    @staticmethod
    def _forward(group: dist.ProcessGroup):  # noqa: ANN205
        def forward(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
            y = _ReduceFromParallel.apply(F.conv2d(_local(x), _local(self.weight)), group)
            bias = _local(self.bias)
            return y if bias is None else y + bias.view(1, -1, 1, 1)

        return forward


class ReplicatedWithGradAllReduce(ParallelStyle):
    """Parameters replicated on every tp rank (plain tensors), gradients summed over tp.

    For a module that works on a tp rank's own part of the features, such as a per-head q/k
    norm after a column-parallel projection (Qwen3, Gemma3): each rank's backward gives its
    weight the gradient of its own heads only, and the true gradient is their sum. Left plain,
    the weights would drift apart across the tp ranks, silently. Each forward hands the module
    its parameters through an identity whose backward all-reduces over tp (transformers' style
    ``replicated_with_grad_allreduce``); names, shapes and state dicts do not change, and under
    FSDP2 the summed gradient is what it reduce-scatters.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        names = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        held: dict[str, torch.Tensor] = {}

        # NOTE: swapped in the module's own pre-hook, so it sees the parameter the forward would
        # use (under FSDP2 the unsharded one, set by the enclosing unit's pre-forward) and puts
        # it back before that unit reshards.
        def route(mod: nn.Module, args: object) -> None:
            for name in names:
                param = getattr(mod, name)
                held[name] = swap_parameter(mod, name, _CopyToParallel.apply(param, group))

        def restore(mod: nn.Module, args: object, output: object) -> None:
            for name in names:
                if name in held:
                    swap_parameter(mod, name, held.pop(name))

        module.register_forward_pre_hook(route)
        module.register_forward_hook(restore, always_call=True)
        return module

"""Parallel styles: Hugging Face style names translated to torch's, and styles of forge's own.

``translate_parallel_style`` maps the style strings of transformers 4.x and 5.x to torch
``ParallelStyle`` objects (or ``None`` for "keep this module replicated"). Styles that only make
sense for MoE experts are refused with the reason: silently approximating them would give wrong
numbers.

torch's DTensor convolution does not shard channels correctly (column-parallel raises,
row-parallel returns wrong values), so 1x1 ``nn.Conv2d`` layers get styles of their own that run
the convolution on local shards with explicit collectives: the column-parallel input gets an
identity forward / all-reduce backward, the row-parallel output an all-reduce forward / identity
backward, and the row-parallel bias is added once, after the reduction.

Fused ("packed") Linears, whose output (``packed_colwise``) or input (``packed_rowwise``) is
``parts`` tensors laid end to end (``[gate; up]``), get ``PackedColwiseLinear`` and
``PackedRowwiseLinear`` (built on the row-segment styles of :mod:`forge_tp_plans.fused_styles`);
DeepSeek-V2 style MLA's ``kv_a_proj_with_mqa`` gets ``MlaKvAProjReplicated`` (see each class).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from forge_core.errors import ForgeConfigError, did_you_mean
from forge_core.torch_compat import swap_parameter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from .fused_styles import (
    Segments,
    _ColwiseRows,
    _CopyToParallel,
    _distribute,
    _local,
    _ReduceFromParallel,
    _RowwiseRows,
)

__all__ = [
    "HF_STYLE_NAMES",
    "ColwiseConv1x1",
    "MlaKvAProjReplicated",
    "PackedColwiseLinear",
    "PackedRowwiseLinear",
    "ReplicatedWithGradAllReduce",
    "RowwiseConv1x1",
    "bind_style",
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
    # Fused [gate; up] Linears. A pattern naming a 3-D MoE expert parameter
    # (``experts.gate_up_proj``) is refused by apply_tensor_parallel: forge converts known
    # Hugging Face MoE blocks to its own MoE first (forge_moe_ep.convert_hf_moe), experts on ep.
    "packed_colwise": lambda: PackedColwiseLinear(),
    "packed_rowwise": lambda: PackedRowwiseLinear(),
    # 4.5x's plain-tensor variant: forge keeps DTensor parameters (as for local_rowwise)
    "local_packed_rowwise": lambda: PackedRowwiseLinear(),
    # Needs qk_rope_head_dim, from the model: bind_style gives it
    "mla_kv_a_proj": lambda: MlaKvAProjReplicated(),
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
    if isinstance(style, PackedColwiseLinear | PackedRowwiseLinear):
        return f"{name}(parts {style.parts})"
    if isinstance(style, MlaKvAProjReplicated):
        return f"{name}(rope dim {'?' if style.rope_dim is None else style.rope_dim})"
    return name


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
        _distribute(module, device_mesh, Shard(self.weight_dim), self.bias_placement)
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


# ---------------------------------------------------------------------------------------------
# Fused ("packed") Linears
#
# A packed dimension of global size N holds ``parts`` tensors end to end; split each into tp
# slices and number the resulting ``parts * tp`` blocks k = 0, 1, ... in order. Two layouts give
# every rank ``parts`` of them:
# - contiguous (torch's ``Shard``): rank r holds blocks r*parts ... r*parts + parts - 1;
# - packed (what the model's own code needs, e.g. ``chunk(2, -1)`` into matching gate and up):
#   rank r holds blocks r, tp + r, 2*tp + r, ... (its slice of every part).
# The packed layout is the row-segment layout of forge_tp_plans.fused_styles with ``parts``
# equal segments, each split over tp: the all-to-all between the two is that module's.
# NOTE (design): the parameters are stored in the contiguous layout, as plain ``Shard`` DTensors,
# so ``full_tensor()``, the state dict and checkpoints are the unsharded model's, names and values,
# and FSDP2 composes with them as with ``ColwiseParallel``'s. Only torch's ``_StridedShard``
# placement could describe the packed layout itself (transformers' choice), and it is private
# torch (forge touches none outside forge_core.torch_compat; it may change in any of the torch
# releases forge runs on, and FSDP2's own dp sharding on top of it is unproven here). Storing
# packed rows under a ``Shard`` placement instead would make ``full_tensor()`` and the state
# dict a permutation of the weight. The
# price is an all-to-all of the packed activation in forward and of its gradient in backward
# (each rank keeps 1/tp of its blocks and exchanges the rest); the activation is exchanged, not
# the weight, so no extra copy of a weight is saved for backward (under FSDP2 that would keep an
# unsharded weight alive). Every number is the one the unsharded layer computes (the same dot
# products), so parity is exact up to the matmul's own rounding.
# ---------------------------------------------------------------------------------------------


def _check_packed(path: str, size: int, what: str, parts: int, tp: int) -> None:
    if size % (parts * tp):
        raise ForgeConfigError(
            f"'{path}': {what} {size} must split in {parts} equal parts, each divisible by "
            f"tp={tp} (a multiple of {parts * tp})"
        )


def _check_linear(module: nn.Module, path: str, style: str) -> None:
    if not isinstance(module, nn.Linear):
        raise ForgeConfigError(
            f"'{path}' is a {type(module).__name__}: {style} splits nn.Linear modules only (a "
            "3-D MoE expert parameter such as experts.gate_up_proj is split by forge-moe-ep)"
        )


class _PackedLinear(ParallelStyle):
    """What the packed Linear styles share: ``parts``, the size check of the packed dimension
    (``_features``), and its layout: ``parts`` equal row segments, each split over tp."""

    _features: str

    def __init__(self, *, parts: int = 2) -> None:
        super().__init__()
        if parts < 1:
            raise ForgeConfigError(f"{type(self).__name__}(parts={parts}): parts must be >= 1")
        self.parts = parts

    def check(self, module: nn.Module, path: str, tp: int) -> None:
        """Raise ``ForgeConfigError`` unless ``module`` can be split over ``tp`` ranks."""
        _check_linear(module, path, type(self).__name__)
        _check_packed(path, getattr(module, self._features), self._features, self.parts, tp)

    def _known_rows(self, module: nn.Module, path: str) -> Segments:
        return ((getattr(module, self._features) // self.parts, True),) * self.parts


class PackedColwiseLinear(_PackedLinear, _ColwiseRows):
    """Column parallel ``nn.Linear`` whose output is ``parts`` tensors end to end (``[gate; up]``).

    Input replicated; output ``[..., out_features / tp]``, local and packed: this rank's slice of
    each part, in order (``[gate_r; up_r]``), so the model's ``chunk(parts, -1)`` on it gives
    matching local pieces. transformers' ``packed_colwise`` on a Linear. Weight and bias are
    ``Shard(0)`` DTensors of the unsharded values (see the NOTE above ``_check_packed``); the
    output is computed in that contiguous layout and moved to the packed one by an all-to-all.
    The input's gradient is all-reduced over tp (as for any column-parallel layer).
    """

    _features = "out_features"


class PackedRowwiseLinear(_PackedLinear, _RowwiseRows):
    """Row parallel ``nn.Linear`` whose input is ``parts`` tensors end to end.

    transformers' ``packed_rowwise`` / ``local_packed_rowwise``: the weight's last (input) dim
    is packed, the bias replicated. A plain-tensor input is this rank's packed shard
    (``[a_r; b_r]``, e.g. ``cat`` of the outputs of column-parallel layers); a DTensor input
    is taken in torch's contiguous ``Shard(-1)`` layout instead. Output: the partial products
    all-reduced, the bias added once, replicated. The weight is a ``Shard(1)`` DTensor of the
    unsharded values (see the NOTE above ``_check_packed``); the packed input is moved to that
    contiguous layout by an all-to-all (its gradient back by another).
    """

    _features = "in_features"


# ---------------------------------------------------------------------------------------------
# DeepSeek-V2 style MLA (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-Lite, LongCat-Flash, ...)
# ---------------------------------------------------------------------------------------------


class _ReduceGradTail(torch.autograd.Function):
    """Identity forward; backward all-reduces the last ``n`` features of the gradient over tp."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.n, ctx.group = n, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        grad = grad.clone(memory_format=torch.contiguous_format)
        tail = grad[..., -ctx.n :].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.n :] = tail
        return grad, None, None


class MlaKvAProjReplicated(ParallelStyle):
    """MLA's ``kv_a_proj_with_mqa`` (transformers' ``mla_kv_a_proj``): replicated weights, the
    gradient of the output's last ``rope_dim`` features summed over tp.

    Its output is ``[compressed kv (kv_lora_rank); k_rope (qk_rope_head_dim)]``. The compressed
    kv goes through the replicated ``kv_a_layernorm`` into the column-parallel ``kv_b_proj``,
    whose input gradient is all-reduced already: complete on every rank. ``k_rope`` is one head
    shared by every attention head, and each rank uses it for its own heads only, so its
    gradient on a rank covers those heads: the true gradient is the sum over tp. With that sum
    the output gradient is complete and identical on every rank, and so are the weight's and
    the input's (nothing else is summed: the compressed part's would count tp times). The
    parameters stay plain tensors, as for a replicated module. ``rope_dim`` is
    ``qk_rope_head_dim``: given here, by :func:`bind_style` (from the model), or read at apply
    time from ``module.config`` (where transformers puts the config).
    """

    def __init__(self, rope_dim: int | None = None) -> None:
        super().__init__()
        if rope_dim is not None and rope_dim < 1:
            raise ForgeConfigError(f"MlaKvAProjReplicated(rope_dim={rope_dim}): must be >= 1")
        self.rope_dim = rope_dim

    def bind(self, model: nn.Module, fqn: str) -> MlaKvAProjReplicated:
        """This style with ``rope_dim`` read from ``model``: the attention module holding
        ``fqn`` (its ``qk_rope_head_dim``), else the model's (text) config."""
        if self.rope_dim is not None:
            return self
        parent = model.get_submodule(fqn.rpartition(".")[0])
        rope = getattr(parent, "qk_rope_head_dim", None)
        if not isinstance(rope, int):
            rope = _config_rope_dim(model)
        if not isinstance(rope, int):
            raise ForgeConfigError(
                f"'{fqn}' has style mla_kv_a_proj, which needs qk_rope_head_dim (the RoPE part "
                f"of its output); neither {type(parent).__name__} nor the model config has it. "
                "Give MlaKvAProjReplicated(rope_dim=...) in an explicit plan"
            )
        return MlaKvAProjReplicated(rope_dim=rope)

    def check(self, module: nn.Module, path: str, tp: int) -> int:
        """Raise ``ForgeConfigError`` unless this style fits ``module``; returns ``rope_dim``."""
        _check_linear(module, path, type(self).__name__)
        assert isinstance(module, nn.Linear)
        rope = self.rope_dim if self.rope_dim is not None else _config_rope_dim(module)
        if rope is None:
            raise ForgeConfigError(
                f"'{path}': qk_rope_head_dim is not known (the RoPE part of the output, whose "
                "gradient is summed over tp); bind the style to its model first "
                "(forge_tp_plans.styles.bind_style) or give MlaKvAProjReplicated(rope_dim=...)"
            )
        if not 0 < rope < module.out_features:
            raise ForgeConfigError(
                f"'{path}': qk_rope_head_dim {rope} must be less than out_features "
                f"{module.out_features} (kv_lora_rank + qk_rope_head_dim)"
            )
        return rope

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope = self.check(module, type(self).__name__, device_mesh.size())
        group = device_mesh.get_group()

        def hook(mod: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
            return _ReduceGradTail.apply(output, rope, group)

        module.register_forward_hook(hook)
        return module


def _config_rope_dim(holder: object) -> int | None:
    """``qk_rope_head_dim`` of ``holder.config`` (its text config for a multimodal one), or of
    ``holder`` itself when it is a config."""
    config = getattr(holder, "config", holder)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "qk_rope_head_dim", None)
    return rope if isinstance(rope, int) else None


def bind_style(style: ParallelStyle | None, model: nn.Module, fqn: str) -> ParallelStyle | None:
    """``style`` for the submodule ``fqn`` of ``model``, with what it reads from the model filled
    in (``MlaKvAProjReplicated``: ``qk_rope_head_dim``); other styles are returned as they are.
    Raises ``ForgeConfigError`` when the model lacks it."""
    if isinstance(style, MlaKvAProjReplicated):
        return style.bind(model, fqn)
    return style

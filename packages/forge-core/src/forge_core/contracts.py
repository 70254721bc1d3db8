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
- **Tensor-parallel record.** :func:`apply_tp_styles` applies ``{fqn: ParallelStyle}`` one module
  at a time and records, on the root model, the styles and the tp mesh (:class:`TPRecord`), no
  hook ids. :func:`restyle_tp` gives a module another style later, with public torch APIs only:
  Float8 applies the Float8 variant of a Linear's style to the Float8Linear that replaced it,
  and moves a parent's input preparation (a swappable stand-in module) to fp8 all-gathers.
- **Tensor-parallel opt-out.** A module class with a string ``forge_tp_skip`` runs whole on
  every tp rank: tensor-parallel plan entries naming a module inside it are dropped (reported
  as left whole; its own entry may still prepare its input and output layouts); the string
  says why. forge's MoE declares it: its experts shard
  over ``ep``, and a Hugging Face plan's expert entries would otherwise reach a converted block.
- **Sequence shards.** A module with a method ``forge_cp_problems(cp) -> list[str]`` says why it
  cannot compute exactly on ``1 / cp`` of each sequence (one line each; empty: it can):
  :func:`cp_problems_of` collects them and context parallelism refuses such a model (forge's
  MoE with the capacity dispatch, whose capacity is counted per whole sequence).
- **Float8 opt-out.** A module class with a string ``forge_float8_skip`` keeps every Linear inside
  it in high precision; the string is the reason that gets reported.
- **Components.** A model class with ``forge_components = ("encoder", "adapter", "decoder")``
  (names of child modules, in forward order) is made of sub-models that are parallelized one by
  one (a vision-language model); :func:`declare_components` declares them on an instance by
  dotted path instead (a Hugging Face VLM). :func:`model_components` lists them; FSDP2, AC and compile then
  work per component (each component's own blocks), and the stage-order contract checks and
  records every stage on the model and on each component.
- **Pipeline stages.** A model class with ``forge_pipeline_parts = {"first": (...), "blocks":
  "layers", "last": (...)}`` can be cut into pipeline stages: ``blocks`` names an
  ``nn.ModuleDict`` of blocks run in order, ``first`` the modules only the first stage keeps
  (embeddings), ``last`` those only the last keeps (final norm, head); a stage sets the others to
  None and its forward must then pass hidden states through. A model whose instance has a
  callable ``forge_pipeline_step`` (:func:`pipeline_step`) is split over pipeline ranks and runs
  its forward and backward itself, through a schedule: the training step hands it the inputs,
  the targets and the loss function instead of calling it.
- **Attention kernel.** An attention module whose class sets ``forge_attention = "causal"``
  computes its causal attention through :func:`causal_attention` (``F.scaled_dot_product_attention``
  unless a layer installed another kernel on it with :func:`set_attention_kernel`: context
  parallelism's exact attention across sequence shards). The kernel is kept in the module's
  ``__dict__``, like a hook: no submodule, no parameter, state dicts unchanged.
- **Sequence shards.** A model on which :func:`set_sequence_shard` put a shard function trains
  on a slice of each sequence: the training step passes its inputs and targets ``[B, S]``
  through it and calls the model with the global positions of the kept tokens as
  ``positions=`` (RoPE must see them), summing the token count and the loss over the ``cp``
  ranks too.
- **Packed documents.** An attention module's installed kernel whose class sets
  ``forge_documents = True`` takes ``documents=`` (:mod:`forge_core.documents`);
  :func:`causal_attention` refuses documents for any other kernel. A model marked by
  :func:`refuse_documents` (a Hugging Face model hooked to skip transformers' packed-sequence
  check) cannot mask them at all: the training step refuses packed positions for it.
- **Left out of torch.compile.** A module class (or instance) with ``forge_no_compile = True`` cannot be traced
  as one graph (e.g. it reads split sizes on the host). Per-block compilation then compiles the
  block's other composite children and runs this module eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInput,
    parallelize_module,
)
from torch.utils.hooks import RemovableHandle

from .documents import Documents
from .errors import ForgeConfigError

__all__ = [
    "TPRecord",
    "AFTER_STEP_METHOD",
    "after_step_functions",
    "apply_tp_styles",
    "register_after_optimizer_step",
    "restyle_tp",
    "tp_record",
    "AUX_LOSS_METHOD",
    "attach_optimizer_hooks",
    "declare_components",
    "declared_components",
    "expert_parallel_modules",
    "expert_parallel_size",
    "mark_expert_parallel",
    "model_components",
    "opts_out_of_compile",
    "causal_attention",
    "pipeline_step",
    "sequence_shard",
    "set_attention_kernel",
    "set_sequence_shard",
    "pop_aux_losses",
    "cp_problems_of",
    "unwrap",
]

AFTER_STEP_METHOD = "forge_after_optimizer_step"
AUX_LOSS_METHOD = "forge_pop_aux_loss"
CP_PROBLEMS_METHOD = "forge_cp_problems"
_EP_ATTR = "_forge_expert_parallel"


def _with_method(model: nn.Module, method: str) -> list[nn.Module]:
    return [m for m in model.modules() if callable(getattr(m, method, None))]


def cp_problems_of(model: nn.Module, cp: int) -> list[str]:
    """Why ``model`` cannot run on ``cp`` sequence shards: what its modules'
    ``forge_cp_problems(cp)`` say (see the module docstring), each line once."""
    lines = [
        p
        for m in _with_method(model, CP_PROBLEMS_METHOD)
        for p in getattr(m, CP_PROBLEMS_METHOD)(cp)
    ]
    return list(dict.fromkeys(lines))


_AFTER_STEP_FNS = "_forge_after_step_fns"


def register_after_optimizer_step(model: nn.Module, fn: Callable[[], None]) -> None:
    """Have :func:`attach_optimizer_hooks` also call ``fn()`` after each step (e.g. Float8's
    scale precompute for FSDP2, which needs the whole model)."""
    model.__dict__.setdefault(_AFTER_STEP_FNS, []).append(fn)


def after_step_functions(model: nn.Module) -> list[Callable[[], None]]:
    """The functions :func:`register_after_optimizer_step` registered on ``model`` itself."""
    return list(model.__dict__.get(_AFTER_STEP_FNS, ()))


def attach_optimizer_hooks(model: nn.Module, optimizer: torch.optim.Optimizer) -> RemovableHandle:
    """Call every ``forge_after_optimizer_step()`` of ``model`` (and every function registered
    with :func:`register_after_optimizer_step`) after each ``optimizer.step()``.

    Returns the hook handle (``.remove()`` detaches it). With gradient accumulation the hook
    runs once per optimizer step, not per micro-batch, which is what per-step state (token
    counts, scales) needs.
    """
    modules = _with_method(model, AFTER_STEP_METHOD)
    fns = [fn for m in model.modules() for fn in m.__dict__.get(_AFTER_STEP_FNS, ())]

    def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for module in modules:
            getattr(module, AFTER_STEP_METHOD)()
        for fn in fns:
            fn()

    return optimizer.register_step_post_hook(after_step)


def pop_aux_losses(model: nn.Module) -> torch.Tensor | None:
    """Sum of the auxiliary losses the modules of ``model`` hold from their last forward."""
    losses = [getattr(m, AUX_LOSS_METHOD)() for m in _with_method(model, AUX_LOSS_METHOD)]
    losses = [loss for loss in losses if loss is not None]
    if not losses:
        return None
    return torch.stack([loss.float() for loss in losses]).sum()


COMPONENTS_ATTR = "forge_components"


def declare_components(model: nn.Module, paths: Mapping[str, str]) -> None:
    """Declare ``model``'s components on the instance: ``{name: dotted path of the module}``
    in forward order (a class one cannot edit, e.g. a Hugging Face vision-language model whose
    parts sit under ``model.``). Kept in the instance's ``__dict__``: no submodule, state dicts
    unchanged."""
    for name, path in paths.items():
        if not isinstance(model.get_submodule(path), nn.Module):
            raise ValueError(f"component {name!r}: {path!r} is not a module")
    model.__dict__[COMPONENTS_ATTR] = dict(paths)


def _component_paths(model: nn.Module) -> dict[str, str]:
    declared = model.__dict__.get(COMPONENTS_ATTR)
    if isinstance(declared, Mapping):
        return dict(declared)
    return {name: name for name in getattr(type(model), COMPONENTS_ATTR, ())}


def declared_components(model: nn.Module) -> tuple[str, ...]:
    """The component names ``model`` declares (its class, or :func:`declare_components` on the
    instance), including those a pipeline stage lacks."""
    return tuple(_component_paths(model))


def model_components(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for each component ``model`` declares (``[]`` if none); a component
    set to None (not on this pipeline stage) is left out."""
    out = []
    for name, path in _component_paths(model).items():
        parent, _, attr = path.rpartition(".")
        part = getattr(model.get_submodule(parent), attr) if parent else getattr(model, attr)
        if part is not None:
            out.append((name, part))
    return out


def opts_out_of_compile(module: nn.Module) -> bool:
    """Whether ``module`` or a module inside it declares ``forge_no_compile = True``."""
    return any(getattr(m, "forge_no_compile", False) is True for m in module.modules())


PIPELINE_STEP_ATTR = "forge_pipeline_step"


def pipeline_step(model: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The pipeline schedule step of a model split over pipeline ranks, else None.

    ``step(inputs, targets, loss_fn) -> loss sum``: runs the forward and backward of every
    micro-batch (``inputs``: the first stage's positional arguments, each split along the
    batch); ``loss_fn(output, targets) -> (loss to back-propagate, detached loss to report)``
    runs on the last stage; the returned report sum is the same on every pipeline rank.
    """
    step = model.__dict__.get(PIPELINE_STEP_ATTR)
    return step if callable(step) else None


def mark_expert_parallel(module: nn.Module, ep_size: int) -> None:
    """Tag ``module``: its parameters are sharded over an ``ep`` axis of ``ep_size`` ranks."""
    module.__dict__[_EP_ATTR] = ep_size


def expert_parallel_size(module: nn.Module) -> int:
    """The ``ep`` degree ``module`` was marked with (1 when unmarked)."""
    return module.__dict__.get(_EP_ATTR, 1)


def expert_parallel_modules(model: nn.Module) -> list[nn.Module]:
    """Modules of ``model`` marked by :func:`mark_expert_parallel` with an ep degree > 1."""
    return [m for m in model.modules() if expert_parallel_size(m) > 1]


# --------------------------------------------------------------------------- TP record
# NOTE (design, issue 18): torch's ParallelStyles register their forward hooks and drop the
# RemovableHandles (``parallelize_module`` returns the module), so a style, once applied to a
# module object, cannot be taken off it through public torch APIs. The record therefore keeps
# no hook ids, only ``{fqn: style}`` and the mesh. A module is restyled only after it was
# *replaced* (Float8 swaps ``nn.Linear`` for a new ``Float8Linear``; the old object leaves the
# model with its hooks), except a module whose style only prepares its inputs
# (``PrepareModuleInput`` and subclasses such as torchao's ``PrepareFloat8ModuleInput``, on
# parents such as ``attention``): that style is applied to a stand-in module kept in the real
# module's ``__dict__``, and the real module's one public forward pre-hook calls whichever
# stand-in is there, so a later stage can put another one there. Styles that distribute
# parameters (Colwise, Rowwise, SequenceParallel, ...) are applied to the module itself.
_TP_ATTR = "_forge_tp_record"
_STYLE_ATTR = "_forge_tp_style"  # on each module object a style was applied to: that style
_INPUT_ATTR = "_forge_tp_input"  # on a module whose style only prepares inputs: its stand-in


class _InputCarrier(nn.Module):
    """Stand-in that an input-preparation style is applied to: calling it runs the style's
    forward pre-hook and hands back the prepared ``(args, kwargs)``."""

    def forward(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, kwargs


def _prepare_input(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of a module whose style only prepares inputs: runs its stand-in.

    Looked up on ``module`` at each call (not captured), so swapping the stand-in needs no hook
    change and a deep copy of the model calls its own copy."""
    return getattr(module, _INPUT_ATTR)(*args, **kwargs)


@dataclass
class TPRecord:
    """The tensor-parallel styles applied to a model (``{fqn: style}``) and the tp mesh."""

    mesh: DeviceMesh
    styles: dict[str, ParallelStyle] = field(default_factory=dict)


def tp_record(model: nn.Module) -> TPRecord | None:
    """What :func:`apply_tp_styles` recorded on ``model`` (None without TP)."""
    return model.__dict__.get(_TP_ATTR)


def _prepares_inputs_only(style: ParallelStyle) -> bool:
    return isinstance(style, PrepareModuleInput)


def _carrier(module: nn.Module, mesh: DeviceMesh, style: ParallelStyle) -> nn.Module:
    """A new :class:`_InputCarrier` with ``style`` applied. ``module``'s children are visible
    on it while the style is applied (torchao's ``PrepareFloat8ModuleInput`` reads the Float8
    config of a child Linear then) and detached afterwards, so the carrier keeps no module alive."""
    carrier = _InputCarrier()
    children = list(module.named_children())
    for name, child in children:
        carrier.add_module(name, child)
    parallelize_module(carrier, mesh, style)
    for name, _ in children:
        delattr(carrier, name)
    return carrier


def _apply_one(record: TPRecord, fqn: str, module: nn.Module, style: ParallelStyle) -> None:
    if _prepares_inputs_only(style):
        hooked = _INPUT_ATTR in module.__dict__
        # In __dict__, not setattr: the stand-in must not become a submodule (state dict, FSDP).
        module.__dict__[_INPUT_ATTR] = _carrier(module, record.mesh, style)
        if not hooked:
            module.register_forward_pre_hook(_prepare_input, with_kwargs=True)
    else:
        parallelize_module(module, record.mesh, style)
    module.__dict__[_STYLE_ATTR] = style
    record.styles[fqn] = style


def apply_tp_styles(
    model: nn.Module, mesh: DeviceMesh, styles: Mapping[str, ParallelStyle]
) -> TPRecord:
    """Apply ``{fqn: style}`` to ``model``'s submodules (in order) and record them on ``model``.

    Input-preparation styles go through a swappable stand-in (see the NOTE above) so that
    :func:`restyle_tp` can replace them later; every other style is applied with torch's
    ``parallelize_module`` as is. Raises ``ValueError`` for an fqn that already has a style.
    """
    record = model.__dict__.setdefault(_TP_ATTR, TPRecord(mesh))
    for fqn, style in styles.items():
        if fqn in record.styles:
            raise ValueError(f"{fqn!r} already has a tensor-parallel style; use restyle_tp")
        _apply_one(record, fqn, model.get_submodule(fqn), style)
    return record


def restyle_tp(model: nn.Module, fqn: str, style: ParallelStyle) -> None:
    """Replace the TP style of submodule ``fqn`` with ``style``, through public torch APIs only.

    - The object at ``fqn`` is a new one (Float8 swapped the Linear; the old object left the
      model with its hooks): ``style`` is applied to it. Parameters already distributed with the
      same placements are left as they are.
    - The same object, whose style only prepares inputs: ``style`` must too; it replaces the
      old preparation, which no longer runs.
    - Any other object already styled is refused (``ValueError``): torch has no public way to
      remove a style's hooks.
    """
    record = tp_record(model)
    if record is None or fqn not in record.styles:
        raise KeyError(f"no tensor-parallel style was recorded for {fqn!r}")
    module = model.get_submodule(fqn)
    old = module.__dict__.get(_STYLE_ATTR)
    if old is not None and _INPUT_ATTR in module.__dict__ and not _prepares_inputs_only(style):
        raise ValueError(
            f"{fqn!r} has an input-preparation style ({type(old).__name__}); on the same module "
            f"it can only be replaced by another one, not by {type(style).__name__}"
        )
    if old is not None and _INPUT_ATTR not in module.__dict__:
        raise ValueError(
            f"cannot restyle {fqn!r}: it is the module object {type(old).__name__} was applied "
            "to, and torch has no public way to remove a style's hooks; replace the module "
            "first (as Float8 does when it swaps a Linear)"
        )
    _apply_one(record, fqn, module, style)


ATTENTION_ATTR = "forge_attention"
_KERNEL_ATTR = "_forge_attention_kernel"
#: ``kernel(q [B, H, s, D], k [B, Hkv, s, D], v, enable_gqa=...) -> [B, H, s, D]``: causal.
#: A kernel whose class sets ``forge_documents = True`` also takes ``documents=``
#: (:class:`forge_core.documents.Documents`) and keeps attention inside each document.
AttentionKernel = Callable[..., torch.Tensor]
DOCUMENTS_ATTR = "forge_documents"


def set_attention_kernel(module: nn.Module, kernel: AttentionKernel) -> None:
    """Have ``module`` (its class declares ``forge_attention = "causal"``) attend through
    ``kernel`` instead of SDPA."""
    if getattr(type(module), ATTENTION_ATTR, None) != "causal":
        raise TypeError(
            f"{type(module).__name__} does not declare forge_attention = 'causal': its attention "
            "does not go through forge_core.contracts.causal_attention"
        )
    module.__dict__[_KERNEL_ATTR] = kernel


def causal_attention(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    enable_gqa: bool,
    documents: Documents | None = None,
) -> torch.Tensor:
    """Causal attention of ``q, k, v [B, heads, seq, head_dim]`` for ``module``: its installed
    kernel (:func:`set_attention_kernel`), else ``F.scaled_dot_product_attention``. With
    ``documents`` each token attends inside its own document only (:mod:`forge_core.documents`);
    an installed kernel that cannot do that is refused in one line."""
    kernel = module.__dict__.get(_KERNEL_ATTR)
    if kernel is not None:
        if documents is None:
            return kernel(q, k, v, enable_gqa=enable_gqa)
        if not getattr(kernel, DOCUMENTS_ATTR, False):
            name = getattr(kernel, "__qualname__", type(kernel).__name__)
            raise ForgeConfigError(
                f"the attention kernel {name} installed on "
                f"{type(module).__name__} cannot keep attention inside packed documents; train "
                "on unpacked data or use a kernel that can (forge_cp's can)"
            )
        return kernel(q, k, v, enable_gqa=enable_gqa, documents=documents)
    if documents is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=enable_gqa
        )
    mask = documents.mask(slice(None), None, q.dtype)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=enable_gqa
    )


NO_DOCUMENTS_ATTR = "forge_no_documents"


def refuse_documents(model: nn.Module, reason: str | None) -> None:
    """Mark ``model`` as unable to keep attention inside packed documents, saying why (None:
    able again). The training step refuses packed positions for it in one line."""
    if reason is None:
        model.__dict__.pop(NO_DOCUMENTS_ATTR, None)
    else:
        model.__dict__[NO_DOCUMENTS_ATTR] = reason


def documents_refused(model: nn.Module) -> str | None:
    """Why ``model`` (under its DDP / compile wrappers) cannot mask packed documents, else None."""
    return unwrap(model).__dict__.get(NO_DOCUMENTS_ATTR)


SEQUENCE_SHARD_ATTR = "forge_sequence_shard"
#: ``shard(x [B, S, ...]) -> x [B, S / cp, ...]``: this rank's tokens, in the order it keeps them.
SequenceShard = Callable[[torch.Tensor], torch.Tensor]


def set_sequence_shard(model: nn.Module, shard: SequenceShard) -> None:
    """Train ``model`` on the part of each sequence ``shard`` keeps (see the module docstring)."""
    model.__dict__[SEQUENCE_SHARD_ATTR] = shard


def sequence_shard(model: nn.Module) -> SequenceShard | None:
    """The shard function :func:`set_sequence_shard` put on ``model`` (or on the module under
    its DDP / compile wrapper), else None."""
    return unwrap(model).__dict__.get(SEQUENCE_SHARD_ATTR)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under ``torch.compile`` and DDP (``module``) wrappers."""
    from torch.nn.parallel import DistributedDataParallel

    from .torch_compat import compiled_original

    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif (inner := compiled_original(model)) is not None:
            model = inner
        else:
            return model

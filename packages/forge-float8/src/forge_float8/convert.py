"""``apply_float8``: swap ``nn.Linear`` for torchao's ``Float8Linear``, after TP/EP, before AC.

Float8 training (torchao): forward GEMMs in E4M3, gradients in E5M2, dynamic scales; the master
weights keep their dtype. Recipes: ``tensorwise`` (one scale per tensor, fastest), ``rowwise``
and ``rowwise_with_gw_hp`` (per-row scales; the latter keeps the weight-gradient GEMM in high
precision), as torchao names them.

What is converted, and what is not (each skip is reported with its reason, see
:class:`Float8Report`):

- Linears inside a module whose class declares ``forge_float8_skip`` (forge_core.contracts):
  forge_moe_ep's MoE (its experts run grouped GEMMs that never call ``Float8Linear.forward``,
  its shared expert runs beside them, its router must stay fp32);
- the output head (``output``) unless ``convert_output_head=True`` (the logits feed a softmax
  over the whole vocabulary: fp8 error there costs the most);
- anything whose name contains a string of ``filter_fqns``;
- Linears whose ``in_features`` or ``out_features`` is not a multiple of 16 (fp8 GEMMs need it).

With tensor parallelism (applied first, recorded by ``forge_core.contracts.apply_tp_styles``):
a swapped Linear is a new module object without the TP hooks of the old one (which left the
model with them), so its recorded style is applied to the new object again
(``forge_core.contracts.restyle_tp``, torch's public ``parallelize_module``) —
``tensorwise`` gets torchao's Float8 styles (``Float8ColwiseParallel``, ``Float8RowwiseParallel``,
and ``PrepareFloat8ModuleInput`` on the parents that all-gather their input), so TP's
all-gathers move fp8; the rowwise recipes get their plain styles back. A parent is not swapped:
its input preparation runs through a swappable stand-in module, which ``restyle_tp`` replaces
by one with the fp8 style (no private torch hook dict is read or edited; see the NOTE in
:func:`_restyle_tensor_parallel`). gloo (CPU) cannot move
float8 tensors: on a gloo TP group whose plan all-gathers inputs (sequence parallelism) the
tensorwise recipe keeps plain styles (bf16 all-gathers; forcing ``tp_float8_all_gather=True``
there is refused); without SP the Float8 styles move nothing in fp8 and run on gloo too. FSDP2's fp8 all-gather
(``enable_fsdp_float8_all_gather``) is refused with TP: torchao's float8 weight wrapper calls
``aten.is_pinned`` on DTensor weights, which DTensor does not support.

With FSDP2 and fp8 all-gather, the weight scales must be precomputed after every optimizer step
(``precompute_float8_dynamic_scale_for_fsdp``); forge registers that on the model
(``forge_core.contracts.register_after_optimizer_step``), and
``forge_core.attach_optimizer_hooks(model, optimizer)`` runs it; forge's training loops do.

Known limit (torchao 0.18): ``Float8Linear`` casts its input to the autocast dtype only under
CUDA autocast, so under CPU autocast (forge's DDP / single-device bf16 on CPU) it computes from
fp32 inputs and ``rowwise_with_gw_hp`` fails on a dtype mismatch; FSDP2's bf16 ``param_dtype``
(or bf16 parameters) avoids both.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from forge_core.contracts import (
    TPRecord,
    register_after_optimizer_step,
    restyle_tp,
    tp_record,
)
from forge_core.errors import ForgeConfigError, did_you_mean
from forge_core.stages import stage
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
)

from .checks import check_torchao
from .config import FLOAT8_RECIPES
from .cpu import cpu_scaled_mm_supports

__all__ = ["RECIPES", "Float8Report", "apply_float8", "float8_report"]

log = logging.getLogger(__name__)

#: The recipes, as torchao names them (one list, shared with the config checks in forge_core).
RECIPES = FLOAT8_RECIPES
_REPORT_ATTR = "_forge_float8"


@dataclass(frozen=True)
class Float8Report:
    """What :func:`apply_float8` did: the recipe, converted Linears, skipped ones with reasons."""

    recipe: str
    emulate: bool
    fsdp_float8_all_gather: bool
    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    tp_styles: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        lines = [
            f"float8 {self.recipe}{' (emulated)' if self.emulate else ''}: "
            f"{len(self.converted)} Linear(s) converted, {len(self.skipped)} skipped, "
            f"fsdp fp8 all-gather {'on' if self.fsdp_float8_all_gather else 'off'}"
        ]
        # Layer indices folded to "*" so a deep model reads in a few lines.
        fold = functools.partial(re.sub, r"\.\d+(\.|$)", r".*\1")
        skipped = dict.fromkeys((fold(name), reason) for name, reason in self.skipped)
        lines += [f"  skipped {name}: {reason}" for name, reason in skipped]
        styles = Counter(style for _, style in self.tp_styles)
        if styles:
            lines.append(
                "  tp styles carried over: " + ", ".join(f"{s} x{n}" for s, n in styles.items())
            )
        return "\n".join(lines)


def float8_report(model: nn.Module) -> Float8Report | None:
    """The :class:`Float8Report` of ``model`` (None if Float8 was not applied)."""
    return model.__dict__.get(_REPORT_ATTR)


def _skip_reason(
    model: nn.Module,
    fqn: str,
    linear: nn.Linear,
    filter_fqns: Sequence[str],
    convert_output_head: bool,
) -> str | None:
    parts = fqn.split(".")
    for i in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:i]))
        reason = getattr(type(owner), "forge_float8_skip", None)
        if isinstance(reason, str):
            return f"inside {type(owner).__name__}: {reason}"
    if fqn == "output" and not convert_output_head:
        return (
            "output head: kept in high precision by default (convert_output_head=True converts it)"
        )
    hit = next((f for f in filter_fqns if f in fqn), None)
    if hit is not None:
        return f"matches filter_fqns entry {hit!r}"
    if linear.in_features % 16 or linear.out_features % 16:
        return (
            f"in_features={linear.in_features}, out_features={linear.out_features}: fp8 GEMMs "
            "need multiples of 16"
        )
    return None


def _default_emulate(model: nn.Module, device: torch.device | str | None, recipe: str) -> bool:
    """Emulate only on a GPU without fp8 GEMMs (below SM89), or on a CPU whose torch's CPU
    ``_scaled_mm`` cannot take ``recipe``'s scales (torch 2.11 and rowwise); else fp8 GEMMs.

    The GPU asked is the one the model runs on: ``device`` when given, else its parameters'
    device; a CPU model on a GPU machine never touches CUDA (asking would initialize it, which
    breaks every process forked afterwards). A meta model with no ``device`` asks the current
    GPU, if any.
    """
    where = torch.device(device) if device is not None else _params_device(model)
    if where is not None and where.type != "cuda":
        if where.type != "cpu" or cpu_scaled_mm_supports(recipe):
            return False
        warnings.warn(
            f"this torch ({torch.__version__}) has no CPU fp8 GEMM with {recipe} scales: "
            "Float8 runs emulated on CPU (fp8 rounding, high-precision GEMMs)",
            stacklevel=3,
        )
        return True
    if not torch.cuda.is_available():
        return False
    major, minor = torch.cuda.get_device_capability(where)
    if (major, minor) >= (8, 9):
        return False
    warnings.warn(
        f"GPU capability sm_{major}{minor} has no fp8 GEMMs (needs sm_89+): Float8 runs emulated "
        "(correct numerics, no speedup)",
        stacklevel=3,
    )
    return True


def _params_device(model: nn.Module) -> torch.device | None:
    """The device of ``model``'s first non-meta parameter (None: none, or all on meta)."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), None)


def apply_float8(
    model: nn.Module,
    *,
    recipe: str = "tensorwise",
    enable_fsdp_float8_all_gather: bool = True,
    filter_fqns: Sequence[str] = (),
    emulate: bool | None = None,
    convert_output_head: bool = False,
    tp_float8_all_gather: bool | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Convert ``model``'s eligible ``nn.Linear`` modules to Float8 training; returns ``model``.

    Order: after TP and EP, before AC, compile and FSDP2 (enforced). ``emulate=None`` emulates
    only on a GPU below SM89 (with a warning); the GPU is ``device`` (where a meta model will
    be materialized), else the one the parameters are on. ``tp_float8_all_gather`` (tensorwise with TP):
    None = fp8 TP styles unless the tp group is gloo. Raises ``ForgeConfigError`` for an unknown recipe,
    for fp8 all-gather with TP or with a rowwise recipe, and when no Linear is convertible.
    """
    if recipe not in RECIPES:
        raise ForgeConfigError(
            f"float8 recipe={recipe!r} is unknown{did_you_mean(str(recipe), RECIPES)}; choose one "
            f"of {list(RECIPES)}"
        )
    if isinstance(filter_fqns, str):
        raise ForgeConfigError(
            f"filter_fqns={filter_fqns!r} must be a list of strings, not a string"
        )
    record = tp_record(model)
    if enable_fsdp_float8_all_gather and record is not None and record.mesh.size() > 1:
        raise ForgeConfigError(
            "enable_fsdp_float8_all_gather=True with tensor parallelism: torchao's float8 weight "
            "wrapper does not support DTensor (TP) weights (aten.is_pinned). Set "
            "enable_fsdp_float8_all_gather=False (TP's own all-gathers still move fp8 with the "
            "tensorwise recipe)"
        )
    tp_fp8 = False
    if record is not None and recipe == "tensorwise":
        import torch.distributed as dist

        blocked = dist.get_backend(record.mesh.get_group()) == "gloo" and _gathers_inputs(record)
        if tp_float8_all_gather and blocked:
            raise ForgeConfigError(
                "tp_float8_all_gather=True on a gloo tp group with sequence parallelism: gloo "
                "cannot all-gather float8 tensors; leave it None (bf16 all-gathers on gloo), turn "
                "sequence parallelism off, or run on NCCL"
            )
        tp_fp8 = (not blocked) if tp_float8_all_gather is None else tp_float8_all_gather
    if enable_fsdp_float8_all_gather and recipe != "tensorwise":
        raise ForgeConfigError(
            f"enable_fsdp_float8_all_gather=True needs recipe='tensorwise' (torchao casts FSDP "
            f"all-gathers with one scale per tensor); got recipe={recipe!r}: set it False"
        )
    check_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    with stage(model, "float8"):
        linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
        skipped = {
            n: r
            for n, m in linears.items()
            if (r := _skip_reason(model, n, m, filter_fqns, convert_output_head)) is not None
        }
        chosen = [n for n in linears if n not in skipped]
        if not chosen:
            why = "; ".join(f"{n}: {r}" for n, r in skipped.items()) or "the model has no nn.Linear"
            raise ForgeConfigError(f"apply_float8: no Linear can be converted ({why})")
        emulate = _default_emulate(model, device, recipe) if emulate is None else emulate
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(recipe),
            enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather,
            emulate=emulate,
        )
        keep = set(chosen)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: n in keep)
        tp_styles = _restyle_tensor_parallel(model, keep, tp_fp8) if record is not None else ()
        if enable_fsdp_float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            register_after_optimizer_step(
                model, lambda: precompute_float8_dynamic_scale_for_fsdp(model)
            )
        report = Float8Report(
            recipe,
            emulate,
            enable_fsdp_float8_all_gather,
            tuple(chosen),
            tuple(skipped.items()),
            tp_styles,
        )
        model.__dict__[_REPORT_ATTR] = report
        log.info("%s", report)
    return model


def _gathers_inputs(record: TPRecord) -> bool:
    """Whether the TP plan all-gathers activations (sequence parallelism) before a Linear."""
    from torch.distributed.tensor import Replicate

    return any(
        type(style) is PrepareModuleInput
        or (isinstance(style, ColwiseParallel) and style.input_layouts[0] != Replicate())
        for style in record.styles.values()
    )


def _restyle_tensor_parallel(
    model: nn.Module, converted: set[str], fp8: bool
) -> tuple[tuple[str, str], ...]:
    """Give swapped Linears their TP style back (fp8 styles for tensorwise); see module doc.

    NOTE (design, issue 18): the TP stage records ``{fqn: style}`` and the mesh, and this stage
    applies the (Float8 variant of the) recorded style to the *new* Float8Linear objects through
    torch's public ``parallelize_module``; a parent's ``PrepareModuleInput`` becomes
    ``PrepareFloat8ModuleInput`` by swapping its stand-in (``forge_core.contracts.restyle_tp``).
    Not chosen: (a) removing the old hooks by handle — torch's ParallelStyles drop their
    ``RemovableHandle``s, so only private hook dicts could; (c) TP choosing the Float8 styles
    itself (torchtitan's way) — torchtitan converts to Float8 before TP, while under forge's
    order TP -> CP -> EP -> Float8 TP sees plain ``nn.Linear`` modules, which torchao's Float8 styles
    refuse, and cannot know which Linears Float8 will skip.
    """
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    record = tp_record(model)
    assert record is not None
    changed = []
    colwise_children: dict[str, str] = {}  # parent fqn -> first fp8 colwise child name
    for fqn, style in list(record.styles.items()):
        if fqn not in converted:
            continue
        if isinstance(style, ColwiseParallel | RowwiseParallel):
            cls = type(style)
            if fp8:
                cls = (
                    Float8ColwiseParallel
                    if isinstance(style, ColwiseParallel)
                    else Float8RowwiseParallel
                )
            new = cls(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
            restyle_tp(model, fqn, new)
            changed.append((fqn, type(new).__name__))
            parent, _, child = fqn.rpartition(".")
            if fp8 and isinstance(style, ColwiseParallel):
                colwise_children.setdefault(parent, child)
        else:
            raise ForgeConfigError(
                f"apply_float8: {fqn} is tensor-parallel with {type(style).__name__}, which forge "
                "cannot carry over to a Float8Linear; add it to filter_fqns"
            )
    for parent, child in colwise_children.items():
        prepare = record.styles.get(parent)
        if fp8 and type(prepare) is PrepareModuleInput:
            # All-gather the parent's input in fp8 (cast with the first converted child's config).
            new = PrepareFloat8ModuleInput(
                input_layouts=prepare.input_layouts,
                desired_input_layouts=prepare.desired_input_layouts,
                use_local_output=prepare.use_local_output,
                float8_dtype=torch.float8_e4m3fn,
                fwd_config_submodule_fqn=child,
            )
            restyle_tp(model, parent, new)
            changed.append((parent, "PrepareFloat8ModuleInput"))
    return tuple(changed)

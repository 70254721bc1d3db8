"""Choosing a tensor-parallel plan for a model, and the reference Transformer's plan.

Plans are chosen in this order (the first that applies wins):

1. an explicit ``plan``: ``{pattern: style}`` (``*`` matches one name segment; a style is a
   torch ``ParallelStyle``, a transformers style string, or None = replicated), or an import path
   ``"package.module:NAME"`` naming such a dict or a callable returning one. Importing runs the
   module's code, so a path is imported only when the caller allows it (``allow_import=True`` or
   a tuple of allowed module prefixes); paths from config files need that opt-in.
2. a plan registered for the model's class (``register_tp_plan``), the reference Transformer's
   built in;
3. the model's own Hugging Face ``_tp_plan`` (class, instance, and inner ``model`` prefixed);
4. opt-in class attributes (CREDIT style): any module class may declare ``_tp_col`` / ``_tp_row``
   (a dotted path or a list of them, relative to the module) or a ``_tp_plan`` dict;
5. otherwise a ``ForgeConfigError`` listing those ways.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch.nn as nn
from forge_core import Transformer
from forge_core.errors import ForgeConfigError
from forge_core.model import FeedForward
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from .checks import check_plan_import
from .hf_families import FAMILY_PLANS, FAMILY_SOURCE, HF_PLAN_FIXES, HF_PLAN_REFUSED
from .styles import ColwiseConv1x1, RowwiseConv1x1, translate_parallel_style

__all__ = [
    "PlanContext",
    "PlanFn",
    "expand_plan",
    "load_plan_object",
    "unmatched_patterns",
    "reference_plan",
    "register_tp_plan",
    "resolve_plan",
]

Style = ParallelStyle | str | None


@dataclass(frozen=True)
class PlanContext:
    """What a plan function may depend on."""

    tp_size: int
    sequence_parallel: bool
    loss_parallel: bool


PlanFn = Callable[[nn.Module, PlanContext], Mapping[str, Style]]
_REGISTRY_ATTR = "_forge_tp_plan_fn"


def register_tp_plan(model_cls: type[nn.Module], fn: PlanFn) -> None:
    """Register ``fn(model, ctx) -> {pattern: style}`` as the plan for ``model_cls`` (and subclasses).

    Stored on the class itself (no global registry); a subclass may register its own.
    """
    if not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
        raise ForgeConfigError(f"register_tp_plan needs an nn.Module subclass, got {model_cls!r}")
    if not callable(fn):
        raise ForgeConfigError(f"register_tp_plan needs a callable plan function, got {fn!r}")
    setattr(model_cls, _REGISTRY_ATTR, staticmethod(fn))


def reference_plan(model: nn.Module, ctx: PlanContext) -> dict[str, Style]:
    """The plan for forge's reference Transformer (KempnerForge's layout).

    With sequence parallelism the residual stream between blocks is sharded on the sequence
    (dim 1); attention and the FFN all-gather it on entry and reduce-scatter on exit.

    An FFN slot holding anything but the SwiGLU ``FeedForward`` (an MoE layer) is not sharded:
    it runs replicated on the tp ranks with plain tensors (the full sequence: gathered on entry
    and re-split on exit under SP). Its experts are split by expert parallelism instead.
    """
    # cast: typing only (no check). This is the plan registered for Transformer and its
    # subclasses, whose ``config`` and ``layers`` it reads.
    transformer = cast(Transformer, model)
    sp, tied = ctx.sequence_parallel, transformer.config.tie_embeddings
    residual = Shard(1) if sp else Replicate()  # the layout between blocks
    slots = {name: block.feed_forward for name, block in transformer.layers.items()}
    dense = [name for name, ffn in slots.items() if type(ffn) is FeedForward]
    other = [name for name in slots if name not in dense]
    # Wildcards when every block is dense (a compact plan); per-block names otherwise.
    ffn_prefixes = ["layers.*"] if not other else [f"layers.{name}" for name in dense]
    plan: dict[str, Style] = {}
    if tied:
        # The shared weight gets one layout: vocab-sharded for both the embedding and the head.
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    # Untied embedding stays replicated: RowwiseParallel on nn.Embedding would relabel its output
    # Shard(1) without scattering; the first block's input prep slices Replicate -> Shard(1).
    if sp:
        plan["layers.0"] = PrepareModuleInput(
            input_layouts=(Replicate(), None, None),
            desired_input_layouts=(Shard(1), None, None),
            use_local_output=True,
        )
        plan["layers.*.attention_norm"] = SequenceParallel()  # norms run on sequence shards
        plan["layers.*.attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )
        plan["layers.*.ffn_norm"] = SequenceParallel()
        for prefix in ffn_prefixes:
            plan[f"{prefix}.feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        for name in other:
            plan[f"layers.{name}.feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=True,
            )
        plan["norm"] = SequenceParallel()
    for proj in ("wq", "wk", "wv"):
        plan[f"layers.*.attention.{proj}"] = ColwiseParallel()  # heads split across ranks
    plan["layers.*.attention.wo"] = RowwiseParallel(output_layouts=residual)
    for prefix in ffn_prefixes:
        plan[f"{prefix}.feed_forward.w1"] = ColwiseParallel()  # hidden dim split
        plan[f"{prefix}.feed_forward.w3"] = ColwiseParallel()
        plan[f"{prefix}.feed_forward.w2"] = RowwiseParallel(output_layouts=residual)
    if getattr(model, "output", None) is not None:
        # Vocab-sharded head: gathered for a plain loss, or kept sharded for loss_parallel.
        plan["output"] = ColwiseParallel(
            input_layouts=residual,
            output_layouts=Shard(-1) if ctx.loss_parallel else Replicate(),
            use_local_output=not ctx.loss_parallel,
        )
    return plan


_BUILTIN: dict[type, PlanFn] = {Transformer: reference_plan}


def registered_plan_fn(model: nn.Module) -> PlanFn | None:
    """The plan function registered for ``model``'s class (nearest in the MRO), if any."""
    for cls in type(model).__mro__:
        if _REGISTRY_ATTR in cls.__dict__:
            return cls.__dict__[_REGISTRY_ATTR].__func__
        if cls in _BUILTIN:
            return _BUILTIN[cls]
    return None


def load_plan_object(
    path: str, allow_import: bool | Sequence[str]
) -> Mapping[str, Style] | Callable[..., Mapping[str, Style]]:
    """Import ``"package.module:NAME"`` (only where ``allow_import`` permits) and return the plan
    dict or plan function it names, calling nothing.

    NOTE: a launcher checks a plan before any rank starts with this: importing is granted by
    the person who runs forge, but the check must not run what the module names (a zero-argument
    ``os:abort`` would end the launcher). A plan function is a Python function taking
    ``(model, ctx)`` or nothing; builtins, classes and other callables are refused.
    """
    module_name = check_plan_import(path, allow_import)
    attr = path.partition(":")[2]
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 -- any failure of the user's module at import
        raise ForgeConfigError(
            f"plan={path!r}: importing '{module_name}' failed: {type(e).__name__}: {e}"
        ) from None
    if not hasattr(module, attr):
        raise ForgeConfigError(f"plan={path!r}: module '{module_name}' has no name '{attr}'")
    obj = getattr(module, attr)
    arity = len(inspect.signature(obj).parameters) if inspect.isfunction(obj) else None
    if not isinstance(obj, Mapping) and arity not in (0, 2):
        kind = type(obj).__name__ if arity is None else f"function of {arity} argument(s)"
        raise ForgeConfigError(
            f"plan={path!r} is a {kind}; a plan is a dict of module pattern -> style or a "
            "Python function taking (model, ctx) or nothing"
        )
    return obj


def _import_plan(
    path: str, allow_import: bool | Sequence[str], ctx: PlanContext, model: nn.Module
) -> Mapping[str, Style]:
    obj = load_plan_object(path, allow_import)
    if not isinstance(obj, Mapping):
        try:  # NOTE: load_plan_object checked the arity: a TypeError here is the function's own
            obj = obj(model, ctx) if inspect.signature(obj).parameters else obj()
        except Exception as e:  # noqa: BLE001 -- the user's plan function failed
            raise ForgeConfigError(f"plan={path!r} raised {type(e).__name__}: {e}") from None
    if not isinstance(obj, Mapping):
        raise ForgeConfigError(
            f"plan={path!r} gave a {type(obj).__name__}; it must be a dict of module pattern -> style"
        )
    return obj


def _hf_plan(model: nn.Module) -> dict[str, Style]:
    """Compose the Hugging Face plan as transformers does: class, instance, inner model (prefixed)."""
    plan: dict[str, Style] = {}
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    plan.update(model.__dict__.get("_tp_plan") or {})
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and inner is not model:
        plan.update({f"model.{k}": v for k, v in (getattr(inner, "_tp_plan", None) or {}).items()})
    # A "gather" parent over local_rowwise children: forge's rowwise already reduces.
    for key in [k for k, v in plan.items() if v == "gather"]:
        if any(k2.startswith(key + ".") and v2 == "local_rowwise" for k2, v2 in plan.items()):
            plan[key] = None
    return plan


def _as_paths(value: object, where: str) -> list[str]:
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list | tuple) or not all(isinstance(p, str) and p for p in paths):
        raise ForgeConfigError(f"{where} must be a dotted path or a list of them, got {value!r}")
    return list(paths)


def _leaf_style(leaf: nn.Module, column: bool, path: str) -> ParallelStyle:
    if isinstance(leaf, nn.Linear):
        return ColwiseParallel() if column else RowwiseParallel()
    if isinstance(leaf, nn.Conv2d):
        from .styles import _check_conv

        _check_conv(leaf, path)
        return ColwiseConv1x1() if column else RowwiseConv1x1()
    raise ForgeConfigError(
        f"'{path}' is a {type(leaf).__name__}: opt-in tensor parallelism supports nn.Linear and 1x1 nn.Conv2d"
    )


def _opt_in_plan(model: nn.Module) -> dict[str, Style]:
    """Plan entries from modules whose classes declare ``_tp_col`` / ``_tp_row`` / ``_tp_plan``."""
    plan: dict[str, Style] = {}
    for name, module in model.named_modules():
        cls = type(module)
        prefix = f"{name}." if name else ""
        for attr, column in (("_tp_col", True), ("_tp_row", False)):
            if getattr(cls, attr, None) is None:
                continue
            for path in _as_paths(getattr(cls, attr), f"{cls.__name__}.{attr}"):
                try:
                    leaf = module.get_submodule(path)
                except AttributeError:
                    raise ForgeConfigError(
                        f"{cls.__name__}.{attr} = {path!r}: '{prefix}{path}' is not a submodule"
                    ) from None
                plan[prefix + path] = _leaf_style(leaf, column, prefix + path)
        if module is not model and isinstance(cls.__dict__.get("_tp_plan"), Mapping):
            plan.update({prefix + k: v for k, v in cls.__dict__["_tp_plan"].items()})
    return plan


def resolve_plan(
    model: nn.Module,
    plan: Mapping[str, Style] | str | None,
    ctx: PlanContext,
    *,
    allow_import: bool | Sequence[str] = False,
) -> tuple[str, Mapping[str, Style]]:
    """``(source, {pattern: style})`` for ``model``; source names which rule picked the plan."""
    if plan is not None:
        if isinstance(plan, str):
            return "explicit (imported)", _import_plan(plan, allow_import, ctx, model)
        if isinstance(plan, Mapping):
            return "explicit", plan
        raise ForgeConfigError(
            f"plan must be a dict or an import path string, got {type(plan).__name__}"
        )
    fn = registered_plan_fn(model)
    if fn is not None:
        return "registered", fn(model, ctx)
    hf = _hf_plan(model)
    if hf:
        name = type(model).__name__
        if name in HF_PLAN_REFUSED:
            raise ForgeConfigError(
                f"{name}'s own tensor-parallel plan is refused: {HF_PLAN_REFUSED[name]}; pass "
                "plan={pattern: style} or use tp=1"
            )
        fix = HF_PLAN_FIXES.get(name)
        return "huggingface", {**hf, **(fix(model) if fix else {})}
    family = FAMILY_PLANS.get(type(model).__name__)
    if family is not None:  # a Hugging Face family that ships no plan: forge's
        return FAMILY_SOURCE, family
    opt_in = _opt_in_plan(model)
    if opt_in:
        return "opt-in attributes", opt_in
    raise ForgeConfigError(
        f"no tensor-parallel plan for {type(model).__name__}. Give one of: plan={{pattern: style}} (or an "
        "import path 'pkg.module:NAME'); register_tp_plan(ModelClass, fn); a Hugging Face _tp_plan; or "
        "class attributes _tp_col / _tp_row on the blocks"
    )


def _matching(pattern: str, names: Iterable[str]) -> list[str]:
    """The names ``pattern`` matches (``*`` matches one name segment)."""
    regex = re.compile(
        "^"
        + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))
        + "$"
    )
    return [n for n in names if regex.match(n)]


def unmatched_patterns(model: nn.Module, plan: Mapping[str, Style]) -> list[str]:
    """The patterns of ``plan`` that match no module of ``model`` (a Hugging Face plan may list
    layers a config leaves out: MLA's ``q_proj`` next to ``q_b_proj``; transformers skips them)."""
    names = [n for n, _ in model.named_modules() if n]
    return [p for p in plan if isinstance(p, str) and p and not _matching(p, names)]


def expand_plan(model: nn.Module, plan: Mapping[str, Style]) -> dict[str, ParallelStyle | None]:
    """Concrete ``{module name: style}``; every pattern must match a module, strings are translated."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, ParallelStyle | None] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ForgeConfigError(
                f"plan key {pattern!r} must be a module name pattern like 'layers.*.attention.wq'"
            )
        if isinstance(style, str):
            style = translate_parallel_style(style)
        elif style is not None and not isinstance(style, ParallelStyle):
            raise ForgeConfigError(
                f"plan[{pattern!r}] = {style!r}: a style must be a ParallelStyle, a style string or None"
            )
        matched = _matching(pattern, names)
        if not matched:
            raise ForgeConfigError(
                f"plan pattern {pattern!r} matches no module of {type(model).__name__}"
            )
        for name in matched:
            out[name] = style
    return out

"""``apply_tensor_parallel``: validate, choose a plan, shard, and record what was applied."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from forge_core import Transformer
from forge_core.contracts import apply_tp_styles
from forge_core.errors import ForgeConfigError, refuse
from forge_core.mesh_dims import get_tp_mesh
from forge_core.stages import stage
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)

from . import checks
from .checks import check_divides, check_transformer_tp
from .hf_families import FAMILY_HEAD_COUNTS, FAMILY_SINGLE_KV_REPLICATED, FAMILY_SOURCE
from .plans import (
    PlanContext,
    Style,
    _matching,
    expand_plan,
    registered_plan_fn,
    resolve_plan,
    unmatched_patterns,
)
from .styles import bind_style, describe_style

__all__ = [
    "AppliedPlan",
    "applied_tp_plan",
    "apply_tensor_parallel",
    "describe_tp_plan",
]

log = logging.getLogger("forge_tp_plans")
_APPLIED_ATTR = "_forge_tp_plan"


@dataclass(frozen=True)
class AppliedPlan:
    """What ``apply_tensor_parallel`` did: plan source, per-module styles, SP and loss-parallel flags."""

    source: str
    tp_size: int
    sequence_parallel: bool
    loss_parallel: bool
    styles: dict[str, str]
    #: patterns of a Hugging Face plan that match no module, skipped as transformers skips them
    skipped: tuple[str, ...] = ()
    #: plan patterns (or module names) inside a module that stays whole on every tp rank
    #: (``forge_tp_skip``, forge_core.contracts), e.g. a converted MoE block's experts
    left_whole: tuple[str, ...] = ()

    def __str__(self) -> str:
        # Fold layer indices to "*" only where every layer has the entry with the same style.
        patterns = {name: re.sub(r"\.\d+(\.|$)", r".*\1", name) for name in self.styles}
        members: dict[str, list[str]] = {}
        for name in self.styles:
            members.setdefault(patterns[name], []).append(name)
        n_layers = max((len(v) for v in members.values()), default=1)
        rows: dict[str, str] = {}
        for name, style in self.styles.items():
            same = members[patterns[name]]
            one_style = len({self.styles[n] for n in same}) == 1
            folded = one_style and len(same) == n_layers > 1
            rows.setdefault(patterns[name] if folded else name, style)
        width = max((len(k) for k in rows), default=0)
        head = (
            f"{self.source} plan over {self.tp_size} ranks, sequence_parallel={self.sequence_parallel}, "
            f"loss_parallel={self.loss_parallel}"
        )
        lines = [head] + [f"  {k:<{width}}  {v}" for k, v in rows.items()]
        if self.skipped:
            lines.append(f"  skipped, matching no module: {', '.join(self.skipped)}")
        if self.left_whole:
            lines.append(f"  left whole (forge_tp_skip): {', '.join(self.left_whole)}")
        return "\n".join(lines)


def applied_tp_plan(model: nn.Module) -> AppliedPlan | None:
    """The plan applied to ``model`` (None if TP was not applied)."""
    from forge_core.stages import unwrap

    return unwrap(model).__dict__.get(_APPLIED_ATTR)


def describe_tp_plan(model: nn.Module) -> str:
    """Readable ``module -> style`` listing of the applied plan (layer indices folded to ``*``)."""
    plan = applied_tp_plan(model)
    return str(plan) if plan is not None else "tensor parallelism not applied"


def _tp_mesh_of(device_mesh: DeviceMesh) -> DeviceMesh | None:
    if device_mesh.ndim == 1 and (device_mesh.mesh_dim_names in (None, ("tp",))):
        return device_mesh
    return get_tp_mesh(device_mesh)


def _config_value(config: object, key: str) -> object:
    """``config.key`` or None. NOTE: some transformers configs raise other errors than
    AttributeError for a name they hold per layer (embedding_gemma2's
    AmbiguousGlobalPerLayerAttributeError), which ``getattr(.., None)`` lets through."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - any failure means "no single value"
        return None


def _own_check(style: ParallelStyle | None) -> Callable[[nn.Module, str, int], object] | None:
    """``check(module, path, tp)`` of forge's own styles (packed, MLA, fused heads, Conv1D):
    raises ForgeConfigError when the style does not fit the module, before anything is split."""
    if style is None or not type(style).__module__.startswith("forge_tp_plans."):
        return None
    check = getattr(style, "check", None)
    return check if callable(check) else None


def _validate(model: nn.Module, plan: Mapping[str, ParallelStyle | None], tp: int) -> None:
    """Head counts and every sharded dimension must split evenly across the tp ranks."""
    config = getattr(model, "config", None)
    sizes: dict[str, int] = {}
    if isinstance(model, Transformer):
        check_transformer_tp(model.config, tp, head_sharded=plan.get("output") is not None)
    elif config is not None:  # Hugging Face config names
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = _config_value(config, key)
            if isinstance(value, int):
                sizes[key] = value
    if (
        sizes.get("num_key_value_heads") == 1
        and type(model).__name__ in FAMILY_SINGLE_KV_REPLICATED
    ):
        del sizes["num_key_value_heads"]  # forge's family plan keeps the one k/v head whole
    if sizes:
        check_divides(tp, sizes)
    for name, style in plan.items():
        module = model.get_submodule(name)
        own_check = _own_check(style)
        if own_check is not None:
            own_check(module, name, tp)  # type, sizes (head counts, rope dim) first
            continue
        # NOTE: torch's Colwise/RowwiseParallel split only Linear and Embedding weights and
        # raise NotImplementedError for anything else, after earlier entries were split: check
        # every entry first, so a refusal leaves the model untouched.
        splits = isinstance(style, ColwiseParallel | RowwiseParallel)
        if splits and not isinstance(module, nn.Linear | nn.Embedding):
            raise ForgeConfigError(
                f"tp plan entry {name!r} gives {type(style).__name__} to a "
                f"{type(module).__name__}; it splits nn.Linear or nn.Embedding weights only. "
                "Give that module a style for its type (1x1 convolutions: ColwiseConv1x1 / "
                "RowwiseConv1x1) or leave it out of the plan; nothing was split"
            )
        if isinstance(module, nn.Linear) and isinstance(style, ColwiseParallel):
            check_divides(tp, {f"{name}.out_features": module.out_features})
        elif isinstance(module, nn.Linear) and isinstance(style, RowwiseParallel):
            check_divides(tp, {f"{name}.in_features": module.in_features})
        elif isinstance(module, nn.Conv2d) and style is not None:
            dim = (
                module.out_channels
                if type(style).__name__ == "ColwiseConv1x1"
                else module.in_channels
            )
            check_divides(tp, {f"{name} channels": dim})
        elif isinstance(module, nn.Embedding) and isinstance(style, RowwiseParallel):
            check_divides(tp, {f"{name}.num_embeddings": module.num_embeddings})


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, name) holding the same Parameter (tied weights)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, pname))
    return [group for group in owners.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """Sharding replaces parameters one module at a time; share them again where layouts agree."""
    for group in groups:
        first = getattr(group[0][0], group[0][1])
        for module, pname in group[1:]:
            other = getattr(module, pname)
            if other is first:
                continue
            if getattr(other, "placements", None) != getattr(first, "placements", None):
                raise ForgeConfigError(
                    f"tied weight '{pname}' of {type(module).__name__} got a different tensor-parallel layout "
                    "than the module it is tied to; shard both the same way (e.g. embedding rowwise + head colwise) "
                    "or neither"
                )
            module.register_parameter(pname, first)


def _default_sequence_parallel(
    model: nn.Module, requested: bool | None, plan_given: bool, has_registered_plan: bool
) -> bool:
    """``requested``, or :func:`~forge_tp_plans.checks.default_sequence_parallel` for this model
    when None; refuses SP where the plan cannot give it."""
    tied = isinstance(model, Transformer) and model.config.tie_embeddings
    stage_module = isinstance(model, Transformer) and (
        getattr(model, "tok_embeddings", None) is None or getattr(model, "output", None) is None
    )
    if requested is None:
        return checks.default_sequence_parallel(  # NOTE: looked up now: the one rule
            registered_plan=has_registered_plan, tied_embeddings=tied, pipeline_stage=stage_module
        )
    if requested and not (plan_given or has_registered_plan):
        raise ForgeConfigError(
            f"sequence_parallel=True: the {type(model).__name__} plan found (Hugging Face or opt-in) is basic "
            "TP; give an explicit plan with SequenceParallel entries, or use sequence_parallel=False"
        )
    if stage_module:
        refuse(checks.pipeline_stage_problems(sequence_parallel=requested, loss_parallel=False))
    return requested


def _check_sequence_length(tp: int):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple) -> None:
        if (
            args
            and isinstance(args[0], torch.Tensor)
            and args[0].dim() >= 2
            and args[0].shape[1] % tp
        ):
            raise ForgeConfigError(
                f"sequence length {args[0].shape[1]} is not divisible by tp={tp}, which sequence parallelism "
                f"needs; pad or choose a sequence length that is a multiple of {tp}"
            )

    return hook


def _localize_head_counts(model: nn.Module, tp: int) -> None:
    """Divide the head counts a family's attention reads in forward by tp (its modules now hold
    1/tp of the heads); :data:`forge_tp_plans.hf_families.FAMILY_HEAD_COUNTS` names them."""
    counts = FAMILY_HEAD_COUNTS.get(type(model).__name__, {})
    for pattern, attrs in counts.items():
        for name in expand_plan(model, {pattern: None}):
            module = model.get_submodule(name)
            for attr in attrs:
                value = getattr(module, attr)
                check_divides(tp, {f"{name}.{attr}": value})
                setattr(module, attr, value // tp)


def _checked_plan(
    model: nn.Module,
    tp: int,
    plan: Mapping[str, Style] | str | None,
    sequence_parallel: bool | None,
    loss_parallel: bool,
    allow_import: bool | Sequence[str],
) -> tuple[str, bool, dict[str, ParallelStyle | None], tuple[str, ...], tuple[str, ...]]:
    """Everything :func:`apply_tensor_parallel` decides and checks before it splits anything:
    ``(source, sequence_parallel, {module name: style}, skipped patterns, left whole)``; raises
    ForgeConfigError. A Hugging Face plan's patterns that match no module are skipped (as
    transformers does); in any other plan such a pattern is refused (a typo would silently
    leave a layer unsplit). Modules inside one whose class declares ``forge_tp_skip`` are taken
    out of the plan (they run whole on every tp rank) and listed as left whole (the declaring
    module's own entry stays: it may only prepare input and output layouts)."""
    has_registered = plan is None and registered_plan_fn(model) is not None
    sp = _default_sequence_parallel(model, sequence_parallel, plan is not None, has_registered)
    if loss_parallel and not has_registered and plan is None:
        raise ForgeConfigError(
            "loss_parallel=True needs a plan whose output head keeps vocab-sharded logits: use a registered plan "
            "(the reference Transformer's) or an explicit plan"
        )
    ctx = PlanContext(tp_size=tp, sequence_parallel=sp, loss_parallel=loss_parallel)
    source, raw = resolve_plan(model, plan, ctx, allow_import=allow_import)
    skipped = tuple(unmatched_patterns(model, raw)) if source == "huggingface" else ()
    params = [n for n, _ in model.named_parameters()]
    for pattern in skipped:
        named = _matching(pattern, params)
        if named and raw[pattern] is not None:  # NOTE: None: left out on purpose (a fix)
            # NOTE: transformers 5.17's granite_swa plan names its attention sinks this way;
            # skipping it would leave every rank all heads' sinks next to half the heads.
            moe = ".experts." in named[0]
            raise ForgeConfigError(
                f"plan pattern {pattern!r} names a parameter ({named[0]}), not a module: forge's "
                "styles split modules and skipping it would leave that parameter whole beside "
                "split heads; "
                + (
                    "these are MoE experts: parallelize with forge's ParallelPlan, which converts "
                    "known Hugging Face MoE blocks (forge_moe_ep.convert_hf_moe), or convert first"
                    if moe
                    else "pass plan={pattern: style} or use tp=1"
                )
            )
    whole = [n for n, m in model.named_modules() if n and getattr(m, "forge_tp_skip", None)]

    def inside_whole(name: str) -> bool:
        # NOTE: the declaring module keeps its own entry (the reference plan prepares an MoE's
        # input and output layouts for sequence parallelism there); only what is inside it.
        return any(name.startswith(w + ".") for w in whole)

    names = [n for n, _ in model.named_modules() if n]
    # Patterns naming only modules inside such a module are dropped before their styles are
    # translated (a Hugging Face plan's MoE expert styles are not forge's to apply).
    dropped = [
        p
        for p in raw
        if p not in skipped
        and isinstance(p, str)
        and (hits := _matching(p, names))
        and all(inside_whole(n) for n in hits)
    ]
    concrete = expand_plan(
        model, {k: v for k, v in raw.items() if k not in skipped and k not in dropped}
    )
    left_whole = (*dropped, *(n for n in concrete if inside_whole(n)))
    concrete = {n: bind_style(s, model, n) for n, s in concrete.items() if not inside_whole(n)}
    _validate(model, concrete, tp)
    return source, sp, concrete, skipped, left_whole


def check_tensor_parallel(
    model: nn.Module,
    tp: int,
    *,
    plan: Mapping[str, Style] | str | None = None,
    sequence_parallel: bool | None = None,
    loss_parallel: bool = False,
    allow_import: bool | Sequence[str] = False,
) -> str:
    """Check, without a mesh or a process group, that :func:`apply_tensor_parallel` would accept
    this plan for ``model`` at ``tp`` ranks (``model`` may live on the meta device): the plan
    resolves (an import path is imported), every style is known, every pattern matches a module,
    every style fits its module's type and sizes. Returns a one-line description; raises
    ForgeConfigError with the reason. Nothing is modified.
    """
    source, sp, concrete, skipped, left_whole = _checked_plan(
        model, tp, plan, sequence_parallel, loss_parallel, allow_import
    )
    return (
        f"{source} plan over {tp} ranks, {len(concrete)} modules, sequence_parallel={sp}, "
        f"loss_parallel={loss_parallel}"
        + (f", skipped (matching no module): {', '.join(skipped)}" if skipped else "")
        + (f", left whole (forge_tp_skip): {', '.join(left_whole)}" if left_whole else "")
    )


def apply_tensor_parallel(
    model: nn.Module,
    device_mesh: DeviceMesh,
    *,
    plan: Mapping[str, Style] | str | None = None,
    sequence_parallel: bool | None = None,
    loss_parallel: bool = False,
    allow_import: bool | Sequence[str] = False,
) -> nn.Module:
    """Shard ``model`` for tensor (and sequence) parallelism over the ``tp`` axis; returns ``model``.

    ``device_mesh`` is the full mesh (its ``tp`` sub-mesh is used) or a 1-D tp mesh; with no tp
    axis or tp=1 nothing happens (logged). ``plan`` overrides the automatic choice (see
    :mod:`forge_tp_plans.plans`). ``sequence_parallel=None`` turns SP on for registered plans
    unless embeddings are tied or the model is a pipeline stage. ``loss_parallel=True`` keeps the
    logits vocab-sharded (compute the loss under ``torch.distributed.tensor.parallel.loss_parallel``;
    ``forge_core.training`` does). Must run first: before EP, Float8, AC, compile and FSDP2.
    """
    tp_mesh = _tp_mesh_of(device_mesh)
    if tp_mesh is None or tp_mesh.size() == 1:
        log.info("tensor parallelism not applied: the mesh has no tp axis of size > 1")
        return model
    tp = tp_mesh.size()
    with stage(model, "tp"):
        source, sp, concrete, skipped, left_whole = _checked_plan(
            model, tp, plan, sequence_parallel, loss_parallel, allow_import
        )
        tied = _shared_parameters(model)
        # Applied one module at a time and recorded (forge_core.contracts), so a later stage
        # (Float8) can swap a module's style.
        apply_tp_styles(model, tp_mesh, {n: s for n, s in concrete.items() if s is not None})
        _retie(tied)
        if source == FAMILY_SOURCE:
            _localize_head_counts(model, tp)
        if sp:
            model.register_forward_pre_hook(_check_sequence_length(tp))
        styles = {n: describe_style(s) for n, s in concrete.items()}
        applied = AppliedPlan(source, tp, sp, loss_parallel, styles, skipped, left_whole)
        model.__dict__[_APPLIED_ATTR] = applied
        log.info("%s", applied)
    return model

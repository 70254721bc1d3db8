"""Every check of a ``ForgeConfig`` that needs no process group, in two phases.

``forge build`` / ``forge train`` run them in the launcher before any rank starts, so a bad
config is a few lines (exit 2), every broken rule at once, instead of a traceback from every
rank; ``forge plan`` lists the same lines.

- :func:`config_problems` is pure Python on the config's values and imports no torch (it runs
  in a fraction of a second, before the launcher pays for torch's import);
- :func:`import_problems` then imports what the config names: a ``tp.plan`` module, checked
  against a meta-device copy of the model, torchao when Float8 is on, and torch's pipeline
  schedule class when ``parallelism.pp > 1``. Run it once the values are clean (the plan check
  builds the model the values describe).

Both return one-line messages, each naming the field and the fix (empty: fine). The raising
forms :func:`check_config_values`, :func:`check_config_imports` and :func:`check_config` raise
``ForgeConfigError`` with the first message, for callers that stop at one. Each layer owns its
own pure checks (``<layer>.checks``); this module only composes them for forge's config.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from forge_core.errors import ForgeConfigError, refuse
from forge_cp.checks import cp_problems, cp_variant_problems
from forge_float8.checks import check_float8, float8_problems, torchao_problems
from forge_fsdp_wrap.checks import ac_mode_problems
from forge_moe_ep.checks import moe_layout_problems
from forge_pp.checks import schedule_problems
from forge_tp_plans.checks import transformer_tp_problems

from .kinds import model_kind
from .layout import Layout, resolve_layout
from .paths import dir_problems, importable_problems, regular_file_problem
from .tensorboard_log import tensorboard_problems

if TYPE_CHECKING:
    from .config import ForgeConfig

__all__ = [
    "check_config",
    "check_config_imports",
    "check_config_values",
    "check_float8",
    "check_plan",
    "config_problems",
    "import_problems",
    "path_problems",
    "plan_problems",
]


def plan_problems(data: str, axis_sizes: dict[str, int], *, ac_mode: str = "none") -> list[str]:
    """What this forge cannot do with ``data``, these axis sizes and ``ac_mode`` (pure)."""
    problems = []
    if data not in ("fsdp2", "ddp", "none"):
        problems.append(f"data={data!r}: choose 'fsdp2', 'ddp' or 'none'")
    if data == "ddp" and axis_sizes.get("pp", 1) > 1:
        problems.append(
            f"data='ddp' with pp={axis_sizes['pp']}: pipeline stages are data-parallel with FSDP2 "
            "here; use data='fsdp2' (or 'none')"
        )
    if data == "none" and axis_sizes.get("cp", 1) > 1:
        problems.append(
            f"data='none' with cp={axis_sizes['cp']}: the context-parallel ranks hold the same "
            "parameters and their gradients must be summed; use data='fsdp2' (FSDP2 shards over "
            "dp_shard x cp) or 'ddp'"
        )
    if data == "ddp" and axis_sizes.get("tp", 1) > 1:
        problems.append(
            f"data='ddp' with tp={axis_sizes['tp']}: DDP does not handle tensor-parallel (DTensor) "
            "parameters; use data='fsdp2' (FSDP2 shards them on the dp axis: 2-D)"
        )
    return problems + ac_mode_problems(ac_mode)


def check_plan(
    data: str,
    axis_sizes: dict[str, int],
    *,
    ac_mode: str = "none",
) -> None:
    """Refuse what this forge cannot do, before any process group exists (pure checks)."""
    refuse(plan_problems(data, axis_sizes, ac_mode=ac_mode))


def _layout(cfg: ForgeConfig, ranks: int | Layout) -> Layout:
    """``ranks`` if it is the resolved :class:`Layout` already (a rank resolves it once and
    passes it on), else the layout of ``cfg`` on that many ranks."""
    return ranks if isinstance(ranks, Layout) else resolve_layout(cfg, ranks)


def config_problems(cfg: ForgeConfig, world_size: int | Layout) -> list[str]:
    """Every problem of the config's values on ``world_size`` ranks (no torch import); or on
    the resolved ``Layout`` given instead of a number.

    A layout that does not resolve (the degrees do not fit ``world_size``) is the only message:
    the other checks need the layout."""
    try:
        layout = _layout(cfg, world_size)
    except ForgeConfigError as err:
        return [str(err)]
    world_size = layout.world_size
    par, t, m = layout.parallelism, cfg.training, cfg.decoder
    sizes = {name: getattr(par, name) for name in ("cp", "pp", "tp")}
    problems = plan_problems(par.data, sizes, ac_mode=t.ac_mode)
    kind = model_kind(cfg)
    problems += kind.problems(layout)
    problems += float8_problems(cfg.float8, par.tp)
    problems += moe_layout_problems(m, ep=par.ep, cp=par.cp, tp=par.tp, expert_tp=par.expert_tp)
    if cfg.tp.plan is not None:
        problems += importable_problems("tp.plan", cfg.tp.plan, cfg.tp.allow_import)
    fitting = _fitting_cp(cfg, world_size) if par.cp > 1 else None
    problems += cp_problems(par.cp, t.seq_len, pp=par.pp, model_kind=kind.name, fitting_cp=fitting)
    problems += cp_variant_problems(
        cfg.cp.variant, par.cp, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads or m.n_heads, tp=par.tp
    )
    if par.tp > 1:
        sp = layout.sequence_parallel
        # NOTE: under cp, sequence parallelism splits each rank's S / cp tokens over tp
        # NOTE: None when cp does not split seq_len: cp_problems has said what is wrong with it
        fits = par.cp == 1 or t.seq_len % (2 * par.cp) == 0
        seq = t.seq_len // par.cp if fits else None
        problems += transformer_tp_problems(m, par.tp, seq_len=seq, sequence_parallel=sp)
    if t.global_batch_size % (par.dp_degree * t.grad_accum):
        problems.append(
            f"training.global_batch_size={t.global_batch_size} must be divisible by the "
            f"{par.dp_degree} data-parallel ranks x training.grad_accum={t.grad_accum}"
        )
    if t.seq_len > m.max_seq_len:
        problems.append(f"training.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if par.pp > 1:
        problems += kind.pipeline_problems(layout)
    problems += validation_problems(cfg)
    if cfg.checkpoint.export_hf:
        problems += [f"checkpoint.export_hf = true: {p}" for p in kind.hf_export_problems()]
    return list(dict.fromkeys(problems))  # the same words twice are one problem


def validation_problems(cfg: ForgeConfig) -> list[str]:
    """The ``[metrics]`` section against the run: ``metrics.validation_every`` needs held-out
    documents (text ``data.path`` with ``data.validation_fraction > 0``; pure, the text itself
    is checked with the data), and ``metrics.profile_step`` must be a step the run takes."""
    every, data, steps = cfg.metrics.validation_every, cfg.data, cfg.training.steps
    problems = []
    if every and (data.path is None or data.validation_fraction <= 0):
        problems.append(
            f"metrics.validation_every={every} needs held-out documents: set "
            "data.validation_fraction (e.g. 0.05) with a text data.path (jsonl, parquet, text or "
            "a saved dataset), or set metrics.validation_every = 0"
        )
    if cfg.metrics.profile_step > steps:
        problems.append(
            f"metrics.profile_step={cfg.metrics.profile_step} is past training.steps={steps}, so "
            f"no step would be profiled: set it to a step from 1 to {steps}, or 0 for none"
        )
    return problems


def import_problems(cfg: ForgeConfig, world_size: int | Layout) -> list[str]:
    """The problems found by importing what the config names (torchao, a tp.plan module
    checked on a meta-device model, the pipeline schedule in this torch); run once
    :func:`config_problems` is empty. ``world_size``: a number of ranks or the resolved
    ``Layout``."""
    try:
        layout = _layout(cfg, world_size)
    except ForgeConfigError as err:
        return [str(err)]
    par = layout.parallelism
    problems = torchao_problems() if layout.float8 else []
    if par.pp > 1:
        problems += schedule_problems(cfg.pp)
    if cfg.tp.plan is not None and par.tp > 1:
        problems += _explicit_plan_problems(cfg, layout)
    problems += model_kind(cfg).import_problems(layout)
    if cfg.metrics.tensorboard:
        problems += tensorboard_problems()
    return problems


def check_config(cfg: ForgeConfig, world_size: int | Layout) -> None:
    """Every check that needs no process group: raises ForgeConfigError before any launch."""
    check_config_values(cfg, world_size)
    check_config_imports(cfg, world_size)


def check_config_values(cfg: ForgeConfig, world_size: int | Layout) -> None:
    """The checks on the config's values alone (no torch import): raises the first of
    :func:`config_problems`."""
    refuse(config_problems(cfg, world_size))


def check_config_imports(cfg: ForgeConfig, world_size: int | Layout) -> None:
    """The checks that import what the config names (torch, torchao, a tp.plan module); run
    after :func:`check_config_values`. Raises the first of :func:`import_problems`."""
    refuse(import_problems(cfg, world_size))


def _fitting_cp(cfg: ForgeConfig, world_size: int) -> list[int]:
    """The cp degrees (> 1) with which the config's other degrees still fit ``world_size``, by
    :func:`resolve_layout`'s own rule (what forge_cp may suggest instead of ``parallelism.cp``)."""
    fitting = []
    for cp in (c for c in range(2, world_size + 1) if world_size % c == 0):
        other = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, cp=cp))
        try:
            resolve_layout(other, world_size)
        except ForgeConfigError:
            continue
        fitting.append(cp)
    return fitting


def _explicit_plan_problems(cfg: ForgeConfig, layout: Layout) -> list[str]:
    """Import ``tp.plan`` here and check a plan dict against a meta-device copy of the model, so
    that a wrong plan is one line before launch instead of a traceback from every rank, with the
    layout's sequence and loss parallelism (under pp both off: as a stage gets the plan).

    NOTE: nothing the path names is called here: a plan *function* is only checked for its
    signature, and runs on the ranks (which report its failure in one line)."""
    from forge_core.contracts import model_components
    from forge_tp_plans import check_tensor_parallel, load_plan_object

    from .models import model_from_config

    assert cfg.tp.plan is not None  # import_problems calls this only for an explicit plan
    try:
        plan = load_plan_object(cfg.tp.plan, cfg.tp.allow_import)
    except ForgeConfigError as err:
        return [f"tp.plan: {err}"]
    if not isinstance(plan, Mapping):
        return []
    try:
        model = model_from_config(cfg)
    except ForgeConfigError as err:
        return [str(err)]
    decoder = dict(model_components(model)).get("decoder", model)
    try:  # NOTE: the plan's checks on a model raise (forge_tp_plans.check_tensor_parallel)
        check_tensor_parallel(
            decoder,
            layout.tp,
            plan=plan,
            sequence_parallel=layout.sequence_parallel,
            loss_parallel=layout.loss_parallel,
        )
    except ForgeConfigError as err:
        return [f"tp.plan: {err}"]
    return []


def path_problems(cfg: ForgeConfig, command: str, *, rank_logs: bool = True) -> list[str]:
    """What is wrong with the paths ``forge <command>`` will write and read (no torch import):
    ``training.out_dir`` (train's metrics; with ``rank_logs``, forge's launcher writes the ranks'
    logs there for build too), and for ``train`` the checkpoint directory
    (:func:`forge.paths.dir_problems`), ``checkpoint.resume`` and ``data.path`` (a readable
    regular file). One line each, naming the field; the token file's contents are
    :func:`forge.data.token_file_problems`'."""
    t, c = cfg.training, cfg.checkpoint
    writes_out_dir = command == "train" or rank_logs
    problems = dir_problems("training.out_dir", t.out_dir) if writes_out_dir else []
    if command != "train":
        return problems
    if c.dir is not None:
        problems += dir_problems("checkpoint.dir", c.dir)
    elif not problems:  # NOTE: the default is inside out_dir: its problem is said once
        problems += dir_problems(
            "checkpoint.dir (default <out_dir>/checkpoints)", str(cfg.checkpoint_dir)
        )
    if "\0" in c.resume:
        problems.append(f"checkpoint.resume={c.resume!r} holds a NUL character, which no path can")
    if cfg.data.path is not None:
        problems += _data_path_problems(cfg.data.path)
    return problems


def _data_path_problems(path: str) -> list[str]:
    """``data.path``: a readable regular file (a token file, jsonl, parquet, text), or a
    directory ``datasets``' ``save_to_disk`` wrote (its ``state.json`` and
    ``dataset_info.json``); decided from the file system alone."""
    what = f"data.path={path!r}"
    if os.path.isdir(path):
        if all(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_info.json")):
            return []
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            return [
                f"{what} is a DatasetDict (several splits): give one split's folder, e.g. "
                f"{os.path.join(path, 'train')!r}"
            ]
        return [
            f"{what} is a directory but not a dataset saved by datasets' save_to_disk (no "
            "state.json and dataset_info.json); give a file, or such a directory"
        ]
    problem = regular_file_problem(what, path)
    return [problem] if problem else []

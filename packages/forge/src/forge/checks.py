"""Every check of a ``ForgeConfig`` that needs no process group, in two phases.

``forge build`` / ``forge train`` run them in the launcher before any rank starts, so a bad
config is one line (exit 2) instead of a traceback from every rank:

- :func:`check_config_values` is pure Python on the config's values and imports no torch (it
  runs in a fraction of a second, before the launcher pays for torch's import);
- :func:`check_config_imports` then imports what the config names: a ``tp.plan`` module, checked
  against a meta-device copy of the model, and torchao when Float8 is on.

:func:`check_config` runs both. Each layer owns its own pure checks (``<layer>.checks``); this
module only composes them for forge's config.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from forge_core.config import ParallelismConfig
from forge_core.errors import ForgeConfigError
from forge_float8.checks import check_float8, check_torchao
from forge_fsdp_wrap.checks import check_ac_mode
from forge_moe_ep.checks import check_expert_parallel
from forge_tp_plans.checks import check_plan_import, check_transformer_tp
from forge_vlm.checks import ac_components

from .layout import resolve_layout

if TYPE_CHECKING:
    from .config import ForgeConfig
from forge_vlm.config import check_vlm

__all__ = [
    "NOT_YET",
    "check_config",
    "check_config_imports",
    "check_config_values",
    "check_float8",
    "check_plan",
]

#: Axes whose layer this forge does not have yet -> what provides them. Refused, never ignored.
NOT_YET = {
    "cp": "context parallelism",
    "pp": "pipeline parallelism",
}


def check_plan(
    data: str,
    axis_sizes: dict[str, int],
    *,
    ac_mode: str = "none",
) -> None:
    """Refuse what this forge cannot do, before any process group exists (pure checks)."""
    if data not in ("fsdp2", "ddp", "none"):
        raise ForgeConfigError(f"data={data!r}: choose 'fsdp2', 'ddp' or 'none'")
    for axis, layer in NOT_YET.items():
        if axis_sizes.get(axis, 1) > 1:
            raise ForgeConfigError(
                f"parallelism.{axis}={axis_sizes[axis]} needs {layer}, which this forge does not have yet; set {axis}=1"
            )
    if data == "ddp" and axis_sizes.get("tp", 1) > 1:
        raise ForgeConfigError(
            f"data='ddp' with tp={axis_sizes['tp']}: DDP does not handle tensor-parallel (DTensor) "
            "parameters; use data='fsdp2' (FSDP2 shards them on the dp axis: 2-D)"
        )
    check_ac_mode(ac_mode)


def check_config(cfg: ForgeConfig, world_size: int) -> None:
    """Every check that needs no process group: raises ForgeConfigError before any launch."""
    check_config_values(cfg, world_size)
    check_config_imports(cfg, world_size)


def check_config_values(cfg: ForgeConfig, world_size: int) -> None:
    """The checks on the config's values alone (no torch import; see the module docstring)."""
    layout = resolve_layout(cfg, world_size)
    par = layout.parallelism
    sizes = {name: getattr(par, name) for name in (*NOT_YET, "tp")}
    check_plan(par.data, sizes, ac_mode=cfg.training.ac_mode)
    if cfg.is_field:
        _check_field(cfg, par)
    elif par.domain > 1:
        raise ForgeConfigError(
            f"parallelism.domain={par.domain}: domain parallelism splits 2-D fields (conv nets), "
            "and this model is a token model. Train a field model (model.preset=debug_field, "
            "[field] section), or set domain=1"
        )
    check_float8(cfg.float8, par.tp, torchao=False)
    if par.ep > 1:
        if not cfg.model.moe_layers:
            raise ForgeConfigError(
                f"parallelism.ep={par.ep} but model has no MoE blocks (model.moe_every=0); set "
                "ep=1 or an MoE model (e.g. model.preset=debug_moe)"
            )
        check_expert_parallel(cfg.model.num_experts, par.ep)
    t = cfg.training
    if cfg.tp.plan is not None:
        _check_importable("tp.plan", cfg.tp.plan, cfg.tp.allow_import)
    if cfg.is_vlm:
        check_vlm(cfg.model, cfg.vision, cfg.adapter, cfg.vlm, seq_len=t.seq_len, tp=par.tp)
        ac_components(cfg.vlm.ac_scope, cfg.vlm.freeze_encoder)
        if cfg.vlm.encoder_tp_plan is not None:
            _check_importable("vlm.encoder_tp_plan", cfg.vlm.encoder_tp_plan, cfg.tp.allow_import)
    if par.tp > 1:
        check_transformer_tp(
            cfg.model, par.tp, seq_len=t.seq_len, sequence_parallel=layout.sequence_parallel
        )
    if t.global_batch_size % (par.dp_degree * t.grad_accum):
        raise ForgeConfigError(
            f"training.global_batch_size={t.global_batch_size} must be divisible by the "
            f"{par.dp_degree} data-parallel ranks x training.grad_accum={t.grad_accum}"
        )
    if t.seq_len > cfg.model.max_seq_len:
        raise ForgeConfigError(
            f"training.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}"
        )


def check_config_imports(cfg: ForgeConfig, world_size: int) -> None:
    """The checks that import what the config names (torch, torchao, a tp.plan module); run
    after :func:`check_config_values`."""
    par = resolve_layout(cfg, world_size).parallelism
    if cfg.float8.enabled:
        check_torchao()
    if cfg.tp.plan is not None and par.tp > 1:
        _check_explicit_plan(cfg, par.tp)


def _check_field(cfg: ForgeConfig, par: ParallelismConfig) -> None:
    """What a field model (forge_domain.FieldNet) can be combined with."""
    unsupported = {
        "parallelism.tp": par.tp > 1,
        "parallelism.ep": par.ep > 1,
        "float8.enabled": cfg.float8.enabled,
        "data.path": cfg.data.path is not None,
    }
    for key, bad in unsupported.items():
        if bad:
            raise ForgeConfigError(
                f"{key} is set for a field model ([field]): FieldNet is a conv net; it takes data "
                "parallelism and parallelism.domain (height split), not this; unset it"
            )
    if cfg.field.height < par.domain:
        raise ForgeConfigError(
            f"field.height={cfg.field.height} gives fewer rows than parallelism.domain="
            f"{par.domain} ranks; lower domain or raise the height"
        )


def _check_explicit_plan(cfg: ForgeConfig, tp: int) -> None:
    """Import ``tp.plan`` here and check it against a meta-device copy of the model, so that a
    wrong plan is one line before launch instead of a traceback from every rank."""
    from forge_core.contracts import model_components
    from forge_tp_plans import check_tensor_parallel

    from .build import model_from_config

    model = model_from_config(cfg)
    decoder = dict(model_components(model)).get("decoder", model)
    try:
        check_tensor_parallel(
            decoder,
            tp,
            plan=cfg.tp.plan,
            sequence_parallel=cfg.tp.sequence_parallel_flag,
            loss_parallel=cfg.tp.loss_parallel,
            allow_import=cfg.tp.allow_import,
        )
    except ForgeConfigError as e:
        raise ForgeConfigError(f"tp.plan: {e}") from None


def _check_importable(key: str, path: str, allow_import: tuple[str, ...]) -> None:
    module_name = check_plan_import(path, allow_import)
    if importlib.util.find_spec(module_name.split(".")[0]) is None:
        raise ForgeConfigError(
            f"{key}={path!r}: module '{module_name}' is not importable from here"
        )

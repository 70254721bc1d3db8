"""A forge job's configuration: every layer's section composed into one :class:`ForgeConfig`.

``load_config`` reads a TOML file (sections ``[model]``, ``[parallelism]``, ``[training]``,
``[tp]``, ``[float8]``, ``[data]``, ``[checkpoint]``, for a field model ``[field]``, and for a
vision-language model ``[vision]``, ``[adapter]``, ``[vlm]``) or a dict, applies ``key=value``
overrides (``parallelism.tp=2``) and rejects unknown keys with a did-you-mean.

Each section belongs to the layer it configures (``ParallelismConfig`` and the dense
``ModelConfig`` to forge_core, its MoE fields to forge_moe_ep's ``MoEModelConfig`` (the
``[model]`` section), ``TPConfig`` to forge_tp_plans, ``Float8Config`` to forge_float8, the VLM configs to
forge_vlm, ``FieldConfig`` to forge_domain), which also checks it; this module only composes
them, with the job's own sections (``[training]``, ``[data]``, ``[checkpoint]``). Every check
here is pure Python on the values (no torch import): a bad config fails before any rank starts,
with a message that names the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from forge_core.config import ParallelismConfig
from forge_core.errors import (
    MAX_SIZE,
    ForgeConfigError,
    check_field_types,
    check_int,
    check_number,
    did_you_mean,
    parse_bool_word,
)
from forge_domain.config import FIELD_PRESETS, FieldConfig
from forge_float8.config import Float8Config
from forge_moe_ep.config import MoEModelConfig
from forge_pp.config import PPConfig
from forge_tp_plans.config import TPConfig
from forge_vlm.config import (
    VLM_DECODER_PRESETS,
    VLM_PRESETS,
    AdapterConfig,
    VisionEncoderConfig,
    VLMConfig,
)

from .paths import read_toml

__all__ = [
    "COMPILE_SCOPES",
    "EMBEDDED_DEFAULT",
    "TOKEN_DTYPES",
    "CheckpointConfig",
    "DataConfig",
    "ForgeConfig",
    "TrainingConfig",
    "as_config",
    "config_to_dict",
    "load_config",
]


#: Where ``torch.compile`` applies (``training.compile_scope``, ``ParallelPlan.compile_scope``).
COMPILE_SCOPES = ("blocks", "model")


#: The largest ``training.seed``: 2**32 - 1. NOTE: seeds reach torch.manual_seed, which takes
#: at most 2**64 - 1, combined with step numbers ((seed + k) x 1_000_003 + step); a 32-bit seed
#: (NumPy's range too) keeps every combination inside it.
MAX_SEED = 2**32 - 1
_SEED_WHY = "a 32-bit seed: forge derives torch.manual_seed's 64-bit seeds from it per step"


@dataclass(frozen=True)
class TrainingConfig:
    """The short training job that ``forge build`` runs and checks for parity.

    ``param_dtype`` is FSDP2's compute dtype (master weights stay float32); parity tolerances
    are the strict fp32 ones only for ``float32``.
    """

    steps: int = 5
    global_batch_size: int = 8
    seq_len: int = 32
    grad_accum: int = 1
    lr: float = 1e-3
    seed: int = 0
    param_dtype: str = "float32"
    ac_mode: str = "none"
    compile: bool = False
    #: with ``compile``: ``"blocks"`` compiles each block before FSDP2 (inside
    #: ``ParallelPlan.parallelize``), ``"model"`` the whole sharded model (``maybe_compile``).
    compile_scope: str = "blocks"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # forge train only (forge build trains at a constant lr, without clipping):
    #: linear warmup steps, then cosine decay to ``lr * min_lr_ratio`` at ``steps``.
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    #: clip the global gradient norm (over every shard and mesh) to this; 0 turns clipping off.
    max_grad_norm: float = 1.0
    #: where ``forge train`` writes ``metrics.jsonl`` (and ``checkpoints/`` unless checkpoint.dir).
    out_dir: str = "runs/forge"
    log_every: int = 1

    def __post_init__(self) -> None:
        check_field_types(self, "training")
        for name in ("steps", "global_batch_size", "seq_len", "grad_accum", "log_every"):
            check_int(f"training.{name}", getattr(self, name))
        check_int("training.warmup_steps", self.warmup_steps, 0)
        check_int("training.seed", self.seed, 0, MAX_SEED, why=_SEED_WHY)
        tokens = self.global_batch_size * (self.seq_len + 1)
        if tokens > MAX_SIZE:
            raise ForgeConfigError(
                f"training.global_batch_size={self.global_batch_size} x (training.seq_len + 1) "
                f"= {tokens} tokens per step, more than 2**31 - 1: a step's token ids are one "
                "tensor (made whole on every rank for synthetic data); lower them"
            )
        if self.param_dtype not in ("float32", "bfloat16", "float16"):
            raise ForgeConfigError(
                f"training.param_dtype={self.param_dtype!r}: choose float32, bfloat16 or float16"
            )
        if self.compile_scope not in COMPILE_SCOPES:
            raise ForgeConfigError(
                f"training.compile_scope={self.compile_scope!r} is invalid: choose one of "
                f"{list(COMPILE_SCOPES)}" + did_you_mean(str(self.compile_scope), COMPILE_SCOPES)
            )
        self._check_optimizer_numbers()

    def _check_optimizer_numbers(self) -> None:
        """The learning rate, its schedule, weight decay and clipping: finite, in range."""
        check_number("training.lr", self.lr, 0, lo_open=True)
        check_number(
            "training.min_lr_ratio",
            self.min_lr_ratio,
            0,
            1,
            why="the cosine schedule ends at lr x min_lr_ratio",
        )
        check_number("training.max_grad_norm", self.max_grad_norm, 0, why="0 turns clipping off")
        check_number("training.weight_decay", self.weight_decay, 0)
        if self.lr * self.weight_decay > 1:
            raise ForgeConfigError(
                f"training.weight_decay={self.weight_decay} with training.lr={self.lr}: AdamW "
                "multiplies every weight by 1 - lr x weight_decay each step, so lr x "
                "weight_decay must be at most 1; lower weight_decay (0.1 is usual) or lr"
            )


TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")


@dataclass(frozen=True)
class DataConfig:
    """Training data for ``forge train``: ``[data]`` section.

    ``path``: a flat binary file of token ids (no header) in ``dtype``, memory-mapped and read
    in windows of ``training.seq_len + 1`` tokens, each data-parallel rank reading only its own
    samples; None trains on synthetic tokens (learnable bigram sequences, see
    ``forge_core.training.synthetic_tokens``). Windows are visited in a seeded shuffled order,
    reshuffled every pass over the file.
    """

    path: str | None = None
    dtype: str = "uint16"

    def __post_init__(self) -> None:
        check_field_types(self, "data")
        if self.dtype not in TOKEN_DTYPES:
            raise ForgeConfigError(
                f"data.dtype={self.dtype!r} is invalid: choose one of {list(TOKEN_DTYPES)}"
                + did_you_mean(str(self.dtype), TOKEN_DTYPES)
            )
        if self.path is not None and not isinstance(self.path, str):
            raise ForgeConfigError(f"data.path={self.path!r} must be a file path (a string)")


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints of ``forge train`` (torch.distributed.checkpoint): ``[checkpoint]`` section.

    ``dir``: where ``step-N`` checkpoints go (None: ``<training.out_dir>/checkpoints``).
    ``every``: save every N steps (0: only at the end and on SIGTERM/Ctrl-C). ``keep``: how many
    of the newest checkpoints to keep. ``async_save``: write in the background while training
    goes on. ``resume``: ``"latest"`` continues from the newest checkpoint in ``dir`` if there is
    one, ``"none"`` starts fresh, anything else is the path of a ``step-N`` directory.
    ``verify``: check the checkpoint's files against its manifest before loading it (one read
    of every file; forge's launcher verifies before starting ranks and turns it off for them).
    """

    dir: str | None = None
    every: int = 0
    keep: int = 2
    async_save: bool = False
    resume: str = "latest"
    save_at_end: bool = True
    verify: bool = True

    def __post_init__(self) -> None:
        check_field_types(self, "checkpoint")
        check_int("checkpoint.every", self.every, 0)
        check_int("checkpoint.keep", self.keep)
        if not isinstance(self.resume, str) or not self.resume:
            raise ForgeConfigError(
                f"checkpoint.resume={self.resume!r}: use 'latest', 'none' or a checkpoint path"
            )


@dataclass(frozen=True)
class ForgeConfig:
    """Everything ``forge build`` needs: the model, the layout, TP options and the training job."""

    model: MoEModelConfig = field(default_factory=lambda: MoEModelConfig.preset("debug"))
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    tp: TPConfig = field(default_factory=TPConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    pp: PPConfig = field(default_factory=PPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    #: A vision-language model when set (all three together): ``[vision]``, ``[adapter]`` and
    #: ``[vlm]``, filled from the model preset (e.g. ``debug_vlm``) and overridden per key.
    vision: VisionEncoderConfig | None = None
    adapter: AdapterConfig | None = None
    vlm: VLMConfig | None = None
    #: An image-like field model (forge_domain.FieldNet) instead of a token model when set.
    field: FieldConfig | None = None

    def __post_init__(self) -> None:
        parts = (self.vision, self.adapter, self.vlm)
        if any(p is not None for p in parts) and any(p is None for p in parts):
            raise ForgeConfigError(
                "a vision-language model needs vision, adapter and vlm configs together"
            )
        if self.field is not None and self.vlm is not None:
            raise ForgeConfigError(
                "a config is a field model ([field]) or a vision-language model ([vlm]), not both"
            )

    @property
    def is_field(self) -> bool:
        return self.field is not None

    @property
    def checkpoint_dir(self) -> Path:
        """Where ``forge train`` keeps checkpoints: ``checkpoint.dir``, else
        ``<training.out_dir>/checkpoints``."""
        c = self.checkpoint.dir
        return Path(c) if c else Path(self.training.out_dir) / "checkpoints"

    @property
    def is_vlm(self) -> bool:
        return self.vlm is not None

    def vlm_sections(self) -> tuple[VisionEncoderConfig, AdapterConfig, VLMConfig]:
        """``(vision, adapter, vlm)`` of a vision-language model config (``is_vlm``).

        ``__post_init__`` guarantees the three are set together; a config that is not a VLM is
        refused with a ``ForgeConfigError``.
        """
        if self.vision is None or self.adapter is None or self.vlm is None:
            raise ForgeConfigError(
                "this config is not a vision-language model: it has no [vision], [adapter] and "
                "[vlm] sections (use a VLM preset such as model.preset=debug_vlm, or set them)"
            )
        return self.vision, self.adapter, self.vlm

    def field_section(self) -> FieldConfig:
        """The ``[field]`` section of a field model config (``is_field``).

        A config that is not a field model is refused with a ``ForgeConfigError``.
        """
        if self.field is None:
            raise ForgeConfigError(
                "this config is not a field model: it has no [field] section (use a field "
                "preset such as model.preset=debug_field, or set [field])"
            )
        return self.field

    def resolved_parallelism(self, world_size: int) -> ParallelismConfig:
        """``parallelism`` resolved for ``world_size`` and this model (``ep=-1`` needs it): the
        degrees of :func:`forge.layout.resolve_layout`, which decides everything else too."""
        from .layout import resolve_layout

        return resolve_layout(self, world_size).parallelism


_SECTIONS: dict[str, type] = {
    "model": MoEModelConfig,
    "parallelism": ParallelismConfig,
    "tp": TPConfig,
    "training": TrainingConfig,
    "float8": Float8Config,
    "pp": PPConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "vision": VisionEncoderConfig,
    "adapter": AdapterConfig,
    "vlm": VLMConfig,
    "field": FieldConfig,
}


_VLM_SECTIONS = ("vision", "adapter", "vlm")


#: What ``load_config(None)`` (``forge build`` with no config file) starts from: the debug model,
#: tp=2 with sequence parallelism and FSDP2 over the remaining ranks (dp_shard 2 x tp 2 on 4);
#: for an MoE preset, expert parallelism over as many of the dp_shard ranks as divide the experts;
#: for a field preset (``--set model.preset=debug_field``), domain 2 and FSDP2 over the rest.
EMBEDDED_DEFAULT: dict[str, dict[str, Any]] = {
    "model": {"preset": "debug"},
    "parallelism": {"tp": 2, "ep": -1},
}


def _parse_value(text: str) -> Any:
    """Parse an override value as TOML (``2``, ``true``, ``"x"``, ``1e-3``), else keep the string.

    The words true and false count in any case (``False`` is false, not the string "False").
    """
    word = parse_bool_word(text)
    if word is not None:
        return word
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _set_override(raw: dict[str, dict[str, Any]], override: str) -> None:
    key, sep, value = override.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise ForgeConfigError(
            f"override {override!r} must look like section.key=value (e.g. parallelism.tp=2)"
        )
    if section not in _SECTIONS:
        raise ForgeConfigError(
            f"override {override!r}: unknown section '{section}'{did_you_mean(section, _SECTIONS)}; "
            f"sections: {list(_SECTIONS)}"
        )
    raw.setdefault(section, {})[name] = _parse_value(value.strip())


def _check_keys(section: str, values: Mapping[str, Any]) -> Mapping[str, Any]:
    """Refuse keys that ``section``'s dataclass does not have; returns ``values``."""
    cls = _SECTIONS[section]
    names = {f.name for f in fields(cls)} | ({"preset"} if cls is MoEModelConfig else set())
    for key in values:
        if key not in names:
            raise ForgeConfigError(
                f"unknown key '{section}.{key}'{did_you_mean(key, names)}; "
                f"valid keys: {sorted(names)}"
            )
    return values


def _build_section(section: str, values: Mapping[str, Any]) -> Any:
    cls = _SECTIONS[section]
    if cls is ParallelismConfig:  # also accepts CREDIT's {data, tensor, domain}
        return ParallelismConfig.from_any(values)
    _check_keys(section, values)
    if cls is MoEModelConfig:
        values = dict(values)
        return MoEModelConfig.preset(_decoder_preset(values.pop("preset", "debug")), **values)
    return cls(**values)


def _decoder_preset(name: Any) -> Any:
    """The ``[model]`` config behind ``model.preset = name``: each layer owns its presets. A
    VLM preset names its decoder (forge-vlm's ``VLM_DECODER_PRESETS``); a field preset
    (forge-domain) has none, its ``[model]`` is unused (the reference ``debug``); the others are
    decoder presets (forge_core's and forge-moe-ep's)."""
    if not isinstance(name, str):
        return name  # MoEModelConfig.preset says what it must be
    if name in VLM_DECODER_PRESETS:
        return VLM_DECODER_PRESETS[name]
    if name in FIELD_PRESETS:
        return "debug"
    known = [*MoEModelConfig.presets(), *VLM_PRESETS, *FIELD_PRESETS]
    if name not in known:
        raise ForgeConfigError(
            f"unknown model preset '{name}'{did_you_mean(name, known)}; presets: {sorted(known)}"
        )
    return name


def load_config(
    path_or_dict: str | Path | Mapping[str, Any] | None = None, overrides: Iterable[str] = ()
) -> ForgeConfig:
    """Load a :class:`ForgeConfig` from a TOML path or a dict, then apply ``key=value`` overrides.

    ``[model]`` takes ``preset = "debug"`` plus any ``MoEModelConfig`` field to override the preset.
    Missing sections take their defaults; unknown sections and keys are errors. With no path or
    dict, the start is :data:`EMBEDDED_DEFAULT` (what ``forge build`` runs by default). A file
    is read by :func:`forge.paths.read_toml`: UTF-8 with or without a byte-order mark, and it
    may not set ``tp.allow_import`` (a dict or an override may).
    """
    if path_or_dict is None:
        raw: dict[str, Any] = {k: dict(v) for k, v in EMBEDDED_DEFAULT.items()}
        presets = [
            o.partition("=")[2].strip().strip("'\"")
            for o in overrides
            if o.partition("=")[0].strip() == "model.preset"
        ]
        if presets and presets[-1] in FIELD_PRESETS:  # a conv net: split the height, not tp
            raw["parallelism"] = {"domain": 2}
    elif isinstance(path_or_dict, Mapping):
        raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in path_or_dict.items()}
    else:
        raw = read_toml(Path(path_or_dict))
    raw = {k: v for k, v in raw.items() if v is not None}  # absent VLM parts of a dumped config
    for section, values in raw.items():
        if section not in _SECTIONS:
            raise ForgeConfigError(
                f"unknown config section '{section}'{did_you_mean(section, _SECTIONS)}; "
                f"sections: {list(_SECTIONS)}"
            )
        if not isinstance(values, Mapping):
            raise ForgeConfigError(f"config section '{section}' must be a table of key = value")
    for override in overrides:
        _set_override(raw, override)
    preset = raw.get("model", {}).get("preset", "debug")
    vlm_preset = VLM_PRESETS.get(preset)
    is_vlm = vlm_preset is not None or any(name in raw for name in _VLM_SECTIONS)
    # NOTE: one value per section, each of its own dataclass: ForgeConfig(**built) checks them.
    built: dict[str, Any] = {}
    field_preset = FIELD_PRESETS.get(preset)
    for name in _SECTIONS:
        if name == "field":
            if field_preset is not None or "field" in raw:
                field_base = field_preset or FieldConfig()
                built[name] = replace(field_base, **_check_keys(name, raw.get(name, {})))
        elif name not in _VLM_SECTIONS:
            built[name] = _build_section(name, raw.get(name, {}))
        elif is_vlm:
            vlm_base = vlm_preset[_VLM_SECTIONS.index(name)] if vlm_preset else _SECTIONS[name]()
            built[name] = replace(vlm_base, **_check_keys(name, raw.get(name, {})))
    return ForgeConfig(**built)


def config_to_dict(cfg: ForgeConfig) -> dict[str, Any]:
    """A plain dict of ``cfg`` (for reports and for sending to ranks)."""
    return dataclasses.asdict(cfg)


def as_config(config: ForgeConfig | Mapping[str, Any] | str | Path, caller: str) -> ForgeConfig:
    """``config`` as a ``ForgeConfig``: one already loaded, or a dict of sections or a TOML
    path read with :func:`load_config`; anything else is refused, naming ``caller``."""
    if isinstance(config, ForgeConfig):
        return config
    if isinstance(config, Mapping | str | Path):
        return load_config(config)
    raise ForgeConfigError(
        f"{caller}(config=...) got a {type(config).__name__}: pass a ForgeConfig, a dict of "
        "config sections or the path of a TOML file"
    )

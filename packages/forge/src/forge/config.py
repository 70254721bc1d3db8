"""A forge job's configuration: every layer's section composed into one :class:`ForgeConfig`.

``load_config`` reads a TOML file (sections ``[model]``, ``[moe]``, ``[parallelism]``,
``[training]``, ``[tp]``, ``[float8]``, ``[data]``, ``[checkpoint]``, ``[metrics]``, for a field model
``[field]``, and for a vision-language model ``[vision]``, ``[adapter]``, ``[vlm]``) or a dict,
applies ``key=value`` overrides (``parallelism.tp=2``) and rejects unknown keys with a
did-you-mean.

Each section belongs to the layer it configures (``ParallelismConfig`` and the dense
``ModelConfig`` (``[model]``) to forge_core, ``MoEConfig`` (``[moe]``) to forge_moe_ep,
``TPConfig`` to forge_tp_plans, ``Float8Config`` to forge_float8, the VLM configs to forge_vlm,
``FieldConfig`` to forge_domain), which also checks it; this module only composes them, with the
job's own sections (:mod:`forge.job_config`: ``[training]``, ``[data]``, ``[checkpoint]``).
Files and checkpoints written before ``[moe]`` existed kept the MoE fields in ``[model]``: they
still load, translated, with a one-line :class:`ForgeConfigNotice`. Every check
here is pure Python on the values (no torch import): a bad config fails before any rank starts,
with a message that names the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from forge_core.config import ParallelismConfig
from forge_core.errors import ForgeConfigError, did_you_mean, parse_bool_word
from forge_core.model_config import ModelConfig
from forge_cp.config import CPConfig
from forge_domain.config import FIELD_PRESETS, FieldConfig
from forge_float8.config import Float8Config
from forge_moe_ep.config import MoEConfig, MoEModelConfig, split_moe_fields
from forge_pp.config import PPConfig
from forge_tp_plans.config import TPConfig
from forge_vlm.config import (
    VLM_DECODER_PRESETS,
    VLM_PRESETS,
    AdapterConfig,
    VisionEncoderConfig,
    VLMConfig,
)

from .hf_source import HFModelConfig, decoder_shape, hf_section, moe_shape, read_hf_config
from .job_config import (
    COMPILE_SCOPES,
    TOKEN_DTYPES,
    CheckpointConfig,
    DataConfig,
    MetricsConfig,
    TrainingConfig,
)
from .paths import read_toml

__all__ = [
    "COMPILE_SCOPES",
    "EMBEDDED_DEFAULT",
    "TOKEN_DTYPES",
    "CheckpointConfig",
    "DataConfig",
    "ForgeConfig",
    "MetricsConfig",
    "ForgeConfigNotice",
    "TrainingConfig",
    "as_config",
    "config_to_dict",
    "load_config",
]


class ForgeConfigNotice(FutureWarning):
    """A config that still loads but is written the old way (the CLI prints it as one line)."""


@dataclass(frozen=True)
class ForgeConfig:
    """Everything ``forge build`` needs: the model, the layout, TP options and the training job.

    ``model`` is the reference decoder's dense shape and ``moe`` its MoE blocks (None: a dense
    model); :attr:`decoder` joins them. ``ForgeConfig(model=MoEModelConfig(...))`` (the joined
    config of the Python API) is split into the two.
    """

    model: ModelConfig = field(default_factory=lambda: ModelConfig.preset("debug"))
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    tp: TPConfig = field(default_factory=TPConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    pp: PPConfig = field(default_factory=PPConfig)
    cp: CPConfig = field(default_factory=CPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    #: A vision-language model when set (all three together): ``[vision]``, ``[adapter]`` and
    #: ``[vlm]``, filled from the model preset (e.g. ``debug_vlm``) and overridden per key.
    vision: VisionEncoderConfig | None = None
    adapter: AdapterConfig | None = None
    vlm: VLMConfig | None = None
    #: An image-like field model (forge_domain.FieldNet) instead of a token model when set.
    field: FieldConfig | None = None
    #: ``[moe]``: the decoder's mixture-of-experts blocks (forge-moe-ep's section); None: dense.
    moe: MoEConfig | None = None
    #: ``[model] hf``: a Hugging Face model directory trained instead of forge's model (then
    #: ``model`` is the reference shape closest to its config.json, what sizes and costs read).
    hf: HFModelConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, MoEModelConfig):
            if self.moe is not None:
                raise ForgeConfigError(
                    "ForgeConfig got the MoE fields twice (model=MoEModelConfig(...) and moe=...): "
                    "pass the dense ModelConfig as model and the MoE fields as moe"
                )
            dense, moe = self.model.parts()
            object.__setattr__(self, "model", dense)
            object.__setattr__(self, "moe", moe)
        if self.hf is not None and (self.field, self.vlm) != (None, None):
            raise ForgeConfigError(
                "model.hf is set with [field] or [vlm]: a Hugging Face model's blocks come from "
                "its config.json; remove those sections"
            )
        if self.moe is not None and self.field is not None:
            raise ForgeConfigError(
                "a field model ([field]) has no MoE blocks: remove the [moe] section"
            )
        self._check_parts()
        if self.field is None:
            _ = self.decoder  # the joined shape's own checks (e.g. the MoE parameter count)

    def _check_parts(self) -> None:
        parts = (self.vision, self.adapter, self.vlm)
        if any(p is not None for p in parts) and any(p is None for p in parts):
            raise ForgeConfigError(
                "a vision-language model needs vision, adapter and vlm configs together"
            )
        if self.field is not None and self.vlm is not None:
            raise ForgeConfigError(
                "a config is a field model ([field]) or a vision-language model ([vlm]), not both"
            )

    @functools.cached_property
    def decoder(self) -> MoEModelConfig:
        """The reference decoder's config: ``[model]`` joined with ``[moe]``
        (``MoEModelConfig.from_parts``), what the model is built from and costed by."""
        return MoEModelConfig.from_parts(self.model, self.moe)

    @property
    def routed_experts(self) -> int:
        """Routed experts per MoE block (0: the decoder has no MoE block)."""
        return self.moe.num_experts if self.moe and self.decoder.custom_ffn_layers else 0

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
    "model": ModelConfig,
    "moe": MoEConfig,
    "parallelism": ParallelismConfig,
    "tp": TPConfig,
    "training": TrainingConfig,
    "float8": Float8Config,
    "pp": PPConfig,
    "cp": CPConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
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
    names = {f.name for f in fields(cls)} | ({"preset"} if cls is ModelConfig else set())
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
    return cls(**_check_keys(section, values))


def _model_sections(raw: Mapping[str, Any]) -> tuple[ModelConfig, MoEConfig | None]:
    """``[model]`` (its preset with the keys given) and ``[moe]`` (the preset's MoE blocks, if
    it has any, with the keys given; None: a dense model)."""
    values = dict(_check_keys("model", raw.get("model", {})))
    name = _decoder_preset(values.pop("preset", "debug"))
    joined = MoEModelConfig.preset(name, **values)
    dense, moe = joined.parts()
    if "moe" not in raw:
        return dense, moe
    given = _check_keys("moe", raw["moe"])
    return dense, replace(moe, **given) if moe is not None else MoEConfig(**given)


def _preset_has_moe(raw: Mapping[str, Any]) -> bool:
    """Whether ``[model] preset`` names a decoder with MoE blocks (``debug_moe``)."""
    name = raw.get("model", {}).get("preset", "debug")
    if not isinstance(name, str):
        return False  # NOTE: _model_sections refuses it, with the fix
    preset = MoEModelConfig.presets().get(_decoder_preset(name))
    return preset is not None and bool(preset.custom_ffn_layers)


def _moe_fields_out_of_model(raw: dict[str, Any]) -> None:
    """Move MoE fields found in ``[model]`` (where files and checkpoints written before
    ``[moe]`` existed keep them) to ``[moe]``, with a :class:`ForgeConfigNotice`. They override
    an MoE preset's fields as they did; over a dense preset an absent ``moe_every`` meant 0 (a
    dense model, whose MoE fields are then checked and dropped).
    """
    dense, moved = split_moe_fields(raw.get("model", {}))
    if not moved:
        return
    given = raw.get("moe", {})
    twice = sorted(k for k in moved if k in given)
    if twice:
        raise ForgeConfigError(
            f"model.{twice[0]} and moe.{twice[0]} are both set: the MoE fields belong in [moe]; "
            f"remove model.{twice[0]}"
        )
    names = sorted(moved)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    warnings.warn(
        f"[model] holds the MoE fields {shown}: read as [moe] (forge keeps them there now; "
        "move them to [moe] to silence this)",
        ForgeConfigNotice,
        stacklevel=3,
    )
    moe, keep = {**moved, **given}, "moe" in raw or _preset_has_moe(raw)
    if not keep:
        moe.setdefault("moe_every", 0)
    raw["model"] = dense
    if keep or MoEConfig(**_check_keys("moe", moe)).moe_every:
        raw["moe"] = moe


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

    ``[model]`` takes ``preset = "debug"`` plus any ``ModelConfig`` field to override the preset;
    ``[moe]`` any ``MoEConfig`` field (over an MoE preset's, such as ``debug_moe``). Missing sections take their defaults; unknown sections and keys are errors. With no path or
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
        if any(o.partition("=")[0].strip() == "model.hf" for o in overrides):
            # NOTE: the directory's config.json replaces the debug preset, and FSDP2 over every
            # rank the demo's tp=2 (which the model's heads may not divide)
            raw["model"], raw["parallelism"] = {}, {}
    elif isinstance(path_or_dict, Mapping):
        raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in path_or_dict.items()}
    else:
        raw = read_toml(Path(path_or_dict))
    raw = {k: v for k, v in raw.items() if v is not None}  # absent VLM parts of a dumped config
    for section, values in raw.items():
        if section not in _SECTIONS and section != "hf":  # NOTE: hf: a dumped config's
            raise ForgeConfigError(
                f"unknown config section '{section}'{did_you_mean(section, _SECTIONS)}; "
                f"sections: {list(_SECTIONS)}"
            )
        if not isinstance(values, Mapping):
            raise ForgeConfigError(f"config section '{section}' must be a table of key = value")
    for override in overrides:
        _set_override(raw, override)
    _moe_fields_out_of_model(raw)
    # NOTE: one value per section, each of its own dataclass: ForgeConfig(**built) checks them.
    hf = hf_section(raw.get("model", {}), raw.pop("hf", None))
    built: dict[str, Any] = {"hf": hf}
    if hf is not None and "hf" in raw.get("model", {}):  # named now: config.json decides
        if "moe" in raw:
            raise ForgeConfigError(
                "[moe] is set with model.hf: a Hugging Face model's MoE blocks come from its "
                "config.json; remove [moe]"
            )
        hf_config = read_hf_config(hf.dir)
        built["model"], built["moe"] = decoder_shape(hf_config, hf.dir), moe_shape(hf_config)
    else:  # forge's model, or a dumped config's hf table with the shape read when named
        built.update(zip(("model", "moe"), _model_sections(raw), strict=True))
    built.update(_field_or_vlm_sections(raw))
    for name in _SECTIONS:
        if name not in built and name not in ("field", *_VLM_SECTIONS):
            built[name] = _build_section(name, raw.get(name, {}))
    return ForgeConfig(**built)


def _field_or_vlm_sections(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``[field]`` (forge-domain) or ``[vision]``, ``[adapter]`` and ``[vlm]`` (forge-vlm): each
    from the model preset's (``debug_field``, ``debug_vlm``) or the defaults, with the keys
    given; none when the config names neither."""
    preset = raw.get("model", {}).get("preset", "debug")
    vlm_preset, field_preset = VLM_PRESETS.get(preset), FIELD_PRESETS.get(preset)
    built: dict[str, Any] = {}
    if field_preset is not None or "field" in raw:
        base = field_preset or FieldConfig()
        built["field"] = replace(base, **_check_keys("field", raw.get("field", {})))
    if vlm_preset is not None or any(name in raw for name in _VLM_SECTIONS):
        for i, name in enumerate(_VLM_SECTIONS):
            vlm_base = vlm_preset[i] if vlm_preset else _SECTIONS[name]()
            built[name] = replace(vlm_base, **_check_keys(name, raw.get(name, {})))
    return built


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

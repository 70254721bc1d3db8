"""``[field]``: the image-like model of spatial domain parallelism (pure Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from forge_core.errors import ForgeConfigError, check_field_types

__all__ = ["FIELD_PRESETS", "FieldConfig"]


@dataclass(frozen=True)
class FieldConfig:
    """An image-like model for spatial domain parallelism: ``[field]`` section.

    forge_domain's ``FieldNet`` maps a field ``[B, channels, height, width]`` (e.g. weather
    variables on a latitude x longitude grid, periodic in longitude) to the field one step later:
    a 3x3 stem, ``n_blocks`` residual blocks (GroupNorm with ``groups``, SiLU, a 3x3 conv
    wrapping around the width), a 1x1 head. ``forge train`` learns a fixed synthetic dynamic
    (an advection plus diffusion stencil) on random smooth fields; ``parallelism.domain`` splits
    the height across ranks.
    """

    channels: int = 2
    hidden: int = 16
    height: int = 32
    width: int = 32
    n_blocks: int = 2
    groups: int = 4

    def __post_init__(self) -> None:
        check_field_types(self, "field")
        for name in ("channels", "hidden", "height", "width", "n_blocks", "groups"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ForgeConfigError(f"field.{name}={v!r} must be a positive integer")
        if self.hidden % self.groups:
            raise ForgeConfigError(
                f"field.groups={self.groups} must divide field.hidden={self.hidden} (GroupNorm)"
            )


#: Field-model presets, selected by ``model.preset`` (their decoder config is unused).
FIELD_PRESETS: dict[str, FieldConfig] = {"debug_field": FieldConfig()}

"""``[field]``: the image-like model of spatial domain parallelism (pure Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from forge_core.errors import (
    MAX_SIZE,
    ForgeConfigError,
    check_blocks,
    check_field_types,
    check_int,
)

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
        for name in ("channels", "hidden", "height", "width", "groups"):
            check_int(f"field.{name}", getattr(self, name))
        check_blocks("field.n_blocks", self.n_blocks)
        per_sample = max(self.channels, self.hidden) * self.height * self.width
        if per_sample > MAX_SIZE:
            raise ForgeConfigError(
                f"field.height={self.height} x field.width={self.width} x "
                f"{max(self.channels, self.hidden)} channels = {per_sample} values per sample "
                "in one activation, more than 2**31 - 1 (conv kernels index them in 32 bits); "
                "lower the sizes"
            )
        if self.hidden % self.groups:
            raise ForgeConfigError(
                f"field.groups={self.groups} must divide field.hidden={self.hidden} (GroupNorm)"
            )


#: Field-model presets, selected by ``model.preset`` (their decoder config is unused).
FIELD_PRESETS: dict[str, FieldConfig] = {"debug_field": FieldConfig()}

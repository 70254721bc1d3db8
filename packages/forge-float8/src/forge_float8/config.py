"""``[float8]``: Float8 training settings (pure Python, no torch import)."""

from __future__ import annotations

from dataclasses import dataclass

from forge_core.errors import (
    ForgeConfigError,
    auto_flag,
    check_auto_flag,
    check_field_types,
    did_you_mean,
    freeze_strings,
)

__all__ = ["FLOAT8_RECIPES", "Float8Config"]

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass(frozen=True)
class Float8Config:
    """Float8 training (forge-float8, torchao): ``[float8]`` section.

    ``fsdp_float8_all_gather``: ``"auto"`` (on for tensorwise FSDP2 without TP on NCCL), true or
    false. ``filter_fqns``: module-name substrings to keep in high precision.
    """

    enabled: bool = False
    recipe: str = "tensorwise"
    fsdp_float8_all_gather: bool | str = "auto"
    filter_fqns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_field_types(self, "float8")
        if self.recipe not in FLOAT8_RECIPES:
            raise ForgeConfigError(
                f"float8.recipe={self.recipe!r} is invalid: choose one of {list(FLOAT8_RECIPES)}"
                + did_you_mean(str(self.recipe), FLOAT8_RECIPES)
            )
        check_auto_flag("float8.fsdp_float8_all_gather", self.fsdp_float8_all_gather)
        freeze_strings(self, "filter_fqns", "float8.filter_fqns", "strings")

    @property
    def fsdp_all_gather_flag(self) -> bool | None:
        """None for ``"auto"``, else the bool."""
        return auto_flag(self.fsdp_float8_all_gather)

    def resolve_fsdp_all_gather(self, *, data: str, tp: int, dp_backend: str | None) -> bool:
        """FSDP2's fp8 all-gather: as asked, or for ``"auto"`` on exactly for the tensorwise
        recipe under FSDP2 without TP, on a data-parallel group that is not gloo (the one place
        this rule is decided).

        NOTE: off on gloo: an FSDP2 unit holding only fp8 weights all-gathers in a float8
        dtype, which gloo cannot move. ``dp_backend``: the data-parallel group's backend name
        (None without one).
        """
        asked = self.fsdp_all_gather_flag
        if asked is not None:
            return asked
        return (
            data == "fsdp2"
            and self.recipe == "tensorwise"
            and tp == 1
            and dp_backend not in (None, "gloo")
        )

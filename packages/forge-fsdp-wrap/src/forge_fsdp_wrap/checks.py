"""Pure checks of the data-parallel and activation-checkpointing settings (no torch import: a
launcher runs them on the config before any rank starts)."""

from __future__ import annotations

from forge_core.errors import ForgeConfigError, did_you_mean

__all__ = ["AC_MODES", "check_ac_mode"]

AC_MODES = ("none", "full", "selective", "op")


def check_ac_mode(mode: str) -> None:
    """``mode`` must be one of :data:`AC_MODES`."""
    if mode not in AC_MODES:
        raise ForgeConfigError(
            f"ac_mode={mode!r} is invalid: choose one of {list(AC_MODES)}"
            + did_you_mean(str(mode), AC_MODES)
        )

"""Pure checks of the data-parallel and activation-checkpointing settings (no torch import: a
launcher runs them on the config before any rank starts). :func:`ac_mode_problems` returns the
problems as one-line messages (empty: fine); :func:`check_ac_mode` raises the first."""

from __future__ import annotations

from forge_core.errors import did_you_mean, refuse

__all__ = ["AC_MODES", "ac_mode_problems", "check_ac_mode"]

AC_MODES = ("none", "full", "selective", "op")


def ac_mode_problems(mode: str) -> list[str]:
    """``[message]`` unless ``mode`` is one of :data:`AC_MODES`."""
    if mode in AC_MODES:
        return []
    return [
        f"ac_mode={mode!r} is invalid: choose one of {list(AC_MODES)}"
        + did_you_mean(str(mode), AC_MODES)
    ]


def check_ac_mode(mode: str) -> None:
    """``mode`` must be one of :data:`AC_MODES`."""
    refuse(ac_mode_problems(mode))

"""Errors a user can cause.

forge raises :class:`ForgeConfigError` for anything the user can fix by changing a config value or
a call: the message names the field, the value and the fix. It subclasses ``ValueError`` so code
that already catches ``ValueError`` keeps working. Internal invariants use ``assert``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["ForgeConfigError", "auto_flag", "check_auto_flag", "did_you_mean"]


class ForgeConfigError(ValueError):
    """A configuration or call that forge refuses, raised before any collective starts."""


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest option, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_auto_flag(key: str, value: object) -> None:
    """Refuse anything but true, false or ``"auto"`` for config flag ``key``."""
    if value not in (True, False, "auto"):
        raise ForgeConfigError(f'{key}={value!r}: use true, false or "auto"')


def auto_flag(value: bool | str) -> bool | None:
    """None for ``"auto"``, else the bool."""
    return None if value == "auto" else bool(value)

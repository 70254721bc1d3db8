"""Errors a user can cause.

forge raises :class:`ForgeConfigError` for anything the user can fix by changing a config value or
a call: the message names the field, the value and the fix. It subclasses ``ValueError`` so code
that already catches ``ValueError`` keeps working. Internal invariants use ``assert``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Hashable, Iterable

__all__ = [
    "ForgeConfigError",
    "auto_flag",
    "check_auto_flag",
    "check_field_types",
    "did_you_mean",
    "parse_bool_word",
    "refuse",
]


class ForgeConfigError(ValueError):
    """A configuration or call that forge refuses, raised before any collective starts."""


def refuse(problems: Iterable[str]) -> None:
    """Raise :class:`ForgeConfigError` with the first of ``problems``; return when there is none.

    The bridge from a pure check that returns every problem it finds (``*_problems(...) ->
    list[str]``, one line each) to the raising ``check_*`` of the same rule: ``check_x(...)`` is
    ``refuse(x_problems(...))``, so both say the same words.
    """
    for message in problems:
        raise ForgeConfigError(message)


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest option, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_auto_flag(key: str, value: object) -> None:
    """Refuse anything but true, false or ``"auto"`` for config flag ``key``."""
    if not (isinstance(value, bool) or value == "auto"):
        word = parse_bool_word(value) if isinstance(value, str) else None
        fix = "" if word is None else f" ({str(word).lower()} without quotes)"
        raise ForgeConfigError(f'{key}={value!r}: use true, false or "auto"{fix}')


def auto_flag(value: bool | str) -> bool | None:
    """None for ``"auto"``, else the bool."""
    return None if value == "auto" else bool(value)


# --------------------------------------------------------------------------- field types
# NOTE: the config dataclasses use a handful of annotations: bool, int, float, str, tuple[str,
# ...] and unions of them with None (or bool | str for "auto" flags). Python does not check
# annotations, and bool(any non-empty string) is True, so without this check a config value
# "False" would switch a feature on.
_WHAT = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURAL = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


@functools.cache
def _field_hints(cls: Hashable) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _matches(hint: object, value: object) -> bool:
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(arm, value) for arm in typing.get_args(hint))
    if origin is tuple:  # tuple[str, ...]: a list from TOML, frozen to a tuple afterwards
        (item, *_) = typing.get_args(hint)
        return isinstance(value, list | tuple) and all(_matches(item, v) for v in value)
    return True  # NOTE: an annotation this check does not know: the field validates itself


def _describe(hint: object) -> str:
    if hint is type(None):
        return "none"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        text = " or ".join(_describe(a) for a in arms)
        return text + (" (or left out)" if len(arms) < len(typing.get_args(hint)) else "")
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        return f"a list of {_PLURAL.get(item, str(item))}"
    return _WHAT.get(hint, str(hint))  # type: ignore[call-overload]


def check_field_types(obj: object, section: str) -> None:
    """Refuse a field of dataclass ``obj`` whose value is not of its annotated type.

    One rule for every config section (``section`` names it in the message): a bool field takes
    only true/false, an int field no bool or float, a float field any number but a bool, a str
    field only a string. Called first in each config dataclass's ``__post_init__``, so the
    Python API and ``load_config`` refuse the same values with the same message.
    """
    hints = _field_hints(typing.cast(Hashable, type(obj)))
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value, hint = getattr(obj, f.name), hints[f.name]
        if not _matches(hint, value):
            fix = ""
            takes_bool = bool in (hint, *typing.get_args(hint))  # bool, or bool | None
            if takes_bool and isinstance(value, str) and parse_bool_word(value) is not None:
                fix = f" ({str(parse_bool_word(value)).lower()} without quotes)"
            raise ForgeConfigError(f"{section}.{f.name}={value!r} must be {_describe(hint)}{fix}")


def parse_bool_word(text: str) -> bool | None:
    """``True``/``False`` for the words true/false in any case, else None."""
    word = text.strip().lower()
    return True if word == "true" else False if word == "false" else None


def freeze_strings(obj: object, name: str, key: str, what: str) -> None:
    """Check that field ``name`` is a list of strings and store it as a tuple."""
    value = getattr(obj, name)
    if not isinstance(value, tuple | list) or not all(isinstance(v, str) for v in value):
        raise ForgeConfigError(f"{key}={value!r} must be a list of {what}")
    object.__setattr__(obj, name, tuple(value))

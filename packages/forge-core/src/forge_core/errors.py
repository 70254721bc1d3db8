"""Errors a user can cause.

forge raises :class:`ForgeConfigError` for anything the user can fix by changing a config value or
a call: the message names the field, the value and the fix. It subclasses ``ValueError`` so code
that already catches ``ValueError`` keeps working. Internal invariants use ``assert``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Hashable, Iterable

__all__ = [
    "FLOAT32_MAX",
    "MAX_BLOCKS",
    "MAX_PARAMS",
    "MAX_RANKS",
    "MAX_SIZE",
    "ForgeConfigError",
    "auto_flag",
    "check_auto_flag",
    "check_blocks",
    "check_field_types",
    "check_int",
    "check_number",
    "did_you_mean",
    "int_problem",
    "number_problem",
    "params_problem",
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


# --------------------------------------------------------------------------- numeric ranges
# NOTE: one place decides what a number in a config may be; each config section names its
# fields and their bounds, and the words of every refusal come from here. Without the bounds a
# value that Python takes (inf, nan, 2**64) is refused only on a rank, after launch, as an
# overflow, an allocation failure or NaN losses.

#: The largest size or count a config takes: 2**31 - 1 (a tensor dimension, a number of steps,
#: samples, blocks or experts). NOTE: the largest int32: sizes reach kernels that index in 32
#: bits (CUDA grids, embedding and cross-entropy kernels), and no real job comes near it, so a
#: larger value is a typo that would otherwise fail on a rank after launch.
MAX_SIZE = 2**31 - 1
#: The most parameters a model may have: 2**50 (about 1.1e15). NOTE: training holds about 16
#: bytes per parameter (float32 weights and gradients, AdamW's two moments): 16 PiB, more memory
#: than any machine has. The bound also keeps every tensor's element count far inside int64.
MAX_PARAMS = 2**50
#: The most ranks (and so the largest degree of one mesh axis): 2**20 = 1,048,576. NOTE: more
#: accelerators than any machine has (the largest have about 10**5); the messages that list the
#: divisors of a degree stay quick to compute.
MAX_RANKS = 2**20
#: The most blocks (layers) a model may stack: 2**16. NOTE: every block is a Python module on
#: every rank, with its parameters' metadata: tens of kB of host memory each, so 2**16 blocks
#: are already gigabytes before any weight; the deepest models have about 10**2.
MAX_BLOCKS = 2**16
_BLOCKS_WHY = "2**16: every block is a Python module on every rank; real models have ~100"
#: The largest finite float32 (about 3.4e38). NOTE: learning rates, norms and scales are used
#: in float32 tensors, where a larger number is inf.
FLOAT32_MAX = 3.4028234663852886e38


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _interval(lo: float, hi: float, lo_open: bool, hi_open: bool) -> str:
    low = f"{'>' if lo_open else '>='} {lo:g}"
    if hi >= FLOAT32_MAX:  # NOTE: the bound of every number used in float32: said when passed
        return low
    return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def number_problem(
    key: str,
    value: object,
    lo: float,
    hi: float = FLOAT32_MAX,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    why: str = "",
) -> str | None:
    """The one-line refusal of config number ``key`` unless it is finite and in ``[lo, hi]``
    (an open end with ``lo_open`` / ``hi_open``); None when it is fine.

    ``why`` (said after the range) explains the bound. nan and inf are never finite: a
    comparison with nan is always false, so every range check here starts with finiteness.
    """
    if not _is_number(value):
        return f"{key}={value!r} must be a number"
    try:
        v = float(value)  # type: ignore[arg-type]  # NOTE: _is_number checked it
    except OverflowError:  # an int beyond any float (10**400)
        v = math.inf
    if math.isfinite(v) and v > hi >= FLOAT32_MAX:
        why = why or "it is used in float32, whose largest number is 3.4e38"
    elif math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi):
        return None
    return f"{key}={value!r} must be a finite number {_interval(lo, hi, lo_open, hi_open)}" + (
        f": {why}" if why else ""
    )


def check_number(
    key: str,
    value: object,
    lo: float,
    hi: float = FLOAT32_MAX,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    why: str = "",
) -> None:
    """Raise :func:`number_problem`'s refusal of ``value``, if any."""
    problem = number_problem(key, value, lo, hi, lo_open=lo_open, hi_open=hi_open, why=why)
    if problem:
        raise ForgeConfigError(problem)


def int_problem(
    key: str, value: object, lo: int = 1, hi: int = MAX_SIZE, *, why: str = ""
) -> str | None:
    """The one-line refusal of config integer ``key`` unless it is in ``[lo, hi]``; None when
    it is fine. Below ``lo`` it says what the field takes (``a positive integer`` for ``lo=1``);
    above ``hi`` it says the bound and why (``why``, else :data:`MAX_SIZE`'s reason)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{key}={value!r} must be an integer"
    if value < lo:
        what = {1: "a positive integer", 0: "an integer >= 0"}.get(lo, f"an integer >= {lo}")
        return f"{key}={value!r} must be {what}"
    if value > hi:
        reason = why or (
            "2**31 - 1, the largest size forge takes: kernels index sizes in 32 bits"
            if hi == MAX_SIZE
            else ""
        )
        return f"{key}={value} is too large: it must be at most {hi}" + (
            f" ({reason})" if reason else ""
        )
    return None


def check_blocks(key: str, value: object) -> None:
    """Refuse a block count ``key`` (layers, residual blocks) outside ``[1, MAX_BLOCKS]``."""
    check_int(key, value, 1, MAX_BLOCKS, why=_BLOCKS_WHY)


def check_int(key: str, value: object, lo: int = 1, hi: int = MAX_SIZE, *, why: str = "") -> None:
    """Raise :func:`int_problem`'s refusal of ``value``, if any."""
    problem = int_problem(key, value, lo, hi, why=why)
    if problem:
        raise ForgeConfigError(problem)


def params_problem(what: str, count: int, sizes: str) -> str | None:
    """The refusal of a model (``what``, e.g. ``"model"``) of ``count`` parameters over
    :data:`MAX_PARAMS`, naming the ``sizes`` fields that give it; None when it is fine."""
    if count <= MAX_PARAMS:
        return None
    return (
        f"{what} has {count:.3g} parameters ({sizes}), more than 2**50 = {MAX_PARAMS:.3g}: "
        "training takes about 16 bytes per parameter (weights, gradients, AdamW state), "
        "more memory than any machine has; lower these sizes"
    )

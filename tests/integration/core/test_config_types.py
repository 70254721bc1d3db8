"""Every config field refuses a value of the wrong type, naming ``section.field``; no boolean
field ever reads a string (or a number) as true.

The wrong values are derived from each field's annotation, so a field added later is covered
without editing this file.
"""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest
from forge.config import _SECTIONS, TrainingConfig, load_config
from forge_core import ForgeConfigError, ModelConfig

# One wrong value per kind of annotation arm; a value is wrong for a field when no arm takes it.
_PROBES: list[object] = ["maybe", "False", "2", 1.5, 1, 0, True, None, ["x"], [1]]


def _arms(hint: object) -> tuple[object, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _accepts(hint: object, value: object) -> bool:
    """What the annotation allows (the spec the refusals are checked against)."""
    for arm in _arms(hint):
        if arm is type(None) and value is None:
            return True
        if arm is bool and isinstance(value, bool):
            return True
        if arm is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if arm is float and isinstance(value, int | float) and not isinstance(value, bool):
            return True
        if arm is str and isinstance(value, str):
            return True
        if typing.get_origin(arm) is tuple and isinstance(value, list):
            (item, *_) = typing.get_args(arm)
            return all(_accepts(item, v) for v in value)
    return False


def _cases() -> list[tuple[str, str, object]]:
    cases = []
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            for value in _PROBES:
                if not _accepts(hints[f.name], value):
                    cases.append((section, f.name, value))
    return cases


CASES = _cases()


def test_every_section_and_field_is_probed():
    probed = {(s, f) for s, f, _ in CASES}
    every = {(s, f.name) for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}
    assert probed == every
    assert len(CASES) > 300  # about 6 wrong values per field


@pytest.mark.parametrize(("section", "name", "value"), CASES)
def test_a_wrong_typed_value_is_refused_naming_the_field(section, name, value):
    with pytest.raises(ForgeConfigError) as err:
        load_config({section: {name: value}})
    message = str(err.value)
    assert f"{section}.{name}=" in message, message
    assert "\n" not in message


BOOL_FIELDS = [
    (section, f.name)
    for section, cls in _SECTIONS.items()
    for f in dataclasses.fields(cls)
    if bool in _arms(typing.get_type_hints(cls)[f.name])
]


def test_the_known_boolean_fields_are_all_covered():
    names = {f"{s}.{n}" for s, n in BOOL_FIELDS}
    assert {"float8.enabled", "training.compile", "checkpoint.async_save"} <= names
    assert len(BOOL_FIELDS) >= 10


@pytest.mark.parametrize(("section", "name"), BOOL_FIELDS)
@pytest.mark.parametrize("word", ["False", "false", "FALSE", "0", "no", "maybe", "'False'"])
def test_set_false_like_words_mean_false_or_are_refused(section, name, word):
    """``--set float8.enabled=False`` once switched Float8 on; never again for any boolean."""
    try:
        cfg = load_config({}, [f"{section}.{name}={word}"])
    except ForgeConfigError as err:
        assert f"{section}.{name}=" in str(err)
        assert word.lower() not in ("false", "'false'") or "without quotes" in str(err)
        return
    assert word.strip("'").lower() == "false"
    assert getattr(getattr(cfg, section), name) is False


def test_set_true_words_mean_true_in_any_case():
    cfg = load_config({}, ["float8.enabled=True", "training.compile=TRUE", "tp.loss_parallel=true"])
    assert cfg.float8.enabled is True
    assert cfg.training.compile is True and cfg.tp.loss_parallel is True


def test_a_quoted_boolean_in_a_file_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[float8]\nenabled = "False"\n')
    with pytest.raises(ForgeConfigError, match=r"float8\.enabled='False'.*without quotes"):
        load_config(path)


def test_the_python_api_refuses_the_same_values():
    with pytest.raises(ForgeConfigError, match=r"training\.compile='yes' must be true or false"):
        TrainingConfig(compile="yes")
    with pytest.raises(ForgeConfigError, match=r"model\.dim=64\.0 must be an integer"):
        ModelConfig.preset("debug", dim=64.0)


def test_a_preset_that_is_not_a_string_is_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\npreset = 3\n")
    with pytest.raises(ForgeConfigError, match=r"model\.preset=3 must be a preset name"):
        load_config(path)

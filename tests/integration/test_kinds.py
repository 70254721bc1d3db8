"""forge.kinds: a config's kind of model, asked instead of tested (issue 32)."""

from __future__ import annotations

import pytest
from forge.config import load_config
from forge.kinds import DecoderKind, FieldKind, VLMKind, model_kind
from forge.layout import resolve_layout


@pytest.mark.parametrize(
    ("preset", "kind", "label"),
    [
        ("debug", DecoderKind, "model"),
        ("debug_moe", DecoderKind, "model"),
        ("debug_vlm", VLMKind, "VLM decoder"),
        ("debug_field", FieldKind, "field model"),
    ],
)
def test_each_config_has_one_kind(preset, kind, label):
    found = model_kind(load_config({"model": {"preset": preset}}))
    assert type(found) is kind and found.label == label


def test_the_kinds_answer_where_they_differ():
    decoder, vlm, field = (
        model_kind(load_config({"model": {"preset": p}}))
        for p in ("debug", "debug_vlm", "debug_field")
    )
    assert decoder.hf_export_problems() == [] and decoder.build_problems() == []
    assert vlm.hf_export_problems() == field.hf_export_problems() != []
    assert field.build_problems() and field.plan_problems() and not vlm.plan_problems()
    assert decoder.checkpointed_components() == ("decoder",)
    assert decoder.throughput()[1] == "tok/s" and field.throughput()[:2] == (None, "pts/s")
    assert vlm.describe()[0].endswith("+ vision encoder")
    assert field.describe()[0].startswith("field model FieldNet")
    # a VLM's inputs cost activations before its decoder; a plain decoder's do not
    sizes = {"b": 2, "s": 16, "dim": 64, "tp": 1, "itemsize": 4}
    assert set(decoder.input_activation_bytes(**sizes).values()) == {0}
    vision = vlm.input_activation_bytes(**sizes)
    assert vision.keys() == decoder.input_activation_bytes(**sizes).keys()
    assert vision["none"] > vision["selective"] > vision["full"] > 0


def test_a_token_model_refuses_domain_and_a_field_model_tp():
    token = load_config({"parallelism": {"domain": 2}})
    (line,) = model_kind(token).problems(resolve_layout(token, 2))
    assert line.startswith("parallelism.domain=2: domain parallelism splits 2-D fields")
    field = load_config({"model": {"preset": "debug_field"}, "parallelism": {"tp": 2}})
    problems = model_kind(field).problems(resolve_layout(field, 2))
    assert any(p.startswith("parallelism.tp is set for a field model") for p in problems)


def test_a_vlm_takes_no_token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"\0" * 200)
    cfg = load_config({"model": {"preset": "debug_vlm"}, "data": {"path": str(path)}})
    (line,) = model_kind(cfg).data_problems()
    assert "a token file holds no images" in line

"""forge.model_spec: the one place that tells model kinds apart for ParallelPlan. Each kind names
the modules the stages act on; one process, no mesh (the stages themselves: the parity tests)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from forge import load_config
from forge.build import build_meta_model
from forge.model_spec import model_spec
from forge_core import ForgeConfigError, ModelConfig
from forge_vlm import build_vlm

from tests.parity_jobs import TINY_HF_DECODER


def test_forge_transformer_is_one_model_every_stage_acts_on():
    model = build_meta_model(ModelConfig.preset("debug"))
    spec = model_spec(model, None)
    assert spec.kind == "model"
    assert spec.decoder is model and spec.tp_target is model and spec.encoder is None
    assert spec.parts == ()


def test_a_vlm_is_components_with_tp_ep_and_float8_on_its_decoder():
    cfg = load_config({"model": {"preset": "debug_vlm"}})
    model = build_vlm(cfg.decoder, cfg.vision, cfg.adapter, cfg.vlm)
    spec = model_spec(model, None, vlm=cfg.vlm)
    assert spec.kind == "components"
    assert spec.decoder is model.decoder and spec.tp_target is model.decoder
    assert spec.encoder is model.encoder and len(spec.parts) == 3


def test_a_hugging_face_model_takes_its_plan_on_the_whole_model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_HF_DECODER))
    spec = model_spec(model, None)
    assert spec.kind == "hf" and spec.tp_target is model


def test_encoder_tp_on_a_model_without_an_encoder_is_refused_by_name():
    cfg = load_config({"model": {"preset": "debug_vlm"}})
    vlm = dataclasses.replace(cfg.vlm, encoder_tp=True)
    with pytest.raises(ForgeConfigError, match="encoder_tp=True but Transformer has no encoder"):
        model_spec(build_meta_model(ModelConfig.preset("debug")), None, vlm=vlm)

"""A forge_vlm VLM built from forge's ``debug_vlm`` config (forge.load_config) on one process:
the encoder, causality across the image, init, freezing, the frozen-sharding rule, the
per-component stage contract, the config sections and their refusals. forge_vlm's modules
alone: packages/forge-vlm/tests/test_model.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from forge import load_config
from forge_core import ForgeConfigError
from forge_core.stages import check_stage
from forge_core.testing import train_steps
from forge_fsdp_wrap import apply_ac, frozen_bytes_rule
from forge_vlm import (
    AdapterConfig,
    VisionEncoder,
    VisionEncoderConfig,
    VLMConfig,
    build_vlm,
    check_vlm,
)

from tests.integration.vlm.jobs import vlm_data

CFG = load_config({"model": {"preset": "debug_vlm"}})


def _vlm(**vlm_overrides):
    vlm = dataclasses.replace(CFG.vlm, **vlm_overrides)
    model = build_vlm(CFG.model, CFG.vision, CFG.adapter, vlm)
    model.init_weights(0)
    return model


def _batch(model, steps=1, batch=2, seq=24):
    return vlm_data(model, steps, CFG, batch=batch, seq_len=seq)


def test_encoder_gives_patch_features_and_refuses_wrong_images():
    enc = VisionEncoder(CFG.vision)
    enc.init_weights(0)
    assert enc(torch.randn(2, 3, 16, 16)).shape == (2, 16, 32)
    with pytest.raises(ForgeConfigError, match=r"\[batch, 3, 16, 16\]"):
        enc(torch.randn(2, 3, 32, 32))


def test_image_affects_only_positions_from_its_first_placeholder_on():
    model = _vlm()
    tokens, images = _batch(model, seq=32)
    tokens = tokens[0, :, :-1]
    first = int((tokens[0] == model.image_token_id).nonzero()[0])
    a = model(tokens, images[0])
    b = model(tokens, images[0] + 1.0)
    torch.testing.assert_close(a[0, :first], b[0, :first], rtol=0, atol=0)  # causal decoder
    assert not torch.allclose(a[0, first:], b[0, first:])


def test_vlm_refuses_short_sequences_and_mismatched_batches():
    model = _vlm()
    with pytest.raises(ForgeConfigError, match="cannot hold the 16 image tokens"):
        model(torch.zeros(2, 8, dtype=torch.long), torch.randn(2, 3, 16, 16))
    with pytest.raises(ForgeConfigError, match="one image per sequence"):
        model(torch.zeros(2, 20, dtype=torch.long), torch.randn(3, 3, 16, 16))


def test_meta_build_then_init_equals_a_direct_build():
    direct = _vlm()
    with torch.device("meta"):
        meta = build_vlm(CFG.model, CFG.vision, CFG.adapter, CFG.vlm)
    meta.to_empty(device="cpu")
    meta.init_weights(0)
    for (name, a), b in zip(direct.state_dict().items(), meta.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_frozen_encoder_gets_no_gradient_no_optimizer_update_and_the_rest_trains():
    model = _vlm(freeze_encoder=True)
    assert model.encoder_frozen
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens, images = _batch(model, steps=2, batch=4)
    train_steps(model, tokens, images=images, ignore_token=model.image_token_id)
    for name, p in model.named_parameters():
        changed = not torch.equal(before[name], p)
        assert changed != name.startswith("encoder."), name
        assert p.grad is None


def test_frozen_sharding_rule_compares_replicated_bytes_with_a_ranks_trainable_share():
    model = _vlm(freeze_encoder=True)
    frozen, budget = frozen_bytes_rule(model, model.encoder, dp_size=4)
    enc = sum(p.numel() for p in model.encoder.parameters())
    trainable = sum(p.numel() for p in model.parameters()) - enc
    assert frozen == 4 * enc and budget == 16 * trainable / 4
    assert frozen <= budget  # debug: kept replicated on 4 ranks
    assert frozen_bytes_rule(model, model.encoder, dp_size=1024)[1] < frozen  # sharded there


def test_stage_order_holds_per_component():
    model = _vlm()
    apply_ac(model, "full", components=("decoder",))
    with pytest.raises(ForgeConfigError, match="cannot apply 'tp' after"):
        check_stage(model.decoder, "tp")
    with pytest.raises(ForgeConfigError, match="did you mean 'decoder'"):
        apply_ac(_vlm(), "full", components=("decodr",))


def test_config_sections_fill_from_the_preset_and_round_trip():
    cfg = load_config({"model": {"preset": "debug_vlm"}}, ["vision.n_layers=3", "adapter.pool=2"])
    assert cfg.is_vlm and cfg.vision.n_layers == 3 and cfg.adapter.pool == 2
    assert load_config(dataclasses.asdict(cfg)) == cfg
    plain = load_config({"model": {"preset": "debug"}})
    assert not plain.is_vlm and load_config(dataclasses.asdict(plain)) == plain
    with pytest.raises(ForgeConfigError, match="did you mean 'freeze_encoder'"):
        load_config({"model": {"preset": "debug_vlm"}, "vlm": {"freeze_encodr": True}})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {
                "vision": VisionEncoderConfig(image_size=16, patch_size=8),
                "adapter": AdapterConfig(pool=4),
            },
            "adapter.pool=4 does not divide the 2 x 2 patch grid",
        ),
        ({"vlm": VLMConfig(image_token_id=256)}, "outside the decoder's vocabulary"),
        ({"adapter": AdapterConfig(out_dim=48)}, "adapter.out_dim=48 differs"),
    ],
)
def test_check_vlm_refuses_inconsistent_parts(change, message):
    parts = {"vision": CFG.vision, "adapter": CFG.adapter, "vlm": CFG.vlm} | change
    with pytest.raises(ForgeConfigError, match=message):
        check_vlm(CFG.model, parts["vision"], parts["adapter"], parts["vlm"])


def test_config_refusals_name_the_field():
    with pytest.raises(
        ForgeConfigError, match="vision.image_size=20 is not divisible by vision.patch_size=8"
    ):
        VisionEncoderConfig(image_size=20, patch_size=8)
    with pytest.raises(ForgeConfigError, match="each image becomes 16 tokens"):
        check_vlm(CFG.model, CFG.vision, CFG.adapter, CFG.vlm, seq_len=12)
    with pytest.raises(ForgeConfigError, match="tp=4 does not divide vision.n_heads=2"):
        check_vlm(
            CFG.model, VisionEncoderConfig(n_heads=2), CFG.adapter, VLMConfig(encoder_tp=True), tp=4
        )
    with pytest.raises(ForgeConfigError, match='use true, false or "auto"'):
        VLMConfig(shard_frozen_encoder="sometimes")


def test_siglip_tower_builds_from_a_config_on_meta_and_initializes_deterministically():
    pytest.importorskip("transformers")
    vision = dataclasses.replace(CFG.vision, backend="siglip")
    models = []
    for _ in range(2):
        with torch.device("meta"):
            m = build_vlm(CFG.model, vision, CFG.adapter, CFG.vlm)
        m.to_empty(device="cpu")
        m.init_weights(3)
        models.append(m)
    ids = models[0].encoder.model.embeddings.position_ids
    assert ids.tolist() == [list(range(16))]
    tokens, images = _batch(models[0])
    a, b = (m(tokens[0, :, :-1], images[0]) for m in models)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert a.isfinite().all()

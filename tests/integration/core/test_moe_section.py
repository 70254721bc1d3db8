"""``[moe]``: the MoE fields are forge-moe-ep's section, ``[model]`` the dense decoder.

Files and checkpoints written before ``[moe]`` existed kept the MoE fields in ``[model]``: they
load to the same config, with one ``ForgeConfigNotice``.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
from forge.cli import main
from forge.config import ForgeConfig, ForgeConfigNotice, config_to_dict, load_config
from forge_core import ForgeConfigError, ModelConfig
from forge_moe_ep.config import MOE_FIELDS, MOE_PRESETS, MoEConfig, MoEModelConfig

NEW = {"model": {"preset": "debug"}, "moe": {"num_experts": 4, "top_k": 1, "moe_every": 2}}
OLD = {"model": {"preset": "debug", "num_experts": 4, "top_k": 1, "moe_every": 2}}


def _old_dump(cfg: ForgeConfig) -> dict:
    """What forge wrote as a checkpoint's config before ``[moe]``: ``model`` held the joined
    config (every MoE field, ``moe_ffn_dim`` filled in) and there was no ``moe``."""
    dump = config_to_dict(cfg)
    dump["model"] = dataclasses.asdict(cfg.decoder)
    dump.pop("moe")
    return dump


def test_model_is_the_dense_decoder_and_a_dense_job_carries_no_moe_fields():
    cfg = load_config()
    assert type(cfg.model) is ModelConfig and cfg.moe is None
    assert not set(MOE_FIELDS) & set(config_to_dict(cfg)["model"])
    assert cfg.decoder.custom_ffn_layers == () and cfg.routed_experts == 0


def test_a_moe_section_makes_moe_blocks():
    cfg = load_config(NEW)
    assert cfg.moe == MoEConfig(num_experts=4, top_k=1, moe_every=2)
    assert cfg.decoder.moe_layers == (1,) and cfg.routed_experts == 4
    # moe_every left out: every block once there are experts; none without
    assert load_config({"moe": {"num_experts": 2}}).decoder.moe_layers == (0, 1)
    assert load_config({}, ["moe.router_bias=true"]).decoder.moe_layers == ()


def test_an_moe_preset_fills_moe_and_the_section_overrides_it():
    cfg = load_config({"model": {"preset": "debug_moe"}, "moe": {"num_experts": 4}})
    assert cfg.model == ModelConfig.preset("debug")
    assert cfg.decoder == dataclasses.replace(MOE_PRESETS["debug_moe"], num_experts=4)


@pytest.mark.parametrize("where", ["file", "override"])
def test_moe_fields_in_model_are_translated_with_one_notice(tmp_path: Path, where: str):
    path = tmp_path / "old.toml"
    path.write_text('[model]\npreset = "debug"\nnum_experts = 4\ntop_k = 1\nmoe_every = 2\n')
    sets = [f"model.{k}={v}" for k, v in OLD["model"].items() if k != "preset"]
    with pytest.warns(ForgeConfigNotice) as notices:
        cfg = load_config(path) if where == "file" else load_config({}, sets)
    assert cfg == load_config(NEW)
    (notice,) = notices
    message = str(notice.message)
    assert "\n" not in message
    assert "moe_every, num_experts, top_k" in message and "[moe]" in message


def test_old_moe_fields_override_an_moe_presets_as_they_did():
    with pytest.warns(ForgeConfigNotice):
        old = load_config(None, ["model.preset=debug_moe", "model.top_k=1"])
    new = load_config(None, ["model.preset=debug_moe", "moe.top_k=1"])
    assert old == new and old.decoder.top_k == 1 and old.decoder.moe_layers == (0, 1)
    # over a dense preset, an old [model] without moe_every was a dense model
    with pytest.warns(ForgeConfigNotice):
        dense = load_config({"model": {"num_experts": 4}})
    assert dense.moe is None and dense.decoder.moe_layers == ()


def test_an_old_checkpoints_config_loads_to_the_same_config():
    for new in (load_config(NEW), load_config({"model": {"preset": "debug_moe"}}), load_config()):
        with pytest.warns(ForgeConfigNotice, match=r"and \d+ more"):
            old = load_config(_old_dump(new))
        # the same model (an old dump has moe_ffn_dim filled in) and every other section equal
        assert old.decoder == new.decoder and (old.moe is None) == (new.moe is None)
        assert dataclasses.replace(old, moe=new.moe) == new


def test_a_field_set_in_both_sections_is_refused():
    with pytest.raises(ForgeConfigError, match=r"model.top_k and moe.top_k are both set"):
        load_config({"model": {"top_k": 1}, "moe": {"top_k": 2, "num_experts": 4}})


def test_an_old_dense_models_bad_moe_value_is_still_refused():
    refused = pytest.raises(ForgeConfigError, match=r"^moe\.router='topk' is invalid")
    with refused, pytest.warns(ForgeConfigNotice):
        load_config({"model": {"router": "topk"}})


def test_a_field_model_refuses_moe():
    with pytest.raises(ForgeConfigError, match=r"field model .* remove the \[moe\] section"):
        load_config({"model": {"preset": "debug_field"}, "moe": {"num_experts": 2}})


def test_the_python_apis_joined_config_is_split():
    joined = MOE_PRESETS["debug_moe"]
    assert isinstance(joined, MoEModelConfig)
    cfg = ForgeConfig(model=joined)
    assert type(cfg.model) is ModelConfig and cfg.moe is not None and cfg.decoder == joined
    assert ForgeConfig(model=MoEModelConfig.preset("debug")).moe is None
    with pytest.raises(ForgeConfigError, match="MoE fields twice"):
        ForgeConfig(model=joined, moe=MoEConfig(num_experts=2))


def test_the_cli_prints_the_notice_as_one_line(tmp_path: Path, capsys):
    path = tmp_path / "old.toml"
    path.write_text('[model]\npreset = "debug"\nnum_experts = 4\n[parallelism]\ndp_shard = 2\n')
    with warnings.catch_warnings():
        warnings.simplefilter("default", ForgeConfigNotice)
        assert main(["plan", str(path), "--world-size", "2"]) == 0
    err = capsys.readouterr().err.splitlines()
    notices = [line for line in err if "notice" in line]
    assert notices == [
        "forge: notice: [model] holds the MoE fields num_experts: read as [moe] (forge keeps "
        "them there now; move them to [moe] to silence this)"
    ]


def test_resume_reads_an_old_checkpoints_decoder_as_a_new_ones():
    from forge.resume import _saved_decoder

    cfg = load_config(NEW)
    mine = dataclasses.asdict(cfg.decoder)
    assert _saved_decoder(_old_dump(cfg)) == mine == _saved_decoder(config_to_dict(cfg))

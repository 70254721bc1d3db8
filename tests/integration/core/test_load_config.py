"""forge's ``load_config``: every invalid configuration, from a dict, a TOML file or ``--set``
overrides, gets a ForgeConfigError naming the field, the value and the fix (the config classes
of forge_core alone: packages/forge-core/tests/test_core_config.py)."""

from __future__ import annotations

import pytest
from forge import load_config
from forge_core import ForgeConfigError, ModelConfig, ParallelismConfig
from test_core_config import HUGE


def test_credit_style_errors_name_the_credit_key():
    """A CREDIT-style dict hears about 'tensor', the key it wrote, not forge's 'tp'."""
    cfg = ParallelismConfig.from_any({"data": "fsdp2", "tensor": 3})
    with pytest.raises(ForgeConfigError, match=r"not divisible by .*x tensor=3 x") as err:
        cfg.resolve(8)
    assert "tp=" not in str(err.value)
    with pytest.raises(ForgeConfigError, match=r"^parallelism\.tensor=0 is invalid"):
        ParallelismConfig.from_any({"tensor": 0})
    with pytest.raises(ForgeConfigError, match=r"^parallelism\.tensor='2' must be an integer"):
        load_config({"parallelism": {"tensor": "2"}})
    with pytest.raises(ForgeConfigError, match=r"raise tensor/cp/domain"):
        ParallelismConfig.from_any({"data": "none", "tensor": 2}).resolve(4)
    # forge's own names keep forge's words
    with pytest.raises(ForgeConfigError, match=r"x tp=3 x"):
        ParallelismConfig(tp=3).resolve(8)


def test_load_config_from_toml_with_overrides(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(
        '[model]\npreset = "debug"\nn_layers = 3\n\n'
        "[parallelism]\ndp_replicate = 2\n\n"
        '[training]\nsteps = 4\nac_mode = "full"\n'
    )
    cfg = load_config(
        path,
        ["parallelism.tp=2", "training.lr=0.01", "training.compile=true", 'training.ac_mode="op"'],
    )
    assert cfg.model.n_layers == 3 and cfg.model.dim == 64
    assert (cfg.parallelism.dp_replicate, cfg.parallelism.tp) == (2, 2)
    assert (cfg.training.steps, cfg.training.lr, cfg.training.compile, cfg.training.ac_mode) == (
        4,
        0.01,
        True,
        "op",
    )


def test_load_config_defaults_and_dicts():
    assert load_config().model == ModelConfig.preset("debug")
    assert load_config({"parallelism": {"tensor": 2}}).parallelism.tp == 2


@pytest.mark.parametrize(
    ("source", "overrides", "pattern"),
    [
        ({"modle": {}}, (), r"unknown config section 'modle' \(did you mean 'model'\?\)"),
        ({"training": {"step": 3}}, (), r"unknown key 'training\.step' \(did you mean 'steps'\?\)"),
        ({"model": {"dimm": 3}}, (), r"unknown key 'model\.dimm' \(did you mean 'dim'\?\)"),
        ({}, ["parallelism.tp"], r"must look like section\.key=value"),
        ({}, ["tp=2"], r"must look like section\.key=value"),
        (
            {},
            ["parallelsim.tp=2"],
            r"unknown section 'parallelsim' \(did you mean 'parallelism'\?\)",
        ),
        ({}, ["training.steps=0"], r"training\.steps=0 must be a positive integer"),
        (
            {},
            ["training.param_dtype=fp8"],
            r"training\.param_dtype='fp8': choose float32, bfloat16 or float16",
        ),
        ({"training": 3}, (), r"config section 'training' must be a table"),
    ],
)
def test_load_config_errors(source, overrides, pattern):
    with pytest.raises(ForgeConfigError, match=pattern):
        load_config(source, overrides)


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ForgeConfigError, match=r"does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ForgeConfigError, match=r"is not valid TOML"):
        load_config(bad)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["training.lr=inf"], r"^training\.lr=inf must be a finite number > 0$"),
        (["training.lr=nan"], r"^training\.lr=nan must be a finite number > 0$"),
        (["training.lr=1e39"], r"^training\.lr=1e\+39 must be a finite number > 0: .*float32"),
        (["training.min_lr_ratio=nan"], r"^training\.min_lr_ratio=nan must be .* in \[0, 1\]"),
        (["training.weight_decay=inf"], r"^training\.weight_decay=inf must be a finite number"),
        (["training.max_grad_norm=-inf"], r"^training\.max_grad_norm=-inf must be a finite"),
        (
            ["training.lr=0.5", "training.weight_decay=3.0"],
            r"^training\.weight_decay=3\.0 with training\.lr=0\.5: .* 1 - lr x weight_decay",
        ),
        (["model.norm_eps=-1"], r"^model\.norm_eps=-1 must be a finite number in \(0, 1\)"),
        (["model.norm_eps=0"], r"^model\.norm_eps=0 must be a finite number in \(0, 1\)"),
        (["model.rope_theta=0"], r"^model\.rope_theta=0 must be a finite number > 1"),
        (["model.rope_theta=nan"], r"^model\.rope_theta=nan must be a finite number > 1"),
        (["model.ffn_dim=0"], r"^model\.ffn_dim=0 must be a positive integer$"),
        (["model.ffn_dim=-64"], r"^model\.ffn_dim=-64 must be a positive integer$"),
        ([f"model.dim={HUGE}"], rf"^model\.dim={HUGE} is too large: it must be at most 2147483647"),
        ([f"model.vocab_size={HUGE}"], rf"^model\.vocab_size={HUGE} is too large"),
        (["model.n_layers=100000"], r"^model\.n_layers=100000 is too large: .* 65536 \(2\*\*16"),
        (
            ["model.dim=16777216", "model.n_heads=4", "model.n_kv_heads=4"],
            r"^model has \d\.\d+e\+15 parameters \(vocab_size=256, dim=16777216, n_layers=2, "
            r"ffn_dim=128\), more than 2\*\*50",
        ),
        (
            ["model.max_seq_len=1000000000"],
            r"^model\.max_seq_len=1000000000 x head dim 16 = 16000000000 rotary-table entries",
        ),
        (
            [f"training.global_batch_size={HUGE}"],
            rf"^training\.global_batch_size={HUGE} is too large",
        ),
        (
            ["training.global_batch_size=100000000"],
            r"^training\.global_batch_size=100000000 x \(training\.seq_len \+ 1\) = 3300000000 "
            r"tokens per step, more than 2\*\*31 - 1",
        ),
        ([f"training.steps={HUGE}"], rf"^training\.steps={HUGE} is too large"),
        (
            ["training.seed=18446744073709551616"],
            r"^training\.seed=18446744073709551616 is too large: it must be at most 4294967295",
        ),
        (["training.seed=-1"], r"^training\.seed=-1 must be an integer >= 0$"),
        ([f"checkpoint.every={HUGE}"], rf"^checkpoint\.every={HUGE} is too large"),
        ([f"pp.microbatches={HUGE}"], rf"^pp\.microbatches={HUGE} is too large"),
        ([f"parallelism.tp={HUGE}"], rf"^parallelism\.tp={HUGE} is too large: .* 1048576"),
        (
            ["model.preset=debug_vlm", "vision.norm_eps=nan"],
            r"^vision\.norm_eps=nan must be a finite number in \(0, 1\)",
        ),
        (
            ["model.preset=debug_vlm", "vision.dim=1048576", "vision.n_layers=1024"],
            r"^the vision encoder has \d\.\d+e\+15 parameters \(dim=1048576",
        ),
        (["model.preset=debug_vlm", f"vlm.image_token_id={HUGE}"], r"^vlm\.image_token_id="),
        (
            ["model.preset=debug_field", "field.height=1000000", "field.width=1000000"],
            r"^field\.height=1000000 x field\.width=1000000 x 16 channels",
        ),
    ],
)
def test_numbers_are_finite_and_in_a_range_the_code_can_use(overrides, pattern):
    """Each refusal is one line naming the field (nan, inf and 2**40 were accepted and failed
    on the ranks, or silently trained to NaN)."""
    with pytest.raises(ForgeConfigError, match=pattern) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def test_each_layer_owns_its_model_presets():
    """forge_core's presets are reference decoders only; forge composes the layers' own."""
    from forge_core import PRESETS

    assert {"debug_vlm", "debug_field", "debug_moe"}.isdisjoint(PRESETS)
    vlm = load_config({"model": {"preset": "debug_vlm"}})
    assert vlm.is_vlm and vlm.model == ModelConfig.preset("debug") and vlm.moe is None
    field = load_config(None, ["model.preset=debug_field"])
    assert field.field is not None and field.parallelism.domain == 2
    with pytest.raises(ForgeConfigError) as err:
        load_config({"model": {"preset": "debug_vml"}})
    message = str(err.value)
    assert "unknown model preset 'debug_vml' (did you mean 'debug_vlm'?)" in message
    assert all(name in message for name in ("debug_moe", "debug_field", "llama3_8b"))

"""The MoE families that joined forge by an entry of ``forge_moe_ep.hf.HF_MOE_BLOCKS`` alone
(the correction bias on the block, the router's weight one module deeper, its scale under
another name, a float32 router): converted, they give the Hugging Face logits; restored, the
Hugging Face state dict; and read back from the files ``save_pretrained`` writes through
``forge_moe_ep.hf_sources``, exactly the tensors the conversion makes. Their training parity
under EP=2 x FSDP2 is the zoo's (tests/zoo/test_hf_zoo.py). Tiny configs from the zoo's
``tiny_config``; random weights, nothing downloaded."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402 - after the skip
from forge_moe_ep.hf import HF_MOE_BLOCKS, HFMoE, convert_hf_moe, restore_hf_moe  # noqa: E402
from forge_moe_ep.hf_sources import hf_checkpoint_sources  # noqa: E402
from test_hf_moe_sources import _assemble  # noqa: E402

from tests.zoo import hf_zoo  # noqa: E402

pytestmark = pytest.mark.zoo

#: model type -> its MoE block class (each an entry of HF_MOE_BLOCKS)
TABLE_FAMILIES = {
    "lfm2_moe": "Lfm2MoeSparseMoeBlock",
    "minimax_m2": "MiniMaxM2SparseMoeBlock",
    "afmoe": "AfmoeSparseMoeBlock",
    "hy_v3": "HYV3MoE",
    "hunyuan_v1_moe": "HunYuanMoEV1Moe",
    "beam": "BeamMoE",
    "laguna": "LagunaSparseMoeBlock",
    "hy_v4": "HYV4MoE",
    "minimax_m3_vl_text": "MiniMaxM3VLSparseMoeBlock",
    "axk2": "AXK2MoE",
    "axk1": "AXK1MoE",
    "kolibri1": "Kolibri1SparseMoeBlock",
    "ernie4_5_moe": "Ernie4_5_MoeSparseMoeBlock",
    "aria_text": "AriaTextMoELayer",
    "inkling2_text": "Inkling2SparseMoeBlock",
    "nemotron_h": "NemotronHMoE",
    "deepseek_v4": "DeepseekV4SparseMoeBlock",
    "muse_spark_text": "MuseSparkMoE",
}
#: config fields holding the routed output's scale, set to 1.7 where a config has one (so a
#: scale read from the wrong place changes the logits)
SCALES = (
    "routed_scaling_factor",
    "moe_routed_scaling_factor",
    "route_scale",
    "router_scaling_factor",
)


#: families whose files transformers writes under other names than the modules' (HY-V3:
#: ``gate.weight`` -> ``router.gate.weight``, ``e_score_correction_bias`` -> ``expert_bias``,
#: ``shared_experts`` -> ``shared_mlp``; HY-V4 likewise; Laguna: ``shared_experts`` ->
#: ``shared_expert``, the correction bias elsewhere): trainable from their config, not read
#: from a directory
RENAMED_ON_SAVE = {"hy_v3", "hy_v4", "laguna"}
# transformers 5.23 likewise renames these on save: A.X-K1 keeps post_mlp_layernorm on the
# decoder layer, Kolibri and ERNIE 4.5 their correction bias elsewhere, Inkling 2 and
# DeepSeek-V4 most tensors, Nemotron-H its whole prefix (backbone.)
RENAMED_ON_SAVE |= {"axk1", "kolibri1", "ernie4_5_moe", "inkling2_text", "nemotron_h"}
RENAMED_ON_SAVE |= {"deepseek_v4", "aria_text"}  # Aria: experts.fc1 / fc2
#: families whose block an older transformers lays out otherwise -> the first version forge
#: converts: transformers 5.17 keeps Aria's experts as two grouped-GEMM modules (fc1, fc2), which
#: forge refuses by name (the zoo expects that refusal there)
FUSED_SINCE = {"aria_text": "5.23"}
#: families without a choice correction bias (DeepSeek-V4's hash-routed layers have none either)
NO_CORRECTION = {"hunyuan_v1_moe", "aria_text"}


def _model(model_type: str, **overrides: object) -> torch.nn.Module:
    """The zoo's tiny model, every zero-initialised tensor (routers, correction biases) random."""
    import transformers as tf

    from tests.zoo.hf_zoo import _randomize_zeros

    config = hf_zoo.tiny_config(model_type, moe=True)
    for name, value in overrides.items():
        setattr(config, name, value)
    if hasattr(config, "use_expert_bias"):
        config.use_expert_bias = True  # Lfm2-MoE: the block's correction bias, read and stored
    for name in SCALES:
        if name in config.to_dict():
            setattr(config, name, 1.7)
    if "swiglu_limit" in config.to_dict():
        config.swiglu_limit = 0.05  # the experts' clamps bite (their inputs exceed it)
    if "swiglu_alpha" in config.to_dict():
        config.swiglu_alpha = 1.3  # not GPT-OSS's default 1.702: read from the experts
    torch.manual_seed(0)
    causal = type(config) in tf.AutoModelForCausalLM._model_mapping
    auto = tf.AutoModelForCausalLM if causal else tf.AutoModel  # MuseSpark's text model: base
    model = auto.from_config(config).float()
    _randomize_zeros(model)
    return model.train()


def _skip_where_missing(model_type: str) -> None:
    """Skip a family the installed transformers lacks, or lays out as forge does not convert."""
    import transformers as tf
    from packaging.version import Version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:  # an older transformers (the GPU image's 5.17)
        pytest.skip(f"transformers {tf.__version__} has no {model_type}")
    since = FUSED_SINCE.get(model_type)
    if since and Version(tf.__version__) < Version(since):
        pytest.skip(f"transformers {tf.__version__} lays {model_type}'s experts out otherwise")


def _out(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's logits, or a base model's last hidden states."""
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("model_type", list(TABLE_FAMILIES))
def test_table_family_converts_restores_and_reads_back(model_type, tmp_path):
    from safetensors.torch import load_file

    _skip_where_missing(model_type)
    assert TABLE_FAMILIES[model_type] in HF_MOE_BLOCKS
    model = _model(model_type)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator())
    expected = _out(model, tokens)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path)
    converted = convert_hf_moe(model)
    assert converted and all(isinstance(model.get_submodule(n), HFMoE) for n in converted)
    torch.testing.assert_close(_out(model, tokens), expected, rtol=1e-5, atol=1e-5)
    moes = [m for m in model.modules() if isinstance(m, HFMoE)]
    if model_type not in NO_CORRECTION:  # a choice correction bias, read from where it lives
        assert all(m.router.expert_bias.abs().sum() > 0 for m in moes if m.expert_table is None)

    stored = load_file(tmp_path / "model.safetensors")
    sources = hf_checkpoint_sources(model, {n: tuple(t.shape) for n, t in stored.items()})
    if model_type in RENAMED_ON_SAVE:
        # forge reads tensors by their in-memory names: these files are refused before launch
        # (forge_checkpoint.hf_weight_problems names the missing tensors), not read wrongly
        missing = [n for s in sources.values() for n in s.stored if n not in stored]
        assert missing, "the files now keep the in-memory names: drop it from RENAMED_ON_SAVE"
        sources = {}
        stored = {}
    for target, value in model.state_dict().items():
        source = sources.get(target)
        if source is None:
            if target in stored:
                assert torch.equal(stored[target], value), target
        elif source.constant is None:
            assert torch.equal(_assemble(source, stored), value), target

    assert restore_hf_moe(model) == converted
    restored = model.state_dict()
    assert restored.keys() == original.keys()
    assert all(torch.equal(restored[k], v) for k, v in original.items())
    reloaded = type(model).from_pretrained(tmp_path).float().train()
    torch.testing.assert_close(_out(reloaded, tokens), expected, rtol=1e-5, atol=1e-5)


def test_router_logit_soft_capping_is_refused_by_name():
    import transformers as tf
    from forge_core import ForgeConfigError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "laguna" not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {tf.__version__} has no laguna")
    config = hf_zoo.tiny_config("laguna", moe=True)
    config.moe_router_logit_softcapping = 30.0
    model = tf.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ForgeConfigError, match="router logit soft-capping"):
        convert_hf_moe(model)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # the default: softmax of the top-k logits, no shared experts
        {
            "expert_selection_fn": "sigmoid",
            "norm_topk_prob": True,
            "num_shared_experts": 1,
            "shared_expert_combination_strategy": "sum",
        },
        {"expert_selection_fn": "sigmoid", "norm_topk_prob": False},
    ],
    ids=["softmax", "sigmoid-renormalised-shared", "sigmoid"],
)
def test_cohere2_moe_routes_as_its_config_says(overrides):
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "cohere2_moe" not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {tf.__version__} has no cohere2_moe")
    model = _model("cohere2_moe", **overrides)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator())
    expected = model(tokens).logits
    assert convert_hf_moe(model)
    torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-5)


def test_cohere2_moe_averaging_its_shared_expert_is_refused():
    import transformers as tf
    from forge_core import ForgeConfigError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "cohere2_moe" not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {tf.__version__} has no cohere2_moe")
    model = _model(
        "cohere2_moe", num_shared_experts=1, shared_expert_combination_strategy="average"
    )
    with pytest.raises(ForgeConfigError, match="shared_expert_combination_strategy='average'"):
        convert_hf_moe(model)


@pytest.mark.parametrize(
    ("model_type", "overrides", "mutation"),
    [
        ("axk2", {"n_group": 2, "topk_group": 1}, {"group_mask": "exclude"}),
        ("axk1", {}, {"post_norm": None}),
        ("kolibri1", {}, {"choice": "scores"}),
        ("ernie4_5_moe", {}, {"correction": None}),
        ("aria_text", {}, {"weights_on_input": None}),
        ("inkling2_text", {"mlp_gate_softcap": 0.3, "mlp_up_softcap": 0.05}, {"up_limit": None}),
        ("deepseek_v4", {}, {"hash_table": None}),
        ("nemotron_h", {"moe_latent_size": 8}, None),
        ("muse_spark_text", {"output_multiplier": 2.5}, {"logit_scale": None}),
        ("muse_spark_text", {}, {"expert_norm": None}),
    ],
    ids=[
        "axk2-groups",
        "axk1",
        "kolibri1",
        "ernie",
        "aria",
        "inkling2",
        "deepseek_v4",
        "nemotron",
        "muse-spark-logit-scale",
        "muse-spark-expert-norm",
    ],
)
def test_each_variant_is_what_makes_its_family_equal(model_type, overrides, mutation, monkeypatch):
    """Each new entry's logits equal the Hugging Face model's, and the entry without its
    variant (the mutation) gives other logits: the check sees the variant. Then restored, the
    Hugging Face state dict again. A.X-K2 with groups, its correction biases large enough that
    a kept expert's biased score can be negative (where its 0.0 mask differs from -inf);
    Nemotron-H with latent projections."""
    import dataclasses

    _skip_where_missing(model_type)

    def built() -> torch.nn.Module:
        model = _model(model_type, **overrides)
        if model_type == "axk2":  # group 0 is kept; its experts 1-3 lose to group 1's zeros
            with torch.no_grad():
                for name, t in model.named_buffers():
                    if name.endswith("e_score_correction_bias"):
                        t.copy_(torch.tensor([0.5, -3.0, -3.0, -3.0, -5.0, -5.0, -5.0, -5.0]))
        return model

    model = built()
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator())
    expected = _out(model, tokens)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    assert convert_hf_moe(model)
    torch.testing.assert_close(_out(model, tokens), expected, rtol=1e-5, atol=1e-5)
    restore_hf_moe(model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in original.items())
    if mutation is None:
        return
    block = TABLE_FAMILIES[model_type]
    monkeypatch.setitem(HF_MOE_BLOCKS, block, dataclasses.replace(HF_MOE_BLOCKS[block], **mutation))
    mutated = built()
    assert convert_hf_moe(mutated)
    assert not torch.allclose(_out(mutated, tokens), expected, rtol=1e-5, atol=1e-5)

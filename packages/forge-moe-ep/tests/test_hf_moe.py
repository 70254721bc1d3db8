"""Hugging Face MoE families converted to forge's MoE (forge_moe_ep.hf): equal logits and the way
back to a Hugging Face checkpoint (tiny configs, random weights). Their training parity through
forge's ParallelPlan: tests/integration/moe_ep/test_hf_moe_training.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from forge_core import ForgeConfigError
from forge_core.testing.hf import TINY_HF_DECODER
from forge_moe_ep import MoEModelConfig
from forge_moe_ep.hf import HFMoE, convert_hf_moe, restore_hf_moe

FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "olmoe",
    "glm4_moe",
    "llama4",
)
VOCAB = TINY_HF_DECODER["vocab_size"]
_COMMON = TINY_HF_DECODER


def _config(name: str):  # noqa: ANN202 - a transformers config
    import transformers as tf

    c, experts = _COMMON, {"num_experts_per_tok": 2}
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **c, **experts, head_dim=8, num_experts=8, moe_intermediate_size=16, norm_topk_prob=True
        )
    if name == "qwen2_moe":  # gated shared expert, no renormalisation
        return tf.Qwen2MoeConfig(
            **c,
            **experts,
            num_experts=8,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        )
    if name == "mixtral":
        return tf.MixtralConfig(**c, **experts, num_local_experts=8)
    if name == "olmoe":
        return tf.OlmoeConfig(**c, **experts, num_experts=8, eos_token_id=VOCAB - 1)
    if name in ("deepseek_v2", "deepseek_v3"):
        # MLA attention, a dense first block, routing limited to the best 2 of 4 groups: V2
        # softmax (a group scores its best expert), V3 sigmoid with correction bias (best two)
        config = tf.DeepseekV2Config if name == "deepseek_v2" else tf.DeepseekV3Config
        v2 = {"topk_method": "group_limited_greedy"} if name == "deepseek_v2" else {}
        return config(
            **{**c, "num_key_value_heads": 4},
            **experts,
            **v2,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            routed_scaling_factor=2.5,
        )
    if name == "glm4_moe":
        return tf.Glm4MoeConfig(
            **c,
            **experts,
            head_dim=8,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
        )
    if name == "gpt_oss":  # router bias, expert biases, clamped SwiGLU, interleaved gate/up
        return tf.GptOssConfig(**c, **experts, head_dim=8, num_local_experts=8, sliding_window=4)
    assert name == "llama4"  # top-1 sigmoid weights applied to the experts' input
    return tf.Llama4TextConfig(
        **c,
        head_dim=8,
        intermediate_size_mlp=64,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
    )


def build_hf_moe(name: str) -> nn.Module:
    """A tiny fp32 Hugging Face MoE model; the weights transformers initialises to zero (routers,
    biases, correction biases) get random values so that routing and biases matter."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(name)).float()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and ("bias" in n or not t.abs().sum()):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return model.train()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", FAMILIES)
def test_converted_blocks_give_the_hf_logits_and_export_back(name, tmp_path):
    import transformers as tf

    model = build_hf_moe(name)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    expected = model(_tokens()).logits
    converted = convert_hf_moe(model)
    assert converted and all(isinstance(model.get_submodule(n), HFMoE) for n in converted)
    torch.testing.assert_close(model(_tokens()).logits, expected, rtol=1e-5, atol=1e-5)
    # The experts do the work: zeroing their output weights changes the logits.
    saved = [m.experts.w2.detach().clone() for m in model.modules() if isinstance(m, HFMoE)]
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, HFMoE):
                m.experts.w2.zero_()
    assert not torch.allclose(model(_tokens()).logits, expected, atol=1e-4)
    with torch.no_grad():
        for m, w2 in zip([m for m in model.modules() if isinstance(m, HFMoE)], saved, strict=True):
            m.experts.w2.copy_(w2)

    assert restore_hf_moe(model) == converted
    restored = model.state_dict()
    assert restored.keys() == original.keys()
    for k, v in original.items():
        assert torch.equal(restored[k], v), k
    model.save_pretrained(tmp_path)
    reloaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path).float().train()
    torch.testing.assert_close(reloaded(_tokens()).logits, expected, rtol=1e-5, atol=1e-5)


def test_configs_the_converted_blocks_cannot_honour_are_refused():
    import transformers as tf

    config = _config("mixtral")
    config.output_router_logits = True
    with pytest.raises(ForgeConfigError, match="output_router_logits=True"):
        convert_hf_moe(tf.MixtralForCausalLM(config))
    config = _config("mixtral")
    config.router_jitter_noise = 0.1
    with pytest.raises(ForgeConfigError, match="router_jitter_noise=0.1"):
        convert_hf_moe(tf.MixtralForCausalLM(config))


def test_group_limited_routing_is_validated():
    base = {"dim": 32, "n_layers": 1, "n_heads": 4, "vocab_size": 64, "moe_every": 1}
    with pytest.raises(ForgeConfigError, match="router_groups=3"):
        MoEModelConfig(**base, num_experts=8, router_groups=3)
    with pytest.raises(ForgeConfigError, match="raise router_topk_groups"):
        MoEModelConfig(**base, num_experts=8, top_k=3, router_groups=4, router_topk_groups=1)
    with pytest.raises(ForgeConfigError, match="expert_act"):
        MoEModelConfig(**base, num_experts=8, expert_act="relu")

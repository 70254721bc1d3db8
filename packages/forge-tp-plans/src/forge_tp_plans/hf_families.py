"""forge's own tensor-parallel plans for Hugging Face families that ship none.

Keyed by the model's class name (no transformers import), in transformers' style names, with
the same module paths transformers' models use. Only the decoder blocks are split (attention
projections column then row, MLP in then out); embeddings and the head stay replicated, which
keeps tied weights tied. Each entry is proven at TP=2 against the unsharded model, logits and
every gradient (``tests/tp_plans/test_hf_models.py``). OPT is not here yet: the same kind of
plan gave logits off the unsharded model's, for a reason not found yet. Families whose attention fuses q, k and v in one
projection (GPT-2, GPT-BigCode, Falcon, Bloom) are not here: splitting a fused projection
column-wise would mix heads of q, k and v; they need a fused-weight style.
"""

from __future__ import annotations

__all__ = ["FAMILY_HEAD_COUNTS", "FAMILY_PLANS", "FAMILY_SOURCE"]

#: The plan source ``describe_tp_plan`` reports for these plans.
FAMILY_SOURCE = "forge (Hugging Face family)"

_ATTENTION = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise"}


def _prefixed(prefix: str, styles: dict[str, str]) -> dict[str, str]:
    return {f"{prefix}.{name}": style for name, style in styles.items()}


FAMILY_PLANS: dict[str, dict[str, str]] = {
    "StableLmForCausalLM": {
        **_prefixed("model.layers.*.self_attn", {**_ATTENTION, "o_proj": "rowwise"}),
        **_prefixed(
            "model.layers.*.mlp",
            {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"},
        ),
    },
    "GPTJForCausalLM": {
        **_prefixed("transformer.h.*.attn", {**_ATTENTION, "out_proj": "rowwise"}),
        **_prefixed("transformer.h.*.mlp", {"fc_in": "colwise", "fc_out": "rowwise"}),
    },
}


#: Attention attributes these families read in forward to reshape into heads (a fixed count,
#: not ``-1``): after the split each tp rank holds ``1/tp`` of the heads, so
#: ``apply_tensor_parallel`` divides them by tp on the modules the pattern names.
FAMILY_HEAD_COUNTS: dict[str, dict[str, tuple[str, ...]]] = {
    "StableLmForCausalLM": {"model.layers.*.self_attn": ("num_heads", "num_key_value_heads")},
    "GPTJForCausalLM": {"transformer.h.*.attn": ("num_attention_heads",)},
}

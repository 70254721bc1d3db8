"""forge's plans for classic Hugging Face families that ship no _tp_plan (OPT, GPT-2, GPT-BigCode,
Falcon, Bloom; forge_tp_plans.hf_families): at TP=2 the logits and every gradient match the
unsharded model, for each config variant whose attention is laid out differently (multi-query,
Falcon's architectures, ALiBi), under SDPA and eager attention; every parameter keeps its name
and its unsharded value. Tiny configs, random weights, nothing downloaded."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from forge_core.errors import ForgeConfigError
from forge_mesh import build_device_mesh
from forge_tp_plans import applied_tp_plan, apply_tensor_parallel
from forge_tp_plans.fused_styles import SplitAttentionHeads
from forge_tp_plans.hf_families import FAMILY_PLANS, FAMILY_SOURCE
from forge_tp_plans.row_segments import exchange, needed
from torch.distributed.tensor import DTensor, Replicate

#: What this module's rank functions import inside the function: the rank workers' forkserver
#: imports it once (forge_core.testing.pytest_ranks).
RANK_PRELOAD = ["transformers"]

# NOTE: the Hugging Face lane (marker zoo, with tests/zoo), not the README suite (its time).
pytestmark = pytest.mark.zoo

VOCAB = 64
_GPT = {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
_GPT_NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
_FALCON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}

#: family -> its config variants (the attention layouts the plan must handle)
VARIANTS = {
    "opt": ["opt"],
    "gpt2": ["gpt2"],
    "gpt_bigcode": ["gpt_bigcode_multi_head"],
    "falcon": ["falcon_new_arch", "falcon_new_arch_one_kv", "falcon_multi_query", "falcon_alibi"],
    "bloom": ["bloom"],
}


def _build(name: str, attention: str) -> nn.Module:
    import transformers as tf

    configs = {
        "opt": lambda: tf.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            word_embed_proj_dim=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
        ),
        "gpt2": lambda: tf.GPT2Config(**_GPT, **_GPT_NO_DROPOUT),
        "gpt_bigcode_multi_query": lambda: tf.GPTBigCodeConfig(
            **_GPT, **_GPT_NO_DROPOUT, multi_query=True
        ),
        "gpt_bigcode_multi_head": lambda: tf.GPTBigCodeConfig(
            **_GPT, **_GPT_NO_DROPOUT, multi_query=False
        ),
        # Falcon-40B/180B: fused rows by kv group
        "falcon_new_arch": lambda: tf.FalconConfig(
            **_FALCON, new_decoder_architecture=True, num_kv_heads=2, bias=True
        ),
        # one kv group: [q; k; v] with a single k/v head
        "falcon_new_arch_one_kv": lambda: tf.FalconConfig(
            **_FALCON, new_decoder_architecture=True, num_kv_heads=1
        ),
        # Falcon-7B: multi-query, parallel attention
        "falcon_multi_query": lambda: tf.FalconConfig(
            **_FALCON, multi_query=True, parallel_attn=True
        ),
        # Falcon-RW: ALiBi, multi-head [heads, 3, head_dim], sequential attention then MLP
        "falcon_alibi": lambda: tf.FalconConfig(
            **_FALCON, alibi=True, multi_query=False, parallel_attn=False, bias=True
        ),
        "bloom": lambda: tf.BloomConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            n_layer=2,
            n_head=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
    }
    model = tf.AutoModelForCausalLM.from_config(configs[name](), attn_implementation=attention)
    torch.manual_seed(0)  # the same weights on every rank
    with torch.no_grad():
        for p in model.parameters():
            # not transformers' init: zero biases and unit norms would hide a misplaced row
            p.normal_(std=0.2)
    return model.float()


def _parity(name: str, attention: str) -> dict:
    reference = _build(name, attention)
    parallel = copy.deepcopy(reference)
    apply_tensor_parallel(parallel, build_device_mesh({"tp": 2, "data": "none"}, "cpu"))
    ref_params = dict(reference.named_parameters())
    par_params = dict(parallel.named_parameters())
    # Names, shapes and unsharded values of every parameter unchanged.
    assert list(par_params) == list(ref_params)
    assert list(parallel.state_dict()) == list(reference.state_dict())
    for n, p in par_params.items():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(full, ref_params[n], rtol=0, atol=0, msg=f"{name}: {n}")
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    ref_out = reference(tokens, labels=tokens)
    par_out = parallel(tokens, labels=tokens)
    torch.testing.assert_close(par_out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
    ref_out.loss.backward()
    par_out.loss.backward()
    for n, p in par_params.items():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(
            grad, ref_params[n].grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{name} {n}: {m}"
        )
    plan = applied_tp_plan(parallel)
    assert plan is not None
    return {
        "source": plan.source,
        "sharded": sorted(
            n
            for n, p in par_params.items()
            if isinstance(p, DTensor) and any(pl != Replicate() for pl in p.placements)
        ),
    }


def _family_parity(names: list[str], attentions: tuple[str, ...] = ("sdpa", "eager")) -> dict:
    return {(n, a): _parity(n, a) for n in names for a in attentions}


@pytest.mark.parametrize("family", list(VARIANTS))
def test_classic_family_tp2_matches_unsharded(run_on_ranks, family):
    # Bloom has one attention implementation (its own, eager)
    attentions = ("eager",) if family == "bloom" else ("sdpa", "eager")
    results = run_on_ranks(2, _family_parity, VARIANTS[family], attentions)[0]
    for key, out in results.items():
        assert out["source"] == FAMILY_SOURCE, key
        # the attention and MLP weights of both layers are split
        layers = {n.split(".h.")[-1].split(".layers.")[-1].split(".")[0] for n in out["sharded"]}
        assert layers == {"0", "1"} and len(out["sharded"]) >= 8, (key, out["sharded"])


def test_gpt_bigcode_multi_query_tp2_matches_unsharded(run_on_ranks):
    results = run_on_ranks(2, _family_parity, ["gpt_bigcode_multi_query"])[0]
    assert all(out["source"] == FAMILY_SOURCE for out in results.values())


def test_every_classic_family_has_a_plan():
    assert {
        "OPTForCausalLM",
        "GPT2LMHeadModel",
        "GPTBigCodeForCausalLM",
        "FalconForCausalLM",
        "BloomForCausalLM",
    } <= set(FAMILY_PLANS)


class _FalconLikeAttention(nn.Module):
    """The attributes Falcon's attention reads, new architecture with 2 kv groups."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = 4, 8, 2
        self.new_decoder_architecture, self.multi_query = True, True
        self.query_key_value = nn.Linear(32, (4 + 2 * 2) * 8)


class _BloomLikeAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.pretraining_tp, self.slow_but_exact = 4, 2, True


def test_attention_that_cannot_split_exactly_is_refused_before_anything_changes():
    attention = _FalconLikeAttention()
    style = FAMILY_PLANS["FalconForCausalLM"]["transformer.h.*.self_attention"]
    assert isinstance(style, SplitAttentionHeads)
    split = style.check(attention, "attn", 2)
    assert split.counts == {"num_heads": 2, "num_kv_heads": 1} and split.rows == ((64, True),)
    with pytest.raises(ForgeConfigError, match="2 kv heads do not split over tp=4"):
        style.check(attention, "attn", 4)
    assert (attention.num_heads, attention.num_kv_heads) == (4, 2)
    bloom = FAMILY_PLANS["BloomForCausalLM"]["transformer.h.*.self_attention"]
    assert isinstance(bloom, SplitAttentionHeads)
    with pytest.raises(ForgeConfigError, match="slow_but_exact"):
        bloom.check(_BloomLikeAttention(), "attn", 2)


@pytest.mark.parametrize(
    "rows",
    [
        ((32, True),) * 3,  # GPT-2 [q; k; v]
        ((32, True), (16, False)),  # multi-query: q split, one k/v head replicated
        ((96, True),),  # contiguous by heads: nothing moves
    ],
)
@pytest.mark.parametrize("tp", [2, 4])
def test_the_exchange_gives_each_rank_its_rows(rows, tp):
    """The all-to-all's plan, played out without ranks: each rank ends up with the rows of its
    heads (its slice of every split segment, all of every replicated one), in order, and the
    backward sends each row's gradient back to its owner."""
    total = sum(size for size, _ in rows)
    c = total // tp
    plans = [exchange(rows, tp, r) for r in range(tp)]
    for rank in range(tp):
        received = []
        for src in range(tp):
            ex = plans[src]
            start = sum(ex.send_counts[:rank])
            ranges, pos = [], 0  # the ranges src sends to rank
            for s, n in ex.send:
                if start <= pos < start + ex.send_counts[rank]:
                    ranges.append((s, n))
                pos += n
            received += [src * c + s + i for s, n in ranges for i in range(n)]
        expected = [s + i for s, n in needed(rows, tp, rank) for i in range(n)]
        assert received == expected
        assert sum(plans[rank].recv_counts) == len(expected)
    assert all(p.identity for p in plans) == (len(rows) == 1 and rows[0][1])

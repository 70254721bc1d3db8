"""forge's own tensor-parallel plans for Hugging Face families that ship none.

Keyed by the model's class name (no transformers import), with the module paths transformers'
models use. Only the decoder blocks are split (attention by heads, the MLP in then out);
embeddings and the head stay replicated, which keeps tied weights tied. Each entry is proven at
TP=2 against the unsharded model, logits and every gradient (``packages/forge-tp-plans/tests/test_hf_models.py``:
StableLM, GPT-J; ``packages/forge-tp-plans/tests/test_hf_classics.py``: OPT, GPT-2, GPT-BigCode, Falcon, Bloom).

Attention with separate q, k and v projections (StableLM, GPT-J, OPT) is split column then row
with torch's styles; the head counts its forward reads are in :data:`FAMILY_HEAD_COUNTS` (OPT's
``num_heads``: without it, ``view(bsz, -1, num_heads, head_dim)`` silently folds the missing
heads into the sequence axis, which is what kept OPT out at first). Attention whose q, k and v
come from one fused projection gets :class:`~forge_tp_plans.fused_styles.SplitAttentionHeads`
with a function below that reads the model's own row layout, per config variant:

- GPT-2 ``c_attn`` (``Conv1D``): ``[q; k; v]`` end to end (``split(split_size)``): three split
  segments; ``split_size`` and ``num_heads`` divided; ``Conv1D`` styles for the rest.
- GPT-BigCode ``c_attn``: multi-query ``[q; k; v]`` with one k/v head: q split, k/v replicated,
  ``embed_dim`` (the split size) and ``num_key_value_groups`` divided; multi-head
  ``[heads, 3, head_dim]`` (``view(.., num_heads, 3 * head_dim)``): contiguous by heads.
- Falcon ``query_key_value``: new architecture ``[kv groups, heads / kv + 2, head_dim]``,
  contiguous by kv groups (``num_kv_heads`` must split); old multi-head ``[heads, 3, head_dim]``,
  contiguous by heads; one k/v head (old multi-query, or new with ``num_kv_heads=1``)
  ``[q; k; v]``: q split, k/v replicated. ALiBi variants get their heads' biases and masks.
- Bloom ``query_key_value``: ``[heads, 3, head_dim]``, contiguous by heads (plain colwise);
  the ALiBi bias ``[batch * heads, 1, keys]`` is cut to the rank's heads.
"""

from __future__ import annotations

from collections.abc import Callable

from forge_core.errors import ForgeConfigError
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from .fused_styles import (
    ColwiseConv1D,
    FusedQKVColwise,
    HeadSplit,
    RowwiseConv1D,
    RowwiseParallelInplaceSafe,
    SplitAttentionHeads,
)
from .head_params import ShardedHeadParams

__all__ = [
    "FAMILY_HEAD_COUNTS",
    "FAMILY_PLANS",
    "FAMILY_SINGLE_KV_REPLICATED",
    "FAMILY_SOURCE",
    "HF_PLAN_FIXES",
    "HF_PLAN_REFUSED",
]

#: The plan source ``describe_tp_plan`` reports for these plans.
FAMILY_SOURCE = "forge (Hugging Face family)"

_ATTENTION = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise"}


def _prefixed(
    prefix: str, styles: dict[str, ParallelStyle | str]
) -> dict[str, ParallelStyle | str]:
    return {f"{prefix}.{name}": style for name, style in styles.items()}


def _int(attn: nn.Module, name: str) -> int:
    """The integer attribute ``name`` of an attention module (a head count, a width)."""
    value = getattr(attn, name, None)
    if not isinstance(value, int):
        raise ForgeConfigError(
            f"{type(attn).__name__} has no integer '{name}', which forge's plan for its family "
            "reads; the model's code differs from the one the plan was written for"
        )
    return value


def _self_attention(attn: nn.Module) -> None:
    if getattr(attn, "is_cross_attention", False):
        raise ForgeConfigError(
            f"{type(attn).__name__}: forge's plan splits self-attention only, not cross-attention"
        )


def _gpt2_attention(attn: nn.Module, tp: int) -> HeadSplit:
    """GPT-2: ``c_attn(x).split(split_size, dim=2)`` -> q, k, v, each ``[heads, head_dim]``."""
    _self_attention(attn)
    size, heads = _int(attn, "split_size"), _int(attn, "num_heads")
    return HeadSplit(
        counts={"num_heads": heads // tp, "split_size": size // tp},
        heads=heads,
        fused="c_attn",
        rows=((size, True),) * 3,
    )


def _bigcode_attention(attn: nn.Module, tp: int) -> HeadSplit:
    """GPT-BigCode: multi-query ``split((embed_dim, kv_dim, kv_dim))`` with one k/v head, or
    multi-head ``view(.., num_heads, 3 * head_dim)`` (per head q, k, v)."""
    _self_attention(attn)
    heads, embed, kv_dim = _int(attn, "num_heads"), _int(attn, "embed_dim"), _int(attn, "kv_dim")
    counts = {"num_heads": heads // tp, "embed_dim": embed // tp}
    if getattr(attn, "multi_query", False):
        return HeadSplit(
            counts={**counts, "num_key_value_groups": _int(attn, "num_key_value_groups") // tp},
            heads=heads,
            fused="c_attn",
            rows=((embed, True), (2 * kv_dim, False)),
        )
    return HeadSplit(
        counts={**counts, "kv_heads": _int(attn, "kv_heads") // tp, "kv_dim": kv_dim // tp},
        heads=heads,
        fused="c_attn",
        rows=((3 * embed, True),),
    )


def _falcon_attention(attn: nn.Module, tp: int) -> HeadSplit:
    """Falcon: ``_split_heads`` views the fused output as ``[kv groups, heads / kv + 2,
    head_dim]`` (new architecture), ``[heads + 2, head_dim]`` (old multi-query) or ``[heads, 3,
    head_dim]`` (old multi-head)."""
    heads, head_dim = _int(attn, "num_heads"), _int(attn, "head_dim")
    if getattr(attn, "new_decoder_architecture", False):
        kv = _int(attn, "num_kv_heads")
    else:
        kv = 1 if getattr(attn, "multi_query", False) else heads
    counts = {"num_heads": heads // tp}
    rows: tuple[tuple[int, bool], ...]
    if kv == 1:  # [q; k; v] with one k/v head (num_kv_heads stays 1)
        rows = ((heads * head_dim, True), (2 * head_dim, False))
    elif kv % tp:
        raise ForgeConfigError(
            f"{type(attn).__name__}: {kv} kv heads do not split over tp={tp} (Falcon's fused "
            "projection is laid out by kv group)"
        )
    else:  # contiguous by kv group (new) or by head (old multi-head)
        rows = (((heads + 2 * kv) * head_dim, True),)
        counts["num_kv_heads"] = _int(attn, "num_kv_heads") // tp
    return HeadSplit(
        counts=counts,
        heads=heads,
        fused="query_key_value",
        rows=rows,
        per_head_inputs=("alibi", "attention_mask"),
    )


def _bloom_attention(attn: nn.Module, tp: int) -> HeadSplit:
    """Bloom: ``view(.., num_heads, 3, head_dim)``, contiguous by heads (plain colwise); the
    ALiBi bias comes in as ``[batch * heads, 1, keys]``."""
    if _int(attn, "pretraining_tp") > 1 and getattr(attn, "slow_but_exact", False):
        raise ForgeConfigError(
            "Bloom with slow_but_exact=True and pretraining_tp > 1 slices its dense weights by "
            "global index in forward; set slow_but_exact=False for tensor parallelism"
        )
    heads = _int(attn, "num_heads")
    return HeadSplit(counts={"num_heads": heads // tp}, heads=heads, per_head_inputs=("alibi",))


FAMILY_PLANS: dict[str, dict[str, ParallelStyle | str]] = {
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
    "OPTForCausalLM": {
        **_prefixed("model.decoder.layers.*.self_attn", {**_ATTENTION, "out_proj": "rowwise"}),
        **_prefixed("model.decoder.layers.*", {"fc1": "colwise", "fc2": "rowwise"}),
    },
    # NOTE: SplitAttentionHeads on the attention module comes before its projections: it gives
    # the fused projection's FusedQKVColwise its row segments.
    "GPT2LMHeadModel": {
        "transformer.h.*.attn": SplitAttentionHeads(_gpt2_attention),
        **_prefixed(
            "transformer.h.*.attn", {"c_attn": FusedQKVColwise(), "c_proj": RowwiseConv1D()}
        ),
        **_prefixed("transformer.h.*.mlp", {"c_fc": ColwiseConv1D(), "c_proj": RowwiseConv1D()}),
    },
    "GPTBigCodeForCausalLM": {
        "transformer.h.*.attn": SplitAttentionHeads(_bigcode_attention),
        **_prefixed("transformer.h.*.attn", {"c_attn": FusedQKVColwise(), "c_proj": "rowwise"}),
        **_prefixed("transformer.h.*.mlp", {"c_fc": "colwise", "c_proj": "rowwise"}),
    },
    "FalconForCausalLM": {
        "transformer.h.*.self_attention": SplitAttentionHeads(_falcon_attention),
        **_prefixed(
            "transformer.h.*.self_attention",
            {"query_key_value": FusedQKVColwise(), "dense": "rowwise"},
        ),
        # the parallel-attention block adds the attention output into the MLP's in place
        **_prefixed(
            "transformer.h.*.mlp",
            {"dense_h_to_4h": "colwise", "dense_4h_to_h": RowwiseParallelInplaceSafe()},
        ),
    },
    "BloomForCausalLM": {
        "transformer.h.*.self_attention": SplitAttentionHeads(_bloom_attention),
        **_prefixed(
            "transformer.h.*.self_attention", {"query_key_value": "colwise", "dense": "rowwise"}
        ),
        **_prefixed(
            "transformer.h.*.mlp", {"dense_h_to_4h": "colwise", "dense_4h_to_h": "rowwise"}
        ),
    },
}


#: Attention attributes these families read in forward to reshape into heads (a fixed count,
#: not ``-1``): after the split each tp rank holds ``1/tp`` of the heads, so
#: ``apply_tensor_parallel`` divides them by tp on the modules the pattern names. (The fused
#: families' counts depend on the config variant: their ``SplitAttentionHeads`` sets them.)
FAMILY_HEAD_COUNTS: dict[str, dict[str, tuple[str, ...]]] = {
    "StableLmForCausalLM": {"model.layers.*.self_attn": ("num_heads", "num_key_value_heads")},
    "GPTJForCausalLM": {"transformer.h.*.attn": ("num_attention_heads",)},
    "OPTForCausalLM": {"model.decoder.layers.*.self_attn": ("num_heads",)},
}

#: Families whose plan keeps a single k/v head (multi-query) whole on every rank, so a config's
#: ``num_key_value_heads == 1`` needs no split (GPT-BigCode's config says 1 when multi-query):
#: ``apply_tensor_parallel``'s config check skips it for them.
FAMILY_SINGLE_KV_REPLICATED = frozenset({"GPTBigCodeForCausalLM", "FalconForCausalLM"})


# --------------------------------------------------------------------------- transformers' own
# Corrections to plans transformers ships, found by the zoo (tests/zoo/hf_zoo.py): with the plan as
# shipped, TP=2 gives numbers that differ from the unsharded model's. Each returns entries
# appended to the model's plan (a later entry wins for the modules it names).


def _apertus_fix(model: nn.Module) -> dict[str, ParallelStyle | str | None]:
    # The MLP's xIELU activation has learned scalars (alpha_p, alpha_n) and runs on the split
    # hidden layer: each rank's gradient covers its half of the units; summed over tp they are
    # whole (transformers' plan leaves act_fn out: gradients 1000x off).
    return {"model.layers.*.mlp.act_fn": "replicated_with_grad_allreduce"}


def _gemma3n_fix(model: nn.Module) -> dict[str, ParallelStyle | str | None]:
    # Activation sparsity (layers with activation_sparsity_pattern > 0; real checkpoints use it
    # in their first 10 layers) keeps the gate units above mean + k * std across the WHOLE hidden
    # layer: on a split hidden layer each rank would take its own half's statistics (logits off
    # by 3e-2). Those layers' MLPs stay whole on every rank.
    config = getattr(model, "config", None)
    pattern = getattr(
        getattr(config, "get_text_config", lambda: config)(), "activation_sparsity_pattern", None
    )
    return {
        f"model.layers.{i}.mlp.{proj}": None
        for i, sparsity in enumerate(pattern or ())
        if sparsity
        for proj in ("gate_proj", "up_proj", "down_proj")
    }


def _whole(prefix: str, names: tuple[str, ...]) -> dict[str, ParallelStyle | str | None]:
    return {f"{prefix}.{name}": None for name in names}


def _embedding_gemma2_fix(model: nn.Module) -> dict[str, ParallelStyle | str | None]:
    # Its full-attention layers are multi-query (per_layer_config: one k/v head): a colwise
    # k_proj / v_proj would give each rank half of that head. Their attention stays whole.
    layers = getattr(getattr(model, "config", None), "per_layer_config", None) or ()
    fixes: dict[str, ParallelStyle | str | None] = {}
    for i, layer in enumerate(layers):
        if getattr(layer, "num_key_value_heads", None) == 1:
            names = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "v_norm")
            fixes.update(_whole(f"layers.{i}.self_attn", names))
    return fixes


_ATTENTION_WHOLE = ("q_proj", "k_proj", "v_proj", "o_proj")


def _sinks_fix(model: nn.Module) -> dict[str, ParallelStyle | str | None]:
    # The attention sinks (one logit per query head) are a parameter of the attention module;
    # transformers' plan names the parameter itself ('colwise'; 5.23 adds 'local_params' on the
    # module, which runs it on raw shards). They are split with the heads by the module's style.
    return {
        "model.layers.*.self_attn.sinks": None,
        "model.layers.*.self_attn": ShardedHeadParams(("sinks",)),
    }


def _gpt_oss_fix(model: nn.Module) -> dict[str, ParallelStyle | str | None]:
    # transformers' plan splits only the head (lm_head): the attention ran whole on every tp
    # rank. Split it by heads, its sinks with them; the MoE blocks are forge's (converted).
    return {
        **_prefixed("model.layers.*.self_attn", {**_ATTENTION, "o_proj": "rowwise"}),
        "model.layers.*.self_attn": ShardedHeadParams(("sinks",)),
    }


def _doge_fix(model: nn.Module) -> dict[str, ParallelStyle | str | None]:
    # dt_proj turns ALL value heads' features into one gate per kv head: column-parallel over
    # its input gathered from the rank's value heads (Shard(-1) -> the whole features), so each
    # rank computes the gates of its own kv heads; A (one per kv head) is split with them.
    # transformers' plan gives dt_proj 'rowwise' (every rank all kv heads' gates beside half of
    # them) and leaves A whole. q_norm / k_norm are shared over heads: gradients summed over tp.
    return {
        "model.layers.*.self_attn.dt_proj": ColwiseParallel(input_layouts=Shard(-1)),
        "model.layers.*.self_attn": ShardedHeadParams(("A",)),
        "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    }


#: Entries appended to transformers' own plan, by model class name (see above).
HF_PLAN_FIXES: dict[str, Callable[[nn.Module], dict[str, ParallelStyle | str | None]]] = {
    "ApertusForCausalLM": _apertus_fix,
    "GraniteSWAForCausalLM": _sinks_fix,
    "DogeForCausalLM": _doge_fix,
    "GptOssForCausalLM": _gpt_oss_fix,
    "Gemma3nForCausalLM": _gemma3n_fix,
    "EmbeddingGemma2TextModel": _embedding_gemma2_fix,
    # q_norm / k_norm are LayerNorms over all heads' features, before the split into heads:
    # the attention stays whole, the MLP is split.
    "EsmcModel": lambda model: _whole("layers.*.self_attn", _ATTENTION_WHOLE),
    # Its embedding RMS-normalises inside its forward, before rowwise's all-reduce would sum
    # the vocab shards' partial lookups: the embedding stays whole.
    "MuseGlimmerTextModel": lambda model: {"embed_tokens": None},
    # The exclusive self-attention's per-head alpha and the value embeddings (all kv heads)
    # are not split by transformers' plan: the attention stays whole, and the embedding (not an
    # nn.Embedding; 5.17's plan gives it rowwise).
    "NeoMMEModel": lambda model: {
        "embed_tokens": None,
        **_whole(
            "layers.*.self_attn",
            (
                "q_proj",
                "k_proj",
                "v_proj",
                "output_projection.gate_proj",
                "output_projection.o_proj",
            ),
        ),
    },
}

#: transformers' plans forge refuses, by model class name, with the reason (pass ``plan=``).
HF_PLAN_REFUSED: dict[str, str] = {}

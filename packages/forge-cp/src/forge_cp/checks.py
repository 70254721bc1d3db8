"""Context-parallel checks that need no process group (pure; the launcher runs them).

Each returns one-line messages naming the field and the fix (empty: fine).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

__all__ = [
    "HF_CP_FAMILIES",
    "hf_cp_problems",
    "cp_pipeline_problems",
    "cp_problems",
    "cp_variant_problems",
    "head_split_problem",
    "kv_head_copies",
    "seq_len_choices",
]


def seq_len_choices(seq_len: int, cp: int) -> tuple[int, int]:
    """The multiples of ``2 cp`` just below and above ``seq_len`` (below: at least ``2 cp``)."""
    step = 2 * cp
    below = max(step, seq_len // step * step)
    return below, (seq_len // step + 1) * step


def cp_pipeline_problems(cp: int, pp: int) -> list[str]:
    """``[message]`` for context parallelism inside pipeline stages (``cp > 1`` and ``pp > 1``):
    the config check and ``apply_context_parallel`` on a pipeline stage say these words."""
    if cp <= 1 or pp <= 1:
        return []
    return [
        f"parallelism.cp={cp} with parallelism.pp={pp}: context parallelism inside pipeline "
        "stages is not supported yet; set cp=1 or pp=1"
    ]


def cp_problems(
    cp: int,
    seq_len: int,
    *,
    pp: int = 1,
    model_kind: str = "transformer",
    fitting_cp: Collection[int] | None = None,
) -> list[str]:
    """What is wrong with ``parallelism.cp=cp`` for sequences of ``seq_len`` tokens.

    ``model_kind``: ``"transformer"`` (forge's, dense or MoE), ``"vlm"`` or ``"field"``.
    ``fitting_cp``: the cp degrees that fit the world size with the other degrees (forge passes
    them); a suggested cp degree is one of them, and splits ``seq_len`` (None: not known, only
    the split is asked of a suggestion).
    """
    if cp <= 1:
        return []
    problems = []
    if seq_len % (2 * cp):
        below, above = seq_len_choices(seq_len, cp)
        fits = [
            c
            for c in range(2, seq_len // 2 + 1)
            if seq_len % (2 * c) == 0 and (fitting_cp is None or c in fitting_cp)
        ][:8]
        problems.append(
            f"training.seq_len={seq_len} is not divisible by 2 x parallelism.cp = {2 * cp} (each "
            f"cp rank holds two equal chunks of every sequence); set training.seq_len={below} or "
            f"{above}" + (f", or parallelism.cp to one of {fits}" if fits else "")
        )
    problems += cp_pipeline_problems(cp, pp)
    if model_kind == "vlm":
        problems.append(
            f"parallelism.cp={cp} on a vision-language model: not supported (its image tokens "
            "would be split across ranks); set parallelism.cp=1"
        )
    elif model_kind == "field":
        problems.append(
            f"parallelism.cp={cp} on a field model ([field]): it has no sequence to shard; use "
            "parallelism.domain for spatial parallelism and set cp=1"
        )
    return problems


def kv_head_copies(n_kv_heads: int, cp: int) -> int:
    """How many cp ranks each key/value head goes to under the heads variant: 1 when they split
    over cp, else ``cp / n_kv_heads`` (each repeated before the exchange)."""
    return 1 if n_kv_heads % cp == 0 else cp // n_kv_heads


def head_split_problem(n_heads: int, n_kv_heads: int, cp: int) -> str | None:
    """Why ``n_heads`` query and ``n_kv_heads`` key/value heads (per tp rank) cannot be split
    over ``cp`` ranks by head (the heads variant), or None when they can."""
    if n_heads % cp:
        return (
            f"{n_heads} attention heads per tp rank do not split over parallelism.cp={cp} (the "
            "heads variant gives each cp rank n_heads / cp of them)"
        )
    if n_kv_heads % cp and cp % n_kv_heads:
        return (
            f"{n_kv_heads} key/value heads per tp rank and parallelism.cp={cp}: neither divides "
            "the other (each cp rank needs whole key/value heads)"
        )
    return None


def cp_variant_problems(
    variant: str, cp: int, *, n_heads: int, n_kv_heads: int, tp: int
) -> list[str]:
    """``[message]`` when ``cp.variant`` cannot run with these heads (``n_heads`` and
    ``n_kv_heads`` of the whole model, split over ``tp`` first)."""
    if cp <= 1 or variant != "heads":
        return []
    problem = head_split_problem(n_heads // tp, max(1, n_kv_heads // tp), cp)
    if problem is None:
        return []
    return [f"cp.variant='heads' with parallelism.tp={tp}: {problem}; use cp.variant='allgather'"]


#: ``model_type`` -> family: the Hugging Face decoders whose attention runs across cp shards.
HF_CP_FAMILIES: dict[str, str] = {"llama": "Llama", "qwen3": "Qwen3", "gemma3_text": "Gemma3"}


def hf_cp_problems(config: Mapping[str, Any], cp: int) -> list[str]:
    """Why a Hugging Face model with this ``config.json`` cannot run at ``parallelism.cp=cp``,
    one line each (empty: it can). Pure: the launcher asks before any rank starts."""
    if cp <= 1:
        return []
    kind = config.get("model_type")
    if kind not in HF_CP_FAMILIES:
        names = ", ".join(f"{v} ({k})" for k, v in HF_CP_FAMILIES.items())
        return [
            f"parallelism.cp={cp} with a Hugging Face {kind!r} model: context parallelism runs "
            f"the attention of {names}; set parallelism.cp=1 for this model"
        ]
    problems = []
    if float(config.get("attention_dropout") or 0.0) > 0.0:
        problems.append(
            f"parallelism.cp={cp}: the model's attention_dropout={config['attention_dropout']} "
            "is not run across cp shards; set it to 0 in config.json or parallelism.cp=1"
        )
    if config.get("attn_logit_softcapping") is not None:
        problems.append(
            f"parallelism.cp={cp}: attention logit soft-capping (attn_logit_softcapping) is not "
            "run across cp shards; set parallelism.cp=1 for this model"
        )
    return problems

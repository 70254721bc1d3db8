"""The Hugging Face zoo in CI: every dense decoder family of the installed transformers that
has a tensor-parallel plan (its own, or forge's ``FAMILY_PLANS``), built tiny, at TP=2 against
its unsharded copy (logits and every gradient; ``tools/hf_zoo.py`` says how).

Every family passes except those in :data:`EXPECTED_REFUSED`, which must give exactly the
outcome listed there: a family that breaks fails the test, and so does a listed family that
starts passing (remove it from the list). No family may give wrong numbers, listed or not.

Marker ``zoo``: the README's suite leaves it out; CI runs it as a lane of its own
(``uv run pytest -m zoo tests/zoo``). Under transformers 5.17 (the GPU image) the family set
differs: only the installed transformers' families are checked, and entries for families it
lacks are ignored (run it there with ``tools/gpu_image_env python -m pytest -m zoo tests/zoo``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from packaging.version import Version  # noqa: E402 - after the skip

from tools import hf_zoo  # noqa: E402 - tools/ is a namespace package under the checkout

pytestmark = pytest.mark.zoo

#: family -> (why it does not pass, the outcome it gives: a prefix of it, or
#: {lowest transformers version: prefix} where the outcome changed between versions).
EXPECTED_REFUSED: dict[str, tuple[str, str | dict[str, str]]] = {
    "doge": (
        "transformers' plan splits q/k/v by head, but dt_proj (all value heads' features -> "
        "one gate per kv head) gets 'rowwise', whose all-reduce hands every rank the gates of "
        "all kv heads, and A (one per kv head) is not split: forge refuses the plan by class "
        "(forge_tp_plans.hf_families.HF_PLAN_REFUSED) instead of crashing in the forward",
        "refused: DogeForCausalLM's own tensor-parallel plan is refused",
    ),
    "granite_swa": (
        "its attention sinks are a parameter of the attention module, split across heads; "
        "transformers' plan names the parameter ('self_attn.sinks': 5.23 'local_params', 5.17 "
        "colwise), and forge's styles split modules: forge refuses a pattern naming a parameter "
        "(skipping it would leave every rank all heads' sinks beside half the heads)",
        "refused: plan pattern 'model.layers.*.self_attn.sinks' names a parameter",
    ),
}


def _expected_prefix(entry: str | dict[str, str], version: str) -> str | None:
    """The prefix for the installed transformers (None: the entry starts at a later version)."""
    if isinstance(entry, str):
        return entry
    usable = [v for v in entry if Version(v) <= Version(version)]
    return entry[max(usable, key=Version)] if usable else None


@pytest.fixture(scope="module")
def zoo(run_on_ranks) -> dict[str, hf_zoo.Row]:
    rows = hf_zoo.run_zoo(
        lambda fn, *args, **kwargs: run_on_ranks(2, fn, *args, **kwargs), hf_zoo.zoo_families()
    )
    return {row.family: row for row in rows}


def test_no_family_gives_wrong_numbers(zoo):
    wrong = {f: r.outcome for f, r in zoo.items() if hf_zoo.outcome_kind(r.outcome) == "wrong"}
    assert not wrong, "TP=2 gives numbers that differ from the unsharded model's:\n" + "\n".join(
        f"  {f}: {o}" for f, o in wrong.items()
    )


def test_every_family_passes_or_fails_as_expected(zoo):
    import transformers

    problems = []
    for family, row in zoo.items():
        if family in EXPECTED_REFUSED:
            reason, entry = EXPECTED_REFUSED[family]
            prefix = _expected_prefix(entry, transformers.__version__)
            if prefix is not None and not row.outcome.startswith(prefix):
                hint = " (it passes now: remove it from EXPECTED_REFUSED)" * (row.outcome == "pass")
                problems.append(f"{family}: expected {prefix!r}..., got {row.outcome!r}{hint}")
        elif row.outcome != "pass":
            problems.append(f"{family}: {row.outcome}")
        elif row.split == 0:
            problems.append(f"{family}: passes with nothing split ({row.plan})")
    assert not problems, "\n".join(problems)


def test_expected_entries_are_zoo_families():
    """An entry names a family of the zoo, or one the installed transformers lacks (5.17 has
    fewer families): never a family the zoo leaves out (MoE, composite)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    families = {f for f, _ in hf_zoo.zoo_families()}
    stale = [f for f in EXPECTED_REFUSED if f in CONFIG_MAPPING_NAMES and f not in families]
    assert not stale, f"EXPECTED_REFUSED names families outside the zoo: {stale}"


def test_enumeration_finds_the_common_families_and_leaves_out_moe():
    found = hf_zoo.enumerate_families()
    families = {f for f, _ in found.zoo}
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3_text", "stablelm", "gptj"} <= (
        families
    )
    assert len(families) >= 40, sorted(families)
    assert {"mixtral", "qwen3_moe", "deepseek_v3"} <= set(found.moe), found.moe
    # dense despite expert fields: Doge's switch is_moe=False, Gemma4's enable_moe_block=False
    assert {"doge", "gemma4_text"} <= families
    assert "llama4" in found.excluded  # composite (vision) config; llama4_text is MoE


def test_tiny_config_shrinks_and_keeps_one_layer_of_each_type():
    llama = hf_zoo.tiny_config("llama")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.vocab_size) == (32, 2, 64)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (4, 2, 8)
    gemma3 = hf_zoo.tiny_config("gemma3_text")
    assert gemma3.layer_types == ["sliding_attention", "full_attention"]
    assert gemma3.sliding_window == hf_zoo.TINY_SLIDING_WINDOW < hf_zoo.SEQ
    assert gemma3.attention_dropout == 0.0
    qwen35 = hf_zoo.tiny_config("qwen3_5_text")
    assert sorted(qwen35.layer_types) == ["full_attention", "linear_attention"]

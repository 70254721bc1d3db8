"""The Hugging Face zoo in CI (``tests/zoo/hf_zoo.py`` says how each check runs), three sections:

- dense: every dense decoder family of the installed transformers that has a tensor-parallel
  plan (its own, or forge's ``FAMILY_PLANS``), built tiny, at TP=2 against its unsharded copy
  (logits and every gradient);
- MoE: every mixture-of-experts causal LM (and MoE base model with a plan), under
  ``ParallelPlan`` on ``{dp_shard: 2, ep: 2}`` against the unconverted model on one device
  (logits, then each step's loss and gradient norm);
- base: the families with a plan and no causal-LM class, their base model at TP=2
  (``last_hidden_state`` and every gradient).

Every family passes except those in :data:`EXPECTED_REFUSED`, which must give exactly the
outcome listed there: a family that breaks fails the test, and so does a listed family that
starts passing (remove it from the list). An MoE family passes when forge converts its MoE block
class (``forge_moe_ep.hf.HF_MOE_BLOCKS``), and is refused for having no forge MoE layer
(:data:`hf_zoo.UNCONVERTED`) otherwise, unless listed. No family may give wrong numbers, listed
or not.

Marker ``zoo``: the README's suite leaves it out; CI runs it as a lane of its own
(``uv run pytest -m zoo``). Under transformers 5.17 (the GPU image) the family set
differs: only the installed transformers' families are checked, and entries for families it
lacks are ignored (run it there with ``tools/gpu_image_env python -m pytest -m zoo``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from packaging.version import Version  # noqa: E402 - after the skip

from tests.zoo import hf_zoo  # noqa: E402

#: What this module's rank functions import inside the function: the rank workers' forkserver
#: imports it once (forge_core.testing.pytest_ranks).
RANK_PRELOAD = ["transformers"]

pytestmark = pytest.mark.zoo

#: family -> (why it does not pass, the outcome it gives: a prefix of it, or
#: {lowest transformers version: prefix} where the outcome changed between versions).
EXPECTED_REFUSED: dict[str, tuple[str, str | dict[str, str]]] = {
    "aria_text": (
        "transformers before 5.23 keeps Aria's experts as two grouped-GEMM modules (fc1, fc2), "
        "not the fused gate_up_proj forge converts; refused by name there",
        {
            "5.0": "refused: AriaTextMoELayer.experts has no fused gate_up_proj",
            "5.23": "pass",
        },
    ),
}


def _expected_prefix(entry: str | dict[str, str], version: str) -> str | None:
    """The prefix for the installed transformers (None: the entry starts at a later version)."""
    if isinstance(entry, str):
        return entry
    usable = [v for v in entry if Version(v) <= Version(version)]
    return entry[max(usable, key=Version)] if usable else None


@pytest.fixture(scope="module")
def zoo(run_on_ranks) -> dict[str, dict[str, hf_zoo.Row]]:
    """``{section: {family: row}}``, every section on one 2-rank pool."""
    sections = hf_zoo.run_sections(
        lambda fn, *args, **kwargs: run_on_ranks(2, fn, *args, **kwargs),
        hf_zoo.enumerate_families(),
    )
    return {name: {row.family: row for row in rows} for name, rows in sections.items()}


def _all_rows(zoo: dict[str, dict[str, hf_zoo.Row]]) -> dict[str, hf_zoo.Row]:
    return {family: row for rows in zoo.values() for family, row in rows.items()}


def test_no_family_gives_wrong_numbers(zoo):
    wrong = {
        f: r.outcome for f, r in _all_rows(zoo).items() if hf_zoo.outcome_kind(r.outcome) == "wrong"
    }
    assert not wrong, "forge gives numbers that differ from the unsharded model's:\n" + "\n".join(
        f"  {f}: {o}" for f, o in wrong.items()
    )


def _unexpected(family: str, row: hf_zoo.Row, version: str) -> str | None:
    """What is wrong with a listed family's row (None: it gives the listed outcome)."""
    reason, entry = EXPECTED_REFUSED[family]
    prefix = _expected_prefix(entry, version)
    if prefix is None or row.outcome.startswith(prefix):
        return None
    hint = " (it passes now: remove it from EXPECTED_REFUSED)" * (row.outcome == "pass")
    return f"{family}: expected {prefix!r}..., got {row.outcome!r}{hint}"


@pytest.mark.parametrize("section", ["dense", "base"])
def test_every_tp_family_passes_or_fails_as_expected(zoo, section):
    import transformers

    problems = []
    for family, row in zoo[section].items():
        if family in EXPECTED_REFUSED:
            problem = _unexpected(family, row, transformers.__version__)
            problems += [problem] if problem else []
        elif row.outcome != "pass":
            problems.append(f"{family}: {row.outcome}")
        elif row.split == 0:
            problems.append(f"{family}: passes with nothing split ({row.plan})")
    assert not problems, "\n".join(problems)


def test_every_moe_family_converts_and_passes_or_is_refused(zoo):
    """A family whose MoE blocks forge converts must pass with its blocks converted; one whose
    blocks it does not convert must be refused for having no forge MoE layer."""
    import transformers

    problems = []
    for family, row in zoo["moe"].items():
        if not row.blocks:
            problems.append(f"{family}: no MoE block in the tiny model ({row.outcome})")
        elif family in EXPECTED_REFUSED:
            problem = _unexpected(family, row, transformers.__version__)
            problems += [problem] if problem else []
        elif hf_zoo.converts(row):
            if row.outcome != "pass" or row.split == 0:
                problems.append(f"{family} ({row.blocks}, converted): {row.outcome} {row.plan}")
        elif not row.outcome.startswith(hf_zoo.UNCONVERTED):
            problems.append(f"{family} ({row.blocks}, not converted): {row.outcome}")
    assert not problems, "\n".join(problems)


def test_the_known_moe_families_convert(zoo):
    """The families forge's HF_MOE_BLOCKS was written for are in the MoE section and pass."""
    known = {"qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "gpt_oss"}
    known |= {"olmoe", "glm4_moe", "llama4_text"}
    rows = zoo["moe"]
    assert known <= set(rows), sorted(known - set(rows))
    assert all(rows[f].outcome == "pass" for f in known), {f: rows[f].outcome for f in known}


def test_expected_entries_are_zoo_families():
    """An entry names a family of the zoo, or one the installed transformers lacks (5.17 has
    fewer families): never a family the zoo leaves out (composite, no plan)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    found = hf_zoo.enumerate_families()
    families = {f for jobs in hf_zoo.section_jobs(found).values() for fs, _ in jobs for f, _ in fs}
    stale = [f for f in EXPECTED_REFUSED if f in CONFIG_MAPPING_NAMES and f not in families]
    assert not stale, f"EXPECTED_REFUSED names families outside the zoo: {stale}"


def test_enumeration_finds_the_common_families_and_sorts_moe_and_base_out():
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
    moe = {f for f, _ in found.moe_zoo}
    assert {"mixtral", "qwen3_moe", "deepseek_v3", "llama4_text"} <= moe
    assert "gpt_oss" in moe  # MoE without a tp plan: expert parallelism needs none
    assert not moe & families
    base = {f for f, _ in found.base}
    assert {"esmc", "eurobert", "qwen2_vl_text"} <= base, sorted(base)
    assert not base & (families | moe)
    assert {f for f, _ in found.base_moe} <= set(found.moe)


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


def test_tiny_moe_config_has_eight_experts_top2_and_a_sparse_layer():
    v3 = hf_zoo.tiny_config("deepseek_v3", moe=True)
    assert (v3.n_routed_experts, v3.num_experts_per_tok, v3.moe_intermediate_size) == (8, 2, 16)
    assert v3.first_k_dense_replace == 1 < v3.num_hidden_layers  # a dense layer, then MoE
    assert (v3.n_group, v3.topk_group) == (4, 2)  # grouped routing exercised
    lite = hf_zoo.tiny_config("glm4_moe_lite", moe=True)  # dense first, sparse after
    assert sorted(set(lite.mlp_layer_types)) == ["dense", "sparse"]
    mixtral = hf_zoo.tiny_config("mixtral", moe=True)
    assert (mixtral.num_local_experts, mixtral.output_router_logits) == (8, False)

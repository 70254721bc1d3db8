"""Hugging Face decoders at cp > 1 through transformers' attention interface: Llama, Qwen3 and
Gemma3 (sliding-window layers) equal one device in loss and gradient norm, fp32, on plain and
packed rows; another family is refused by name."""

from __future__ import annotations

import pytest

from tests.integration.cp.hf_jobs import hf_cp_parity, hf_cp_refusal

#: What this module's rank functions import inside the function: the rank workers' forkserver
#: imports it once (forge_core.testing.pytest_ranks).
RANK_PRELOAD = ["transformers"]

# NOTE: the Hugging Face lane (marker zoo), which runs in both venvs (transformers 5.23 and the
# GPU machines' 5.17), not the README suite (its time).
pytestmark = pytest.mark.zoo


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3_text"])
def test_hf_model_at_cp2_x_fsdp2_matches_one_device(run_on_ranks, name):
    for result in run_on_ranks(4, hf_cp_parity, name, {"cp": 2, "dp_shard": 2}):
        result.assert_ok()


@pytest.mark.parametrize(
    ("name", "variant"), [("gemma3_text", "heads"), ("llama", "allgather"), ("qwen3", "heads")]
)
def test_hf_model_at_cp2_on_packed_documents_matches_one_device(run_on_ranks, name, variant):
    for result in run_on_ranks(2, hf_cp_parity, name, {"cp": 2}, variant=variant, documents=True):
        result.assert_ok()


def test_another_family_is_refused_by_name(run_on_ranks):
    said = run_on_ranks(2, hf_cp_refusal, "qwen2")[0]
    assert "Hugging Face 'qwen2' model" in said and "set parallelism.cp=1" in said, said
    assert "\n" not in said

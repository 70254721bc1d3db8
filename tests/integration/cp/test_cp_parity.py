"""Context parallelism equals the single-device model: loss AND gradient norm, fp32, 10 steps.

cp=2 (blocks compiled around the attention, which runs eagerly) and cp=4 alone, FSDP2 over dp_shard x cp (with AC full), TP (with sequence parallelism)
inside each cp rank, the MoE model with expert parallelism carved out of the cp ranks, and DDP
averaging over the cp ranks; the heads variant ([cp] variant = "heads") at cp=2, cp=4,
cp=2 x dp_shard=2, cp=2 x tp=2 and the MoE model at cp=2 x ep=2.
Causality across shards: a later token changes no earlier logit, on any rank.
"""

from __future__ import annotations

import pytest
import torch
from forge_cp import CPConfig

from tests.integration.cp.jobs import causal_logits, cp_parity, document_logits

HEADS = CPConfig(variant="heads")


@pytest.mark.parametrize(
    ("world", "layout", "kwargs"),
    [
        (2, {"cp": 2}, {"compile_model": True, "compile_backend": "aot_eager"}),
        (4, {"cp": 4}, {}),
        (4, {"cp": 2, "dp_shard": 2}, {"ac_mode": "full"}),
        (4, {"cp": 2, "tp": 2}, {"sequence_parallel": True}),
        (2, {"cp": 2, "ep": 2}, {"moe": True}),
        (2, {"cp": 2, "data": "ddp"}, {"data": "ddp"}),
        # the heads variant: 4 heads, 2 key/value heads (cp=4 and tp=2 x cp=2: each key/value
        # head goes to two ranks)
        (2, {"cp": 2}, {"cp": HEADS}),
        (4, {"cp": 4}, {"cp": HEADS}),
        (4, {"cp": 2, "dp_shard": 2}, {"cp": HEADS, "ac_mode": "full"}),
        (4, {"cp": 2, "tp": 2}, {"cp": HEADS, "sequence_parallel": True}),
        (4, {"cp": 2, "ep": 2, "dp_shard": 2}, {"cp": HEADS, "moe": True}),
    ],
    ids=[
        "cp2-compiled",
        "cp4",
        "cp2xfsdp2-ac-full",
        "cp2xtp2-sp",
        "cp2xep2-moe",
        "cp2-ddp",
        "heads-cp2",
        "heads-cp4",
        "heads-cp2xfsdp2-ac-full",
        "heads-cp2xtp2-sp",
        "heads-cp2xep2-moe",
    ],
)
def test_context_parallel_matches_one_device(run_on_ranks, world, layout, kwargs):
    for result in run_on_ranks(world, cp_parity, layout, **kwargs):
        result.assert_ok()


@pytest.mark.parametrize("variant", ["allgather", "heads"])
def test_a_later_token_changes_no_earlier_logit_across_shards(run_on_ranks, variant):
    # seq 32 over cp=2: chunks of 8; rank 0 holds positions 0-7 and 24-31, rank 1 8-23. Token
    # 20 sits in rank 1's second chunk; positions 0-19 span both ranks and three chunks.
    changed = 20
    results = run_on_ranks(2, causal_logits, 32, changed, variant)
    for out in results:
        before, after = out["tokens"][:, :changed], out["changed"][:, :changed]
        assert torch.equal(before, after)  # bit for bit: masked keys add exact zeros
        assert not torch.allclose(out["tokens"][:, changed:], out["changed"][:, changed:])
        torch.testing.assert_close(out["tokens"], out["reference"], rtol=1e-5, atol=1e-5)
    ranks = [out["positions"].tolist() for out in results]
    assert ranks[0] == [*range(0, 8), *range(24, 32)] and ranks[1] == list(range(8, 24))


@pytest.mark.parametrize(
    ("world", "layout", "kwargs"),
    [
        (2, {"cp": 2}, {"compile_model": True, "compile_backend": "aot_eager"}),
        # NOTE: the heavy lane (the README suite's time): cp=4, and documents without cp
        pytest.param(4, {"cp": 4}, {"cp": HEADS}, marks=pytest.mark.heavy),
        (4, {"cp": 2, "dp_shard": 2}, {"ac_mode": "full"}),
        (4, {"cp": 2, "tp": 2}, {"cp": HEADS, "sequence_parallel": True}),
        (2, {"cp": 2, "ep": 2}, {"moe": True, "cp": HEADS}),
        pytest.param(
            4, {"dp_shard": 2, "tp": 2}, {"sequence_parallel": True}, marks=pytest.mark.heavy
        ),
    ],
    ids=[
        "cp2-compiled",
        "heads-cp4",
        "cp2xfsdp2-ac-full",
        "heads-cp2xtp2-sp",
        "heads-cp2xep2-moe",
        "fsdp2xtp2-sp-no-cp",
    ],
)
def test_packed_documents_match_one_device(run_on_ranks, world, layout, kwargs):
    for result in run_on_ranks(world, cp_parity, layout, documents=True, **kwargs):
        result.assert_ok()


@pytest.mark.parametrize("variant", ["allgather", "heads"])
def test_packed_documents_across_shards_equal_each_document_alone(run_on_ranks, variant):
    # one short document, a second one, then one long document: a fixed pairing of chunks
    # would load the ranks unevenly, so the tokens are dealt by their work
    lengths = [3, 7, 22]
    for out in run_on_ranks(2, document_logits, variant, lengths):
        torch.testing.assert_close(out["tokens"], out["alone"], rtol=1e-5, atol=1e-5)
        first, rest = slice(0, 3), slice(10, 32)
        for part in (first, rest):  # bit for bit: masked keys add exact zeros
            assert torch.equal(out["tokens"][:, part], out["changed"][:, part])
        assert not torch.allclose(out["tokens"][:, 3:10], out["changed"][:, 3:10])
        assert sorted(out["index"].tolist()) == list(range(32))

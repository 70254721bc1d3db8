"""Hugging Face style strings (transformers 4.x and 5.x) translate to torch styles or are refused."""

from __future__ import annotations

import pytest
from forge_core import ForgeConfigError
from forge_tp_plans import translate_parallel_style
from forge_tp_plans.styles import describe_style
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel


@pytest.mark.parametrize(
    ("name", "cls", "inp", "out"),
    [
        ("colwise", ColwiseParallel, Replicate(), Shard(-1)),
        ("rowwise", RowwiseParallel, Shard(-1), Replicate()),
        ("colwise_rep", ColwiseParallel, Replicate(), Replicate()),
        ("rowwise_rep", RowwiseParallel, Replicate(), Replicate()),
        ("colwise_gather_output", ColwiseParallel, Replicate(), Replicate()),
        ("rowwise_split_input", RowwiseParallel, Replicate(), Replicate()),
        ("embedding_rowwise", RowwiseParallel, Replicate(), Replicate()),
        ("embedding_colwise", ColwiseParallel, Replicate(), Replicate()),
        ("local_colwise", ColwiseParallel, Replicate(), Shard(-1)),
        ("local_rowwise", RowwiseParallel, Shard(-1), Replicate()),
    ],
)
def test_linear_and_embedding_styles_translate_with_their_layouts(name, cls, inp, out):
    style = translate_parallel_style(name)
    assert type(style) is cls
    assert tuple(style.input_layouts) == (inp,) and tuple(style.output_layouts) == (out,)


def test_sequence_parallel_and_replicate():
    assert isinstance(translate_parallel_style("sequence_parallel"), SequenceParallel)
    assert translate_parallel_style("replicate") is None
    assert describe_style(None) == "replicated"
    assert (
        describe_style(translate_parallel_style("colwise")) == "ColwiseParallel(in R -> out S(-1))"
    )


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("moe_tp_experts", "MoE expert style, handled by forge-moe-ep"),
        ("ep_router", "MoE router style"),
        ("grouped_gemm", "MoE expert style"),
        ("local", "MoE style"),
        ("gather", "only accepts it over local_rowwise children"),
    ],
)
def test_moe_and_fused_styles_are_refused_with_the_reason(name, reason):
    with pytest.raises(ForgeConfigError, match=reason):
        translate_parallel_style(name)


def test_unknown_style_suggests_the_closest():
    with pytest.raises(
        ForgeConfigError,
        match=r"unknown tensor-parallel style 'colwize' \(did you mean 'colwise'\?\)",
    ):
        translate_parallel_style("colwize")


def test_every_style_of_the_installed_transformers_is_known():
    import transformers
    import transformers.distributed.tensor_parallel as tp
    from forge_tp_plans.styles import HF_STYLE_NAMES

    # NOTE: some styles (ep_dispatch_experts in 5.x) are registered only once model classes
    # load; load one so the set does not depend on which tests ran before.
    assert transformers.LlamaForCausalLM is not None
    installed = set(tp.ALL_PARALLEL_STYLES.keys())
    assert installed <= HF_STYLE_NAMES, installed - HF_STYLE_NAMES

"""Where a converted Hugging Face MoE model's tensors lie in the checkpoint transformers writes
(forge_moe_ep.hf_sources): every source names stored tensors that exist, in the shapes it needs,
and the tensors assembled from the saved files by the sources are exactly the ones
convert_hf_moe makes of the model from_pretrained loads. The sharded read itself:
tests/integration/checkpoint/test_hf_moe_weights_in.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from forge_core.tensor_source import TensorSource
from forge_moe_ep.hf import convert_hf_moe
from forge_moe_ep.hf_sources import hf_checkpoint_sources
from test_hf_moe import FAMILIES, build_hf_moe

transformers = pytest.importorskip("transformers")

#: The families whose checkpoints forge must read (the others of FAMILIES are checked too).
REQUIRED = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor ``save_pretrained`` wrote (tiny models: one file)."""
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def _saved_and_converted(
    name: str, directory: Path
) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """The tensors a tiny model of family ``name`` saves, and the model from_pretrained loads
    from them, converted."""
    build_hf_moe(name).save_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert convert_hf_moe(model)
    return _stored(directory), model


def _assemble(source: TensorSource, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """A whole target from whole stored tensors, as the source says (the reference the sharded
    reader's slices must agree with)."""

    def laid_out(t: torch.Tensor) -> torch.Tensor:
        t = t.transpose(-1, -2) if source.transpose else t
        if source.interleaved:
            return t[..., source.part :: source.parts]
        return t.chunk(source.parts, dim=-1)[source.part]

    if source.stacked:
        return torch.stack([laid_out(stored[n]) for n in source.stored])
    return laid_out(stored[source.stored[0]])


@pytest.mark.parametrize("name", FAMILIES)
def test_sources_name_stored_tensors_of_the_shapes_they_need(name, tmp_path):
    stored, model = _saved_and_converted(name, tmp_path)
    shapes = {n: tuple(t.shape) for n, t in stored.items()}
    sources = hf_checkpoint_sources(model, shapes)
    expected = model.state_dict()
    assert sources and set(sources) <= set(expected)
    used = set()
    for target, source in sources.items():
        need = source.stored_shape(tuple(expected[target].shape))
        for n in source.stored:
            assert shapes.get(n) == need, (target, n, shapes.get(n), need)
        used |= set(source.stored)
    # every other tensor of the converted model is stored under its own name, and everything
    # stored is used (tied heads aside)
    direct = set(expected) - set(sources)
    tied = {n for n in direct - set(shapes) if n.startswith("lm_head.")}
    assert direct - tied <= set(shapes), sorted(direct - tied - set(shapes))[:3]
    assert set(shapes) <= direct | used, sorted(set(shapes) - direct - used)[:3]


@pytest.mark.parametrize("name", FAMILIES)
def test_assembled_from_the_files_equals_what_convert_makes(name, tmp_path):
    stored, model = _saved_and_converted(name, tmp_path)
    sources = hf_checkpoint_sources(model, {n: tuple(t.shape) for n, t in stored.items()})
    for target, value in model.state_dict().items():
        source = sources.get(target)
        if source is None:
            if target in stored:
                assert torch.equal(stored[target], value), target
            continue
        if source.constant is not None:
            assert not source.stored and torch.all(value == source.constant), target
            continue
        assert torch.equal(_assemble(source, stored), value), target


@pytest.mark.parametrize("name", REQUIRED)
def test_the_stored_layouts_forge_reads(name, tmp_path):
    """What each required family's sources say, spelled out (transformers 5.23's files)."""
    stored, model = _saved_and_converted(name, tmp_path)
    sources = hf_checkpoint_sources(model, {n: tuple(t.shape) for n, t in stored.items()})
    block = "model.layers.1.mlp"
    w1 = sources[f"{block}.experts.w1"]
    if name == "gpt_oss":  # fused, interleaved gate / up columns
        assert w1 == TensorSource(
            (f"{block}.experts.gate_up_proj",), part=0, parts=2, interleaved=True
        )
        assert sources[f"{block}.experts.b3"].part == 1
        assert sources[f"{block}.router.gate.weight"].rename == f"{block}.router.weight"
        return
    on_disk = "model.layers.1.block_sparse_moe" if name == "mixtral" else block
    gate = "w1" if name == "mixtral" else "gate_proj"
    assert w1.stacked and w1.transpose and w1.stored[3] == f"{on_disk}.experts.3.{gate}.weight"
    assert sources[f"{block}.router.gate.weight"].rename == f"{on_disk}.gate.weight"
    bias = sources[f"{block}.router.expert_bias"]
    if name == "deepseek_v3":
        assert bias.rename == f"{block}.gate.e_score_correction_bias"
        shared = sources[f"{block}.shared_expert.up_proj.weight"]
        assert shared.rename == f"{block}.shared_experts.up_proj.weight"
    else:
        assert bias == TensorSource((), constant=0.0)


def test_a_model_without_converted_blocks_has_no_sources():
    model = build_hf_moe("qwen3_moe")  # not converted: its names are transformers' own
    assert hf_checkpoint_sources(model, {}) == {}


def test_a_source_knows_the_stored_shape_and_the_last_dim_it_reads():
    gate = TensorSource(("g",), transpose=True, part=0, parts=2)  # [E, 2I, dim] -> [E, dim, I]
    assert gate.stored_shape((4, 8, 3)) == (4, 6, 8)
    assert gate.last_dim(3, 1, 2) == (1, 3, 1)
    up = TensorSource(("g",), part=1, parts=2, interleaved=True)  # [E, dim, 2I] -> [E, dim, I]
    assert up.stored_shape((4, 8, 3)) == (4, 8, 6)
    assert up.last_dim(3, 1, 2) == (3, 6, 2)  # columns 3 and 5
    per_expert = TensorSource(("a", "b"), stacked=True, transpose=True)
    assert per_expert.stored_shape((2, 8, 3)) == (3, 8) and per_expert.rename is None
    assert TensorSource(("x",)).rename == "x"
    with pytest.raises(ValueError, match="stacked"):
        TensorSource(("a", "b"))
    with pytest.raises(ValueError, match="no stored tensor"):
        TensorSource(())

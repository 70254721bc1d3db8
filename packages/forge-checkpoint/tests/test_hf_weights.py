"""forge_checkpoint.hf_weights alone: a Hugging Face directory's tensor names and shapes from the
safetensors headers, the one-line refusals before any rank starts, and a load into a plain
(one-process) model that equals the saved values, tied tensors included."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from forge_checkpoint import (
    hf_weight_files,
    hf_weight_problems,
    hf_weight_shapes,
    load_hf_weights,
)
from forge_core import ForgeConfigError
from safetensors.torch import save_file


class Tied(nn.Module):
    """A model whose head shares the embedding's weight (as transformers ties it)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def _save(directory: Path, tensors: dict[str, torch.Tensor], split: bool = False) -> None:
    """``tensors`` as one model.safetensors, or (``split``) one file per tensor with an index."""
    if not split:
        save_file(tensors, directory / "model.safetensors")
        return
    weight_map = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        file = f"model-{i:05d}.safetensors"
        save_file({name: t}, directory / file)
        weight_map[name] = file
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _stored(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(10, 4, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(4, generator=g),
        "norm.bias": torch.randn(4, generator=g),
    }


@pytest.mark.parametrize("split", [False, True], ids=["one file", "index"])
def test_a_load_fills_every_tensor_and_the_tied_head(tmp_path, split):
    stored = _stored()
    _save(tmp_path, stored, split)
    assert hf_weight_shapes(tmp_path) == {
        "embed.weight": (10, 4),
        "norm.weight": (4,),
        "norm.bias": (4,),
    }
    assert len(set(hf_weight_files(tmp_path).values())) == (3 if split else 1)
    model = Tied()
    load_hf_weights(model, tmp_path)
    assert model.embed.weight.dtype == torch.float32  # converted to the parameter's dtype
    torch.testing.assert_close(model.embed.weight, stored["embed.weight"].float(), rtol=0, atol=0)
    torch.testing.assert_close(model.norm.bias, stored["norm.bias"], rtol=0, atol=0)
    assert model.head.weight is model.embed.weight


def test_mismatches_are_one_line_each_naming_the_directory(tmp_path):
    stored = _stored()
    stored["extra.weight"] = torch.zeros(2)
    stored["norm.bias"] = torch.zeros(5)
    del stored["norm.weight"]
    _save(tmp_path, stored)
    expected = {
        "embed.weight": (10, 4),
        "norm.weight": (4,),
        "norm.bias": (4,),
        "head.weight": (10, 4),
    }
    problems = hf_weight_problems(expected, tmp_path, tied=["head.weight"])
    assert len(problems) == 3 and all(str(tmp_path) in p and "\n" not in p for p in problems)
    assert "lack 1 tensor(s) the model has (norm.weight)" in problems[0]
    assert "hold 1 tensor(s) the model does not have (extra.weight)" in problems[1]
    assert "norm.bias [5] (model: [4])" in problems[2]
    with pytest.raises(ForgeConfigError, match="lack 1 tensor"):
        load_hf_weights(Tied(), tmp_path)


def test_an_untied_head_missing_from_the_files_is_refused(tmp_path):
    _save(tmp_path, _stored())
    model = Tied()
    model.head.weight = nn.Parameter(torch.zeros(10, 4))  # no longer the embedding's
    with pytest.raises(ForgeConfigError, match=r"lack 1 tensor\(s\) the model has \(head.weight\)"):
        load_hf_weights(model, tmp_path)


def test_a_directory_without_weights_and_broken_files_are_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (problem,) = hf_weight_problems({"a": (1,)}, tmp_path)
    assert "no model.safetensors or model.safetensors.index.json" in problem
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ForgeConfigError, match="not a readable safetensors file"):
        hf_weight_shapes(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    index = {"weight_map": {"a": "../outside.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ForgeConfigError, match="not a file in"):
        hf_weight_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("not json")
    with pytest.raises(ForgeConfigError, match="not a readable safetensors index"):
        hf_weight_files(tmp_path)


def test_per_expert_weights_for_stacked_experts_are_refused_by_name(tmp_path):
    """transformers 5 stacks an MoE block's experts in memory while its files hold them one by
    one; until forge maps them, the refusal says so instead of listing names."""
    tensors = {f"mlp.experts.{e}.up_proj.weight": torch.zeros(2, 3) for e in range(2)}
    _save(tmp_path, tensors)
    (problem,) = hf_weight_problems({"mlp.experts.gate_up_proj": (2, 4, 3)}, tmp_path)
    assert "hold experts one by one (mlp.experts.0.up_proj.weight, ...)" in problem
    assert "not supported yet" in problem and "\n" not in problem

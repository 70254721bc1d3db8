"""forge_checkpoint alone, tensors with a source (forge_core.tensor_source): a model whose stacked
experts the files hold one by one, or fused, is filled exactly; a shard's box maps onto the
stored slices it reads; a source's missing or misshapen stored tensor is one line. The sharded
load of Hugging Face MoE models through forge: tests/integration/checkpoint/
test_hf_moe_weights_in.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from forge_checkpoint import hf_weight_problems, load_hf_weights
from forge_checkpoint.hf_sourced import stored_slices
from forge_core import ForgeConfigError
from forge_core.tensor_source import TensorSource
from safetensors.torch import save_file

E, DIM, HIDDEN = 3, 4, 5


class Stacked(nn.Module):
    """Stacked experts ``[E, dim, hidden]`` (gate, up) and ``[E, hidden]`` biases, a renamed
    router and a bias that no file holds."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.full((E, DIM, HIDDEN), float("nan")))
        self.w3 = nn.Parameter(torch.full((E, DIM, HIDDEN), float("nan")))
        self.b3 = nn.Parameter(torch.full((E, HIDDEN), float("nan")))
        self.router = nn.Linear(DIM, E, bias=False)
        self.register_buffer("expert_bias", torch.full((E,), float("nan")))


def _files(directory: Path) -> dict[str, torch.Tensor]:
    """Per-expert gate weights ``[hidden, dim]``, a fused interleaved up ``[E, dim, 2 hidden]``
    and its bias, and the router under another name."""
    g = torch.Generator().manual_seed(0)
    tensors = {f"experts.{e}.gate.weight": torch.randn(HIDDEN, DIM, generator=g) for e in range(E)}
    tensors["fused"] = torch.randn(E, DIM, 2 * HIDDEN, generator=g)
    tensors["fused_bias"] = torch.randn(E, 2 * HIDDEN, generator=g)
    tensors["gate.weight"] = torch.randn(E, DIM, generator=g).to(torch.bfloat16)
    save_file(tensors, directory / "model.safetensors")
    return tensors


SOURCES = {
    "w1": TensorSource(
        tuple(f"experts.{e}.gate.weight" for e in range(E)), stacked=True, transpose=True
    ),
    "w3": TensorSource(("fused",), part=1, parts=2, interleaved=True),
    "b3": TensorSource(("fused_bias",), part=1, parts=2, interleaved=True),
    "router.weight": TensorSource(("gate.weight",)),
    "expert_bias": TensorSource((), constant=0.0),
}


def test_a_load_with_sources_stacks_slices_and_renames(tmp_path):
    stored = _files(tmp_path)
    model = Stacked()
    load_hf_weights(model, tmp_path, sources=SOURCES)
    experts = [stored[f"experts.{e}.gate.weight"].T for e in range(E)]
    assert torch.equal(model.w1, torch.stack(experts))
    assert torch.equal(model.w3, stored["fused"][..., 1::2])
    assert torch.equal(model.b3, stored["fused_bias"][..., 1::2])
    assert torch.equal(model.router.weight, stored["gate.weight"].float())
    assert torch.equal(model.expert_bias, torch.zeros(E))


def test_a_shards_box_reads_only_its_experts_rows_and_columns():
    per_expert, fused = SOURCES["w1"], SOURCES["w3"]
    # experts 1..2, dim rows 0..4, hidden columns 2..4 of w1 [E, dim, hidden]: per expert, the
    # stored [hidden, dim] rows 2..4 and all its columns (the expert itself picks the tensor)
    assert stored_slices(per_expert, (E, DIM, HIDDEN), (2, DIM, 2), (1, 0, 2)) == (
        (slice(2, 4), slice(0, DIM)),
        1,
    )
    # the same box of w3: the fused tensor's experts 1..2, and its columns 5, 7 (every second)
    assert stored_slices(fused, (E, DIM, HIDDEN), (2, DIM, 2), (1, 0, 2)) == (
        (slice(1, 3), slice(0, DIM), slice(5, 8)),
        2,
    )


def test_a_sources_missing_or_misshapen_stored_tensor_is_one_line(tmp_path):
    stored = _files(tmp_path)
    expected = {n: tuple(t.shape) for n, t in Stacked().state_dict().items()}
    problems = hf_weight_problems({**expected, "b3": (E, HIDDEN + 1)}, tmp_path, sources=SOURCES)
    (line,) = problems
    assert "fused_bias [3, 10] (model: [3, 12], for b3)" in line and "\n" not in line
    del stored["experts.2.gate.weight"]
    save_file(stored, tmp_path / "model.safetensors")
    (line,) = hf_weight_problems(expected, tmp_path, sources=SOURCES)
    assert "lack 1 tensor(s) the model has (experts.2.gate.weight)" in line and "\n" not in line
    with pytest.raises(ForgeConfigError, match="lack 1 tensor"):
        load_hf_weights(Stacked(), tmp_path, sources=SOURCES)

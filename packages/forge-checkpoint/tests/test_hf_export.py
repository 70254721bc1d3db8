"""forge_checkpoint.hf_export: a Hugging Face model's tensors written back as a Hugging Face
directory, shard by shard, that transformers loads; nothing forge did not write is replaced."""

from __future__ import annotations

import json
import os

import pytest
import torch
from forge_checkpoint import export_hf_model
from forge_checkpoint.hf_export import shard_plan
from forge_core import ForgeConfigError

transformers = pytest.importorskip("transformers")


def _model(directory):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text("{}")  # carried along as it is
    return model


def _export(model, source, out, max_shard_bytes):
    state = model.state_dict()
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in state.items()}
    asked = []

    def fill(tensors):
        asked.append(sorted(tensors))
        for name, tensor in tensors.items():
            tensor.copy_(state[name])

    return export_hf_model(shapes, fill, source, out, max_shard_bytes=max_shard_bytes), asked


def test_shard_plan_groups_in_order_up_to_the_limit():
    f32 = torch.float32
    shapes = {"a": ((4,), f32), "b": ((4,), f32), "c": ((8,), f32), "d": ((1,), f32)}
    assert shard_plan(shapes, 32) == [["a", "b"], ["c"], ["d"]]
    assert shard_plan(shapes, 16) == [["a"], ["b"], ["c"], ["d"]]  # c alone exceeds: own shard
    with pytest.raises(ForgeConfigError, match="max_shard_bytes"):
        shard_plan(shapes, 0)


def test_sharded_export_loads_with_from_pretrained_one_shard_at_a_time(tmp_path):
    model = _model(tmp_path / "src")
    out, asked = _export(model, tmp_path / "src", tmp_path / "out", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(asked) > 2  # one fill per shard, never the whole model
    assert all(len(names) < len(model.state_dict()) for names in asked)
    assert (out / "tokenizer_config.json").read_text() == "{}"
    mask = os.umask(0o022)
    os.umask(mask)
    assert all((out / f).stat().st_mode & 0o777 == 0o666 & ~mask for f in files)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokens = torch.arange(12)[None]
    torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, rtol=0, atol=0)


def test_export_replaces_only_its_own_unchanged_files(tmp_path):
    model = _model(tmp_path / "src")
    out, _ = _export(model, tmp_path / "src", tmp_path / "out", max_shard_bytes=10**9)
    _export(model, tmp_path / "src", out, max_shard_bytes=10**9)  # again: forge's own files
    (out / "config.json").write_text("{}")  # someone edited it
    with pytest.raises(ForgeConfigError, match="config.json"):
        _export(model, tmp_path / "src", out, max_shard_bytes=10**9)
    (out / "config.json").unlink()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "tokenizer_config.json").write_text('{"mine": 1}')
    with pytest.raises(ForgeConfigError, match="tokenizer_config.json"):
        _export(model, tmp_path / "src", foreign, max_shard_bytes=10**9)
    assert (foreign / "tokenizer_config.json").read_text() == '{"mine": 1}'


def test_a_new_shard_count_leaves_no_stale_weights_behind(tmp_path):
    model = _model(tmp_path / "src")
    out, _ = _export(model, tmp_path / "src", tmp_path / "out", max_shard_bytes=20_000)
    sharded = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(sharded) > 2
    _export(model, tmp_path / "src", out, max_shard_bytes=10**9)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    (out / "notes.txt").write_text("mine")  # not forge's: never touched
    _export(model, tmp_path / "src", out, max_shard_bytes=20_000)
    assert not (out / "model.safetensors").exists() and (out / "notes.txt").read_text() == "mine"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)


def test_stored_layout_is_the_inverse_of_reading_with_sources(tmp_path):
    """Per-expert transposed tensors and an interleaved fused one, read into stacked targets
    with their sources, then written back with stored_layout: the same tensors, bit for bit."""
    from forge_checkpoint.hf_export import stored_layout
    from forge_checkpoint.hf_sourced import read_sourced
    from forge_core.tensor_source import TensorSource
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    stored = {f"e.{i}.gate": torch.randn(6, 4, generator=g) for i in range(3)}
    stored["fused"] = torch.randn(3, 4, 10, generator=g)  # [E, in, 2 x out] interleaved
    stored["plain"] = torch.randn(5, generator=g)
    save_file(stored, tmp_path / "w.safetensors")
    sources = {
        "w1": TensorSource(tuple(f"e.{i}.gate" for i in range(3)), stacked=True, transpose=True),
        "a": TensorSource(("fused",), part=0, parts=2, interleaved=True),
        "b": TensorSource(("fused",), part=1, parts=2, interleaved=True),
        "renamed": TensorSource(("plain",)),
    }
    targets = {
        "w1": torch.empty(3, 4, 6),
        "a": torch.empty(3, 4, 5),
        "b": torch.empty(3, 4, 5),
        "renamed": torch.empty(5),
    }
    read_sourced(targets, sources, dict.fromkeys(stored, tmp_path / "w.safetensors"))
    torch.testing.assert_close(targets["w1"][1], stored["e.1.gate"].T, rtol=0, atol=0)
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in targets.items()}

    def fill(tensors):
        for name, tensor in tensors.items():
            tensor.copy_(targets[name])

    layout, fill_stored = stored_layout(shapes, sources, fill)
    assert layout == {n: (tuple(t.shape), t.dtype) for n, t in stored.items()}
    back = {n: torch.empty(s, dtype=d) for n, (s, d) in layout.items()}
    fill_stored(back)
    for name, tensor in stored.items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0)

"""forge_checkpoint.export: forge <-> Hugging Face Llama parity (logits and bits), refusals, safetensors."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from checkpoint_places import read_only_dir
from forge_checkpoint.export import (
    HF_FILES,
    check_output,
    export_hf_llama,
    from_hf_llama,
    hf_llama_config,
    load_safetensors,
    save_safetensors,
    to_hf_llama,
)
from forge_core import ForgeConfigError, ModelConfig, Transformer
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

# A non-default RoPE theta checks that it reaches the HF config.
CFG = ModelConfig.preset("debug", rope_theta=500000.0)
TIED = ModelConfig.preset("debug_tied")


def _forge(cfg: ModelConfig, seed: int = 0) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(seed)
    return model.eval()


def _hf(cfg: ModelConfig, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(hf_llama_config(cfg)).eval()


def _tokens(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))


def _assert_same_logits(forge_model: Transformer, hf_model, cfg: ModelConfig) -> None:
    tokens = _tokens(cfg)
    with torch.no_grad():
        ours = forge_model(tokens)
        theirs = hf_model(tokens).logits
    assert ours.shape == theirs.shape == (2, 48, cfg.vocab_size)
    assert (ours - theirs).abs().max() <= 1e-5 * ours.abs().max()


def _forge_from(state: dict[str, torch.Tensor], cfg: ModelConfig) -> Transformer:
    """A meta-built forge model loaded from ``state`` (RoPE tables recomputed)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.reset_rope()
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["untied", "tied"])
def test_forge_to_hf_gives_the_same_logits(cfg):
    ours = _forge(cfg)
    hf = transformers.LlamaForCausalLM(hf_llama_config(cfg)).eval()
    hf.load_state_dict(to_hf_llama(ours.state_dict(), cfg), strict=True)
    if cfg.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    _assert_same_logits(ours, hf, cfg)


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["untied", "tied"])
def test_export_hf_llama_loads_with_from_pretrained(cfg, tmp_path):
    ours = _forge(cfg)
    out = export_hf_llama(ours.state_dict(), cfg, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        out, local_files_only=True, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    hf.eval()
    assert hf.dtype == torch.float32
    assert hf.config.tie_word_embeddings == cfg.tie_embeddings
    _assert_same_logits(ours, hf, cfg)
    # The file holds HF names, a tied head once (as HF writes it); it reads back into forge.
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not cfg.tie_embeddings)  # noqa: SIM118
    on_disk = load_safetensors(out / "model.safetensors")
    back = from_hf_llama(on_disk, cfg)
    for name, t in ours.state_dict().items():
        assert torch.equal(back[name], t), name


def test_export_keeps_the_weights_dtype(tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in _forge(CFG).state_dict().items()}
    export_hf_llama(state, CFG, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert hf.dtype == torch.bfloat16
    assert torch.equal(
        hf.model.layers[1].mlp.down_proj.weight, state["layers.1.feed_forward.w2.weight"]
    )


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_exported_files_get_an_ordinary_mode_under_the_umask(tmp_path, umask):
    """safetensors' writer creates 0600 files; an export is for others to read (0644 under the
    usual umask 022), and a stricter umask still rules."""
    before = os.umask(umask)
    try:
        export_hf_llama(_forge(CFG).state_dict(), CFG, tmp_path)
    finally:
        os.umask(before)
    modes = {name: (tmp_path / name).stat().st_mode & 0o777 for name in HF_FILES}
    assert modes == dict.fromkeys(HF_FILES, 0o666 & ~umask), {k: oct(v) for k, v in modes.items()}


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["untied", "tied"])
def test_hf_to_forge_gives_the_same_logits_and_round_trips_bitwise(cfg):
    hf = _hf(cfg, seed=3)
    hf_state = hf.state_dict()
    ours = _forge_from(from_hf_llama(hf_state, cfg), cfg)
    _assert_same_logits(ours, hf, cfg)
    again = to_hf_llama(from_hf_llama(hf_state, cfg), cfg)
    assert again.keys() == hf_state.keys()
    assert all(torch.equal(again[k], hf_state[k]) for k in hf_state)
    forge_state = _forge(cfg, seed=5).state_dict()
    back = from_hf_llama(to_hf_llama(forge_state, cfg), cfg)
    assert back.keys() == forge_state.keys()
    for k, t in forge_state.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k


def test_tied_checkpoint_without_lm_head_loads_and_shares_the_embedding():
    hf_state = _hf(TIED).state_dict()
    del hf_state["lm_head.weight"]  # how HF writes a tied checkpoint
    state = from_hf_llama(hf_state, TIED)
    assert state["output.weight"] is state["tok_embeddings.weight"]
    model = _forge_from(state, TIED)
    assert model.output.weight is model.tok_embeddings.weight


def test_tied_config_refuses_a_head_that_differs_from_the_embedding():
    state = _forge(CFG).state_dict()  # untied weights
    with pytest.raises(ForgeConfigError, match="tie_embeddings=False"):
        to_hf_llama(state, TIED)


class _MoEShaped(ModelConfig):
    """A config naming a block whose FFN slot holds another module (as forge-moe-ep's
    MoEModelConfig does), without importing another layer."""

    @property
    def custom_ffn_layers(self) -> tuple[int, ...]:
        return (1,)


def test_moe_config_is_refused():
    moe = _MoEShaped(**dataclasses.asdict(CFG))
    for fn in (lambda: to_hf_llama({}, moe), lambda: from_hf_llama({}, moe)):
        with pytest.raises(ForgeConfigError, match="no MoE layer.*moe_every=0"):
            fn()
    with pytest.raises(ForgeConfigError, match="MoE"):
        hf_llama_config(moe)


def test_missing_unexpected_and_misshapen_keys_are_refused():
    state = _forge(CFG).state_dict()
    del state["layers.1.feed_forward.w3.weight"]
    with pytest.raises(ForgeConfigError, match=r"missing \['layers.1.feed_forward.w3.weight'\]"):
        to_hf_llama(state, CFG)
    hf_state = _hf(CFG).state_dict()
    hf_state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(
        ForgeConfigError, match="unexpected.*layers.2.mlp.up_proj.*same ModelConfig"
    ):
        from_hf_llama(hf_state, CFG)
    with pytest.raises(ForgeConfigError, match="shape"):
        to_hf_llama(_forge(CFG).state_dict(), ModelConfig.preset("debug", ffn_dim=192))
    with pytest.raises(ForgeConfigError, match="missing"):  # untied config, tied weights
        to_hf_llama(
            {k: v for k, v in _forge(TIED).state_dict().items() if k != "output.weight"}, CFG
        )


def test_safetensors_round_trip_is_bitwise_and_keeps_tied_tensors(tmp_path):
    base = torch.randn(8, 6)
    state = {
        "a": base,
        "tied": base,  # the same tensor under a second name
        "b16": torch.randn(3, 5).to(torch.bfloat16),
        "strided": torch.randn(6, 4).t(),  # non-contiguous
        "slice": base[2:4],  # a view into shared storage
        "ints": torch.arange(7, dtype=torch.int64),
    }
    path = tmp_path / "sd.safetensors"
    save_safetensors(state, path, metadata={"step": "7"})
    back = load_safetensors(path)
    assert back.keys() == state.keys()
    for k, t in state.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    assert back["tied"] is back["a"]
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["a", "b16", "ints", "slice", "strided"]
        assert f.metadata()["step"] == "7" and f.metadata()["format"] == "pt"


def test_safetensors_refuses_meta_tensors(tmp_path):
    with pytest.raises(ForgeConfigError, match="full state dict"):
        save_safetensors({"w": torch.empty(2, device="meta")}, tmp_path / "x.safetensors")


def test_transformers_stays_optional(monkeypatch):
    import ast
    import sys

    import forge_checkpoint.export

    tree = ast.parse(Path(forge_checkpoint.export.__file__).read_text())
    top_level = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not {m for m in top_level if m and m.split(".")[0] == "transformers"}
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ForgeConfigError, match="pip install 'transformers"):
        hf_llama_config(CFG)


# --------------------------------------------------------------------- where an export may go


def test_save_safetensors_overwrites_its_own_file_but_not_a_foreign_one(tmp_path):
    path = tmp_path / "model.safetensors"
    save_safetensors({"w": torch.zeros(2)}, path)
    save_safetensors({"w": torch.ones(2)}, path)  # forge's own file: replaced
    assert torch.equal(load_safetensors(path)["w"], torch.ones(2))
    foreign = tmp_path / "theirs.safetensors"
    foreign.write_bytes(b"not forge's")
    with pytest.raises(ForgeConfigError, match="theirs.safetensors' exists and forge did not"):
        save_safetensors({"w": torch.ones(2)}, foreign)
    assert foreign.read_bytes() == b"not forge's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "theirs.safetensors"]


def test_export_hf_llama_keeps_other_files_and_refuses_files_it_did_not_write(tmp_path):
    state = _forge(CFG).state_dict()
    (tmp_path / "README.md").write_text("the user's")
    export_hf_llama(state, CFG, tmp_path)
    export_hf_llama(state, CFG, tmp_path)  # its own two files: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", *sorted(HF_FILES)]
    assert (tmp_path / "README.md").read_text() == "the user's"
    config = tmp_path / "config.json"
    config.write_text(config.read_text() + " ")  # edited since forge wrote it: the user's now
    with pytest.raises(ForgeConfigError, match="holds 'config.json', which forge did not write"):
        export_hf_llama(state, CFG, tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"someone else's weights")
    with pytest.raises(ForgeConfigError, match="holds 'model.safetensors', which forge did not"):
        export_hf_llama(state, CFG, other)
    assert (other / "model.safetensors").read_bytes() == b"someone else's weights"
    assert sorted(p.name for p in other.iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize(
    "case",
    ["folder for a file", "file for a folder", "file as a parent", "NUL", "long name", "link"],
)
def test_check_output_refuses_a_path_that_cannot_take_the_export(tmp_path, case):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere.safetensors")
    path, folder, said = {
        "folder for a file": (tmp_path, False, "is a folder, but the export is one file"),
        "file for a folder": (tmp_path / "a-file", True, "is a file, but a Hugging Face export"),
        "file as a parent": (tmp_path / "a-file" / "m.safetensors", False, "is a file, not a"),
        "NUL": (f"{tmp_path}/m\0.safetensors", False, "contains a NUL byte"),
        "long name": (tmp_path / ("m" * 300), False, "name of 300 bytes .*, over this filesystem"),
        "link": (tmp_path / "link", False, "is a symbolic link"),
    }[case]
    with pytest.raises(ForgeConfigError, match=f"^--out.*{said}"):
        check_output(path, folder=folder, name="--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "link"]


def test_check_output_refuses_a_location_it_cannot_write(tmp_path):
    folder = read_only_dir(tmp_path)
    for path, is_folder in [(folder / "m.safetensors", False), (folder / "hf" / "x", True)]:
        with pytest.raises(ForgeConfigError, match="cannot write in .*choose a writable location"):
            check_output(path, folder=is_folder, name="--out")

"""The reference Transformer: shapes, causality, GQA, deterministic init, tying, meta build."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from forge_core import ForgeConfigError, ModelConfig, Transformer, TransformerBlock
from forge_core.model import apply_rope

CFG = ModelConfig.preset("debug")


def _model(cfg: ModelConfig = CFG, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        m = Transformer(cfg)
    m.to_empty(device="cpu")
    m.init_weights(seed)
    return m


def test_documented_module_names_exist():
    names = dict(_model().named_modules())
    for name in [
        "tok_embeddings",
        "layers.0.attention.wq",
        "layers.1.attention.wo",
        "layers.0.feed_forward.w1",
        "layers.0.feed_forward.w2",
        "layers.0.feed_forward.w3",
        "layers.0.attention_norm",
        "layers.0.ffn_norm",
        "norm",
        "output",
    ]:
        assert name in names
    assert isinstance(names["layers"], nn.ModuleDict)


def test_forward_shape_and_causality():
    m = _model()
    tokens = torch.randint(0, CFG.vocab_size, (2, 12))
    logits = m(tokens)
    assert logits.shape == (2, 12, CFG.vocab_size)
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % CFG.vocab_size
    torch.testing.assert_close(m(changed)[:, :8], logits[:, :8], rtol=0, atol=0)
    assert not torch.allclose(m(changed)[:, 8:], logits[:, 8:])


def test_grouped_query_attention_matches_explicit_head_repeat():
    m = _model()
    attn = m.layers["0"].attention
    x = torch.randn(2, 10, CFG.dim)
    cos, sin = m.rope_cos[:10], m.rope_sin[:10]
    q = apply_rope(attn.wq(x).view(2, 10, CFG.n_heads, -1), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(2, 10, CFG.n_kv_heads, -1), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(2, 10, CFG.n_kv_heads, -1).transpose(1, 2)
    rep = CFG.n_heads // CFG.n_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / CFG.head_dim**0.5
    scores = scores.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.wo((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 10, -1))
    torch.testing.assert_close(attn(x, cos, sin), expected)


def test_meta_build_allocates_nothing_and_materializes_like_a_cpu_build():
    with torch.device("meta"):
        meta = Transformer(CFG)
    assert all(p.is_meta for p in meta.parameters())
    direct = Transformer(CFG)
    direct.init_weights(7)
    meta.to_empty(device="cpu")
    meta.init_weights(7)
    for (n, a), (_, b) in zip(direct.named_parameters(), meta.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert torch.equal(direct.rope_cos, meta.rope_cos)


def test_init_depends_on_seed_and_name_only():
    a, b, c = _model(seed=1), _model(seed=1), _model(seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)
    assert torch.equal(a.norm.weight, torch.ones(CFG.dim))
    # output projections are scaled down by depth
    assert a.layers["0"].attention.wo.weight.std() < a.layers["0"].attention.wq.weight.std()


def test_tied_embeddings_survive_meta_materialization():
    m = _model(ModelConfig.preset("debug_tied"))
    assert m.output.weight is m.tok_embeddings.weight
    assert sum(p.numel() for p in m.parameters()) == m.config.num_params()


def test_num_params_matches_the_module():
    assert sum(p.numel() for p in _model().parameters()) == CFG.num_params()


class _ScaledFFN(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def init_weights(self, seed: int) -> None:
        with torch.no_grad():
            self.scale.fill_(0.5)


def test_ffn_slot_accepts_any_module_and_its_own_init():
    m = Transformer(CFG)
    m.layers["0"] = TransformerBlock(CFG, feed_forward=_ScaledFFN(CFG.dim))
    m.init_weights(0)
    assert torch.equal(m.layers["0"].feed_forward.scale, torch.full((CFG.dim,), 0.5))
    assert m(torch.randint(0, CFG.vocab_size, (1, 4))).shape == (1, 4, CFG.vocab_size)


def test_too_long_sequence_is_a_clear_error():
    with pytest.raises(
        ForgeConfigError, match=r"sequence length 129 exceeds model\.max_seq_len=128"
    ):
        _model()(torch.zeros(1, 129, dtype=torch.long))


def test_given_positions_beyond_the_rotary_tables_is_a_clear_error_not_an_index_error():
    tokens = torch.zeros(1, 129, dtype=torch.long)
    with pytest.raises(ForgeConfigError, match=r"sequence length 129 exceeds model\.max_seq_len"):
        _model()(tokens, positions=torch.arange(129))


def test_a_model_built_on_the_cpu_computes_its_rotary_tables_at_construction():
    built = Transformer(CFG)  # no init_weights: the tables must not be torch.empty's leftovers
    reference = _model()
    assert torch.equal(built.rope_cos, reference.rope_cos)
    assert torch.equal(built.rope_sin, reference.rope_sin)


@pytest.mark.parametrize("fresh", ["built on the cpu", "to_empty from meta"])
def test_saved_weights_loaded_into_a_fresh_model_give_the_saved_logits(tmp_path, fresh):
    from safetensors.torch import load_file, save_file

    saved = _model(seed=3)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in saved.state_dict().items()}, path)
    if fresh == "built on the cpu":
        model = Transformer(CFG)
    else:
        with torch.device("meta"):
            model = Transformer(CFG)
        model.to_empty(device="cpu")  # the tables hold whatever memory torch.empty found
        model.rope_cos.fill_(float("nan"))
    missing, unexpected = model.load_state_dict(load_file(path), strict=False)
    assert missing == [] and unexpected == []  # the tables are not in a checkpoint
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, saved(tokens))

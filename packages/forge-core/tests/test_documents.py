"""Packed documents in forge's Transformer: attention stays inside each document."""

from __future__ import annotations

import pytest
import torch
from forge_core import ModelConfig, Transformer
from forge_core.documents import Documents, document_mask, position_problem

CFG = ModelConfig.preset("debug")


def _model(seed: int = 0) -> Transformer:
    with torch.device("meta"):
        m = Transformer(CFG)
    m.to_empty(device="cpu")
    m.init_weights(seed)
    return m.double()


def _packed(lengths: list[int]) -> torch.Tensor:
    """Positions ``[1, sum(lengths)]`` of documents of these lengths packed in one row."""
    return torch.cat([torch.arange(n) for n in lengths])[None]


def test_packed_documents_equal_each_document_alone():
    m = _model()
    lengths = [5, 1, 7, 3]
    tokens = torch.randint(0, CFG.vocab_size, (1, sum(lengths)))
    packed = m(tokens, positions=_packed(lengths))
    at = 0
    for n in lengths:
        alone = m(tokens[:, at : at + n])
        torch.testing.assert_close(packed[:, at : at + n], alone, rtol=1e-12, atol=1e-12)
        at += n


def test_changing_one_document_changes_no_other_logits():
    m = _model()
    lengths = [6, 4, 6]
    positions = _packed(lengths).expand(2, -1)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 6:10] = (changed[:, 6:10] + 1) % CFG.vocab_size  # the middle document only
    a, b = m(tokens, positions=positions), m(changed, positions=positions)
    assert torch.equal(a[:, :6], b[:, :6]) and torch.equal(a[:, 10:], b[:, 10:])
    assert not torch.allclose(a[:, 6:10], b[:, 6:10])


def test_one_document_per_row_is_plain_causal_attention():
    m = _model()
    tokens = torch.randint(0, CFG.vocab_size, (2, 12))
    whole = torch.arange(12).expand(2, -1)
    torch.testing.assert_close(m(tokens, positions=whole), m(tokens), rtol=1e-12, atol=1e-12)


def test_rows_with_different_documents_and_gradients():
    m = _model()
    tokens = torch.randint(0, CFG.vocab_size, (2, 10))
    positions = torch.cat([_packed([4, 6]), _packed([10])])
    m(tokens, positions=positions).sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    (m(tokens[:1, :4]).sum() + m(tokens[:1, 4:]).sum() + m(tokens[1:]).sum()).backward()
    for name, p in m.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-10, atol=1e-12)


def test_mask_rule_with_a_window_and_an_order_of_its_own():
    starts = torch.tensor([[0, 0, 0, 3, 3, 3]])
    docs = Documents(torch.arange(6), starts)
    mask = document_mask(docs, slice(None), window=2)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    order = torch.tensor([5, 0, 3, 1, 4, 2])  # the same tokens held in another order
    shuffled = document_mask(Documents(order, starts[:, order]), slice(None), window=2)[0, 0]
    assert torch.equal(shuffled, expected[order][:, order])


@pytest.mark.parametrize(
    ("positions", "problem"),
    [
        ([[0, 1, 2, 0, 1]], None),
        ([[1, 2, 3]], "start each row at 0"),
        ([[0, 1, 3]], "count up by one"),
        ([[0.0, 1.0]], "integers"),
    ],
)
def test_position_problems(positions, problem):
    got = position_problem(torch.tensor(positions))
    assert got is None if problem is None else problem in got


def test_a_kernel_that_cannot_mask_documents_is_refused():
    from forge_core import ForgeConfigError
    from forge_core.contracts import set_attention_kernel

    m = _model()
    calls = []

    def plain_kernel(q, k, v, *, enable_gqa):
        calls.append(q.shape)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=enable_gqa
        )

    for block in m.layers.values():
        set_attention_kernel(block.attention, plain_kernel)
    tokens = torch.randint(0, CFG.vocab_size, (1, 8))
    m(tokens)  # without documents the kernel runs
    assert calls
    with pytest.raises(
        ForgeConfigError, match="plain_kernel installed on Attention cannot keep attention"
    ):
        m(tokens, positions=_packed([4, 4]))


def test_every_layer_keeps_the_same_mask_for_backward():
    # SDPA turns a bool mask into a float one inside every call: each layer would keep its own
    # S x S copy for backward. The additive mask is made once and every layer saves it.
    m = _model()
    assert CFG.n_layers > 1
    S = 12
    tokens = torch.randint(0, CFG.vocab_size, (2, S))
    masks = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.shape[-2:] == (S, S):
            masks.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(tokens, positions=_packed([5, 7]).expand(2, -1)).sum().backward()
    assert len(masks) == 1

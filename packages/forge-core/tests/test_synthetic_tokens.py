"""forge_core.training.synthetic_tokens: the learnable bigram chains every parity run and
``forge train``'s synthetic data read, drawn without a loop over positions yet equal, bit for
bit, to the position-by-position definition (so parity records and resumed runs see the same
tokens as before)."""

from __future__ import annotations

import pytest
import torch
from forge_core.training import step_generator, synthetic_tokens


def _by_position(seed: int, steps: int, batch: int, seq_len: int, vocab: int, first: int = 0):
    """The definition: token t is a random token where the step's noise mask says so, else the
    fixed bigram successor of token t - 1."""
    next_token = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    tokens = torch.empty(steps, batch, seq_len + 1, dtype=torch.long)
    for i in range(steps):
        g = step_generator(seed, first + i)
        rows = tokens[i]
        rows[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        noise = torch.randint(0, vocab, rows.shape, generator=g)
        use_noise = torch.rand(rows.shape, generator=g) < 0.1
        for t in range(1, seq_len + 1):
            rows[:, t] = torch.where(use_noise[:, t], noise[:, t], next_token[rows[:, t - 1]])
    return tokens


@pytest.mark.parametrize(
    ("seed", "steps", "batch", "seq_len", "vocab", "first"),
    [(0, 3, 4, 32, 256, 0), (7, 2, 8, 2048, 32000, 5), (3, 1, 1, 1, 5, 0), (1, 2, 4, 0, 10, 2)],
)
def test_the_chains_equal_the_position_by_position_definition(
    seed, steps, batch, seq_len, vocab, first
):
    expected = _by_position(seed, steps, batch, seq_len, vocab, first)
    got = synthetic_tokens(seed, steps, batch, seq_len, vocab, first_step=first)
    assert got.dtype == torch.long and torch.equal(got, expected)


def test_steps_drawn_one_at_a_time_equal_steps_drawn_together():
    together = synthetic_tokens(4, 3, 2, 64, 100)
    alone = torch.cat([synthetic_tokens(4, 1, 2, 64, 100, first_step=s) for s in range(3)])
    assert torch.equal(together, alone)

"""Synthetic vision-language batches: learnable text with a block of image placeholders, and
random images (forge train's synthetic VLM data and the VLM parity tests)."""

from __future__ import annotations

import torch
from forge_core.errors import ForgeConfigError
from forge_core.training import step_generator, synthetic_tokens

__all__ = ["synthetic_vlm_batch"]


def synthetic_vlm_batch(
    seed: int,
    steps: int,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    *,
    image_token_id: int,
    image_tokens: int,
    image_shape: tuple[int, int, int],
    first_step: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable token ids ``[steps, B, S+1]`` with an image block, and images ``[steps, B, C, H, W]``.

    Text comes from :func:`synthetic_tokens` with ``image_token_id`` left out of the vocabulary.
    Each sample holds exactly ``image_tokens`` placeholder tokens in one run at a random offset
    in ``[1, S - image_tokens]``, so the input ``tokens[:, :-1]`` holds them all and every sample
    has the same number of text targets (the placeholders are not predicted).
    """
    if not 0 < image_tokens < seq_len:
        raise ForgeConfigError(
            f"{image_tokens} image tokens do not fit in a sequence of {seq_len} with text around them"
        )
    tokens = synthetic_tokens(
        seed, steps, batch_size, seq_len, vocab_size - 1, first_step=first_step
    )
    tokens = tokens + (tokens >= image_token_id).long()  # skip the placeholder id
    pos = torch.arange(seq_len + 1)
    images = torch.empty(steps, batch_size, *image_shape)
    for i in range(steps):
        g = step_generator(seed + 1, first_step + i)
        start = torch.randint(1, seq_len - image_tokens + 1, (batch_size,), generator=g)
        in_block = (pos >= start[:, None]) & (pos < start[:, None] + image_tokens)
        tokens[i] = tokens[i].masked_fill(in_block, image_token_id)
        images[i] = torch.randn(batch_size, *image_shape, generator=g)
    return tokens, images

"""Training data for ``forge train``: synthetic batches or a memory-mapped token file.

Both sources are indexed by optimizer step, never by an iterator's hidden position: the batch of
step ``t`` is a pure function of (config, ``t``). A checkpoint therefore stores the data position
as one integer (the next step), and a run resumed under another layout (other data-parallel
degree) reads exactly the global batches the uninterrupted run would have read. Each rank
materializes only its data-parallel slice of a global batch.

Token file: a flat binary of token ids (no header) in ``data.dtype``. It is cut into windows of
``seq_len + 1`` tokens starting every ``seq_len`` tokens (the last token of a window is the first
of the next: every token is predicted once). Each pass over the file visits the windows in its
own seeded random order.
"""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from forge_core import ForgeConfigError
from forge_core.training import synthetic_tokens
from forge_vlm.data import synthetic_vlm_batch

from .config import ForgeConfig

__all__ = [
    "Batch",
    "FieldBatch",
    "StepData",
    "SyntheticData",
    "SyntheticFields",
    "TokenFile",
    "make_data",
]


@dataclass(frozen=True)
class Batch:
    """One rank's slice of a step's global batch: ``tokens [b, S+1]`` and VLM ``images``."""

    tokens: torch.Tensor
    images: torch.Tensor | None = None


@dataclass(frozen=True)
class FieldBatch:
    """One rank's slice of a field model's global batch: ``inputs`` and ``targets [b, C, H, W]``."""

    inputs: torch.Tensor
    targets: torch.Tensor


#: What a data source's ``batch(step)`` gives: token batches, or field batches for a field model.
BatchT = TypeVar("BatchT", Batch, FieldBatch)


class StepData(ABC, Generic[BatchT]):
    """Base: ``batch(step)`` gives this rank's slice ``[dp_rank]`` of the global batch of ``step``."""

    def __init__(self, global_batch: int, dp_rank: int, dp_size: int) -> None:
        if global_batch % dp_size:
            raise ForgeConfigError(
                f"training.global_batch_size={global_batch} is not divisible by the {dp_size} "
                f"data-parallel ranks; choose a multiple of {dp_size}"
            )
        self.global_batch = global_batch
        self.local_batch = global_batch // dp_size
        self.first = dp_rank * self.local_batch

    @abstractmethod
    def batch(self, step: int) -> BatchT:
        """This rank's slice of the global batch of optimizer step ``step``."""


class SyntheticData(StepData[Batch]):
    """Learnable synthetic token sequences (and images for a VLM); see ``synthetic_tokens``."""

    def __init__(
        self,
        cfg: ForgeConfig,
        dp_rank: int,
        dp_size: int,
        *,
        image_token_id: int | None = None,
        image_tokens: int = 0,
    ) -> None:
        t = cfg.training
        super().__init__(t.global_batch_size, dp_rank, dp_size)
        self.cfg = cfg
        self.image_token_id = image_token_id
        self.image_tokens = image_tokens

    def batch(self, step: int) -> Batch:
        t, rows = self.cfg.training, slice(self.first, self.first + self.local_batch)
        vocab = self.cfg.model.vocab_size
        if self.cfg.is_vlm:
            v = self.cfg.vision
            # ForgeConfig sets vision, adapter and vlm together; the VLM wrapper gives the id
            assert v is not None and self.image_token_id is not None
            tokens, images = synthetic_vlm_batch(
                t.seed,
                1,
                t.global_batch_size,
                t.seq_len,
                vocab,
                image_token_id=self.image_token_id,
                image_tokens=self.image_tokens,
                image_shape=(v.in_channels, v.image_size, v.image_size),
                first_step=step,
            )
            return Batch(tokens[0, rows], images[0, rows])
        tokens = synthetic_tokens(t.seed, 1, t.global_batch_size, t.seq_len, vocab, first_step=step)
        return Batch(tokens[0, rows])


class TokenFile(StepData[Batch]):
    """A flat binary token file, memory-mapped (read-only pages, copy-on-write: never written)."""

    def __init__(
        self,
        path: str,
        dtype: str,
        *,
        seq_len: int,
        global_batch: int,
        vocab_size: int,
        seed: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        super().__init__(global_batch, dp_rank, dp_size)
        if not os.path.isfile(path):
            raise ForgeConfigError(f"data.path={path!r} does not exist or is not a file")
        self.dtype = getattr(torch, dtype)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        size = os.path.getsize(path)
        if size % itemsize:
            raise ForgeConfigError(
                f"data.path={path!r} has {size} bytes, not a multiple of {itemsize} "
                f"(data.dtype={dtype!r}); is data.dtype right?"
            )
        n_tokens = size // itemsize
        self.n_windows = (n_tokens - 1) // seq_len
        if self.n_windows < 1:
            raise ForgeConfigError(
                f"data.path={path!r} holds {n_tokens} tokens, fewer than one sample of "
                f"training.seq_len + 1 = {seq_len + 1}"
            )
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.tokens = torch.frombuffer(self._map, dtype=self.dtype, count=n_tokens)
        self.path, self.seq_len, self.vocab_size, self.seed = path, seq_len, vocab_size, seed
        self._order: tuple[int, torch.Tensor] | None = None

    def _window(self, sample: int) -> int:
        epoch, index = divmod(sample, self.n_windows)
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._order = (epoch, torch.randperm(self.n_windows, generator=g))
        return int(self._order[1][index])

    def batch(self, step: int) -> Batch:
        first_sample = step * self.global_batch + self.first
        rows = []
        for sample in range(first_sample, first_sample + self.local_batch):
            start = self._window(sample) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + 1].to(torch.long))
        tokens = torch.stack(rows)
        top = int(tokens.max())
        if top >= self.vocab_size or int(tokens.min()) < 0:
            raise ForgeConfigError(
                f"data.path={self.path!r} holds token id {top} at step {step}, outside "
                f"model.vocab_size={self.vocab_size}; use the tokenizer's vocabulary size"
            )
        return Batch(tokens)


class SyntheticFields(StepData[FieldBatch]):
    """Random smooth fields and the same fields one step of a fixed dynamic later.

    Inputs: bilinear upsampling of coarse noise (a quarter of the resolution). Targets: an
    advection by one column east (periodic in width) mixed with a 3x3 diffusion stencil (zero
    beyond the top and bottom rows): a linear map that a stack of 3x3 convs can learn.
    """

    def __init__(self, cfg: ForgeConfig, dp_rank: int, dp_size: int) -> None:
        super().__init__(cfg.training.global_batch_size, dp_rank, dp_size)
        self.field, self.seed = cfg.field, cfg.training.seed

    def batch(self, step: int) -> FieldBatch:
        f = self.field
        assert f is not None  # make_data builds this source for a field config only
        g = torch.Generator().manual_seed((self.seed + 3) * 1_000_003 + step)
        coarse = torch.randn(
            self.global_batch, f.channels, -(-f.height // 4), -(-f.width // 4), generator=g
        )
        x = torch.nn.functional.interpolate(
            coarse, size=(f.height, f.width), mode="bilinear", align_corners=False
        )
        x = x[self.first : self.first + self.local_batch]
        stencil = torch.tensor([[0.0, 1.0, 0.0], [1.0, 4.0, 1.0], [0.0, 1.0, 0.0]]) / 8.0
        wrapped = torch.nn.functional.pad(x, (1, 1, 0, 0), mode="circular")
        diffused = torch.nn.functional.conv2d(
            wrapped.flatten(0, 1)[:, None], stencil[None, None], padding=(1, 0)
        ).view_as(x)
        return FieldBatch(x, 0.6 * torch.roll(x, 1, dims=-1) + 0.4 * diffused)


def make_data(
    cfg: ForgeConfig,
    dp_rank: int,
    dp_size: int,
    *,
    image_token_id: int | None = None,
    image_tokens: int = 0,
) -> StepData[Batch] | StepData[FieldBatch]:
    """The data source the config asks for: the token file at ``data.path``, else synthetic."""
    t = cfg.training
    if cfg.is_field:
        if cfg.data.path is not None:
            raise ForgeConfigError(
                "data.path with a field model: a token file holds no fields; leave data.path "
                "unset (synthetic fields)"
            )
        return SyntheticFields(cfg, dp_rank, dp_size)
    if cfg.data.path is None:
        return SyntheticData(
            cfg, dp_rank, dp_size, image_token_id=image_token_id, image_tokens=image_tokens
        )
    if cfg.is_vlm:
        raise ForgeConfigError(
            "data.path with a vision-language model: a token file holds no images; leave "
            "data.path unset (synthetic image-text data)"
        )
    return TokenFile(
        cfg.data.path,
        cfg.data.dtype,
        seq_len=t.seq_len,
        global_batch=t.global_batch_size,
        vocab_size=cfg.model.vocab_size,
        seed=t.seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )

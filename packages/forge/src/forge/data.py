"""Training data for ``forge train``: synthetic batches or a memory-mapped token file.

Both sources are indexed by optimizer step, never by an iterator's hidden position: the batch of
step ``t`` is a pure function of (config, ``t``). A checkpoint therefore stores the data position
as one integer (the next step), and a run resumed under another layout (other data-parallel
degree) reads exactly the global batches the uninterrupted run would have read. Each rank
materializes only its data-parallel slice of a global batch.

Token file: a flat binary of token ids (no header) in ``data.dtype``. It is cut into windows of
``seq_len + 1`` tokens starting every ``seq_len`` tokens (the last token of a window is the first
of the next: every token is predicted once). Each pass over the file visits the windows in its
own seeded random order. With ``data.eos_id``, the file is documents each ended by that id:
a window's ``positions`` restart at 0 after each EOS and the target that starts a document is
masked (:func:`document_positions`), as for packed text.
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
    "SyntheticVLMData",
    "TokenFile",
    "document_positions",
    "token_file_problems",
]


@dataclass(frozen=True)
class Batch:
    """One rank's slice of a step's global batch: ``tokens [b, S+1]`` and VLM ``images``.

    Packed text (:mod:`forge.text_data`), and a token file with ``data.eos_id``, add
    ``positions [b, S]``, each input token's position
    in its document (restarting at 0 where a document starts, so attention does not cross it),
    and ``loss_mask [b, S]``, whether the target ``tokens[:, 1:]`` counts in the loss (False
    across a document boundary, on padding, and in SFT on all but the assistant's tokens).
    """

    tokens: torch.Tensor
    images: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None


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
    """Learnable synthetic token sequences; see ``synthetic_tokens``."""

    def __init__(self, cfg: ForgeConfig, dp_rank: int, dp_size: int) -> None:
        t = cfg.training
        super().__init__(t.global_batch_size, dp_rank, dp_size)
        self.cfg = cfg

    def batch(self, step: int) -> Batch:
        t, rows = self.cfg.training, slice(self.first, self.first + self.local_batch)
        vocab = self.cfg.model.vocab_size
        tokens = synthetic_tokens(t.seed, 1, t.global_batch_size, t.seq_len, vocab, first_step=step)
        return Batch(tokens[0, rows].clone())  # NOTE: a view would keep the global batch


class SyntheticVLMData(SyntheticData):
    """Synthetic image-text data for a VLM: token sequences with ``image_tokens`` placeholders
    of ``image_token_id`` (the VLM wrapper's) and their images; see ``synthetic_vlm_batch``."""

    def __init__(
        self,
        cfg: ForgeConfig,
        dp_rank: int,
        dp_size: int,
        *,
        image_token_id: int,
        image_tokens: int,
    ) -> None:
        super().__init__(cfg, dp_rank, dp_size)
        self.image_token_id = image_token_id
        self.image_tokens = image_tokens

    def steps(self, first_step: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole global batches of ``steps`` steps from ``first_step``: token ids
        ``[steps, B, S+1]`` and images ``[steps, B, C, H, W]``."""
        t, v = self.cfg.training, self.cfg.vlm_sections()[0]
        return synthetic_vlm_batch(
            t.seed,
            steps,
            t.global_batch_size,
            t.seq_len,
            self.cfg.model.vocab_size,
            image_token_id=self.image_token_id,
            image_tokens=self.image_tokens,
            image_shape=(v.in_channels, v.image_size, v.image_size),
            first_step=first_step,
        )

    def batch(self, step: int) -> Batch:
        rows = slice(self.first, self.first + self.local_batch)
        tokens, images = self.steps(step, 1)
        # NOTE: copies: views would keep every rank's images alive through backward
        return Batch(tokens[0, rows].clone(), images[0, rows].clone())


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
        eos_id: int | None = None,
    ) -> None:
        super().__init__(global_batch, dp_rank, dp_size)
        if not os.path.isfile(path):
            raise ForgeConfigError(f"data.path={path!r} does not exist or is not a file")
        self.dtype = getattr(torch, dtype)
        problem = _length_problem(path, dtype, seq_len)
        if problem:
            raise ForgeConfigError(problem)
        n_tokens = os.path.getsize(path) // _WIDTH[dtype]
        self.n_windows = (n_tokens - 1) // seq_len
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.tokens = torch.frombuffer(self._map, dtype=self.dtype, count=n_tokens)
        self.path, self.seq_len, self.vocab_size, self.seed = path, seq_len, vocab_size, seed
        self.eos_id = eos_id
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
        # NOTE: the launcher scanned the whole file (token_file_problems); this catches a file
        # changed since, or a TokenFile made without the launcher, at the step that reads it.
        if top >= self.vocab_size or int(tokens.min()) < 0:
            raise ForgeConfigError(
                f"data.path={self.path!r} holds token id {top} at step {step}, outside "
                f"model.vocab_size={self.vocab_size}; use the tokenizer's vocabulary size"
            )
        if self.eos_id is None:
            return Batch(tokens)
        positions, loss_mask = document_positions(tokens, self.eos_id)
        return Batch(tokens, positions=positions, loss_mask=loss_mask)


def document_positions(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [b, S], loss_mask [b, S])`` of windows ``tokens [b, S+1]`` of documents each
    ended by ``eos_id``.

    A position counts from the window's first token and restarts at 0 on the token after each
    EOS (the EOS is its document's last token). A target is masked exactly where it starts a
    document (its input is an EOS): nothing in the previous document predicts it, while the EOS
    itself stays a target. NOTE: the last start at or before each token is a running maximum of
    the start indices (``cummax``): no loop over tokens.
    """
    ends_BS = tokens[:, :-1] == eos_id
    s = ends_BS.shape[1]
    index_BS = torch.arange(s).expand_as(ends_BS)
    starts_BS = torch.zeros_like(ends_BS)
    starts_BS[:, 1:] = ends_BS[:, :-1]  # the token after an EOS starts a document
    last_start_BS = torch.where(starts_BS, index_BS, 0).cummax(dim=1).values
    return index_BS - last_start_BS, ~ends_BS


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
        x = x[
            self.first : self.first + self.local_batch
        ].clone()  # NOTE: a view would keep the global batch
        stencil = torch.tensor([[0.0, 1.0, 0.0], [1.0, 4.0, 1.0], [0.0, 1.0, 0.0]]) / 8.0
        wrapped = torch.nn.functional.pad(x, (1, 1, 0, 0), mode="circular")
        diffused = torch.nn.functional.conv2d(
            wrapped.flatten(0, 1)[:, None], stencil[None, None], padding=(1, 0)
        ).view_as(x)
        return FieldBatch(x, 0.6 * torch.roll(x, 1, dims=-1) + 0.4 * diffused)


# --------------------------------------------------------------------------- pre-launch check
#: Bytes per token id of each ``data.dtype``.
_WIDTH = {"uint16": 2, "uint32": 4, "int32": 4, "int64": 8}
#: The signed torch dtype each is read as (torch 2.11 reduces no unsigned type but uint8), and
#: for an unsigned one its sign bit: flipping it maps unsigned order onto signed order.
_READ_AS = {
    "uint16": (torch.int16, 1 << 15),
    "uint32": (torch.int32, 1 << 31),
    "int32": (torch.int32, 0),
    "int64": (torch.int64, 0),
}
#: One dtype per width, for the "is data.dtype right?" guesses (int32 and uint32 read alike
#: below 2**31, and no vocabulary comes near that).
_GUESSES = {2: "uint16", 4: "int32", 8: "int64"}
_CHUNK_BYTES = 1 << 24  # NOTE: 16 MiB per read: fast to reduce, small beside a rank's memory


def _length_problem(path: str, dtype: str, seq_len: int) -> str | None:
    """The token file's size against ``data.dtype`` and one sample of ``seq_len + 1`` tokens."""
    size, width = os.path.getsize(path), _WIDTH[dtype]
    if size % width:
        fits = [name for w, name in _GUESSES.items() if size % w == 0]
        return (
            f"data.path={path!r} has {size} bytes, not a multiple of {width} "
            f"(data.dtype={dtype!r}); is data.dtype right?"
            + (f" (the size fits {' or '.join(fits)})" if fits else " (no token dtype fits it)")
        )
    if size // width < seq_len + 1:
        return (
            f"data.path={path!r} holds {size // width} tokens of data.dtype={dtype!r}, fewer "
            f"than one sample of training.seq_len + 1 = {seq_len + 1}"
        )
    return None


@dataclass(frozen=True)
class _Scan:
    """A token file read as one dtype: the first id outside the vocabulary (its index and
    value; index None: all inside) and whether any id is not 0."""

    bad_index: int | None
    bad_id: int
    nonzero: bool


def _scan(path: str, dtype: str, vocab_size: int) -> _Scan:
    """Read ``path`` whole as ``dtype`` in chunks, stopping at the first id outside
    ``[0, vocab_size)``.

    NOTE: one min/max pass over each chunk as stored (GB/s); an unsigned dtype is read signed
    with its sign bit flipped (``x ^ sign`` keeps the unsigned order), so the upper half of its
    ids (uint16 ids over 32767) costs one more pass, not a widening copy. Ids are widened to
    int64 only to find where the first bad one is.
    """
    width, (read_as, sign) = _WIDTH[dtype], _READ_AS[dtype]
    buffer, first, nonzero = bytearray(_CHUNK_BYTES), 0, False
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            stored = torch.frombuffer(memoryview(buffer)[: n - n % width], dtype=read_as)
            lo, hi = (int(v) + sign for v in torch.aminmax(stored ^ -sign if sign else stored))
            if lo < 0 or hi >= vocab_size:
                ids = stored.to(torch.int64) & (2 * sign - 1 if sign else -1)
                at = int(((ids < 0) | (ids >= vocab_size)).nonzero()[0, 0])
                return _Scan(first + at, int(ids[at]), True)
            nonzero = nonzero or hi > 0
            first += stored.numel()
    return _Scan(None, 0, nonzero)


def _likely_dtype(path: str, vocab_size: int, widths: list[int]) -> str | None:
    """The widest of ``widths`` in which ``path`` reads as ids that all fit the vocabulary and
    are not all 0 (its guess of :data:`_GUESSES`), else None. NOTE: read narrower than written,
    real ids still fit (the high parts come out as 0), so the widest fitting one is the one
    written; read wider, they come out huge, and the scan stops at the first chunk."""
    size = os.path.getsize(path)
    for width in sorted(widths, reverse=True):
        if size % width == 0:
            found = _scan(path, _GUESSES[width], vocab_size)
            if found.bad_index is None and found.nonzero:
                return _GUESSES[width]
    return None


def token_file_problems(path: str, dtype: str, *, seq_len: int, vocab_size: int) -> list[str]:
    """What is wrong with token file ``path`` for ``data.dtype``, before launch (empty: fine).

    Its size against the dtype, at least one sample of ``seq_len + 1`` tokens, every id in
    ``[0, vocab_size)`` (the whole file, read in chunks), and the dtype itself: a file that
    also reads as ids that all fit in a wider dtype (not all 0) is almost certainly that wider
    dtype (real ids read narrower than written come out as ids and zeros); a file read wider
    than written gives huge ids, and the range refusal names the dtype in which they fit.
    """
    problem = _length_problem(path, dtype, seq_len)
    if problem:
        return [problem]
    width = _WIDTH[dtype]
    found = _scan(path, dtype, vocab_size)
    if found.bad_index is not None:
        guess = _likely_dtype(path, vocab_size, [w for w in _GUESSES if w != width])
        fix = (
            f"read as {guess} every id fits: set data.dtype = {guess!r}"
            if guess
            else "set model.vocab_size to the tokenizer's vocabulary size, or data.dtype to "
            "the dtype the file was written in"
        )
        return [
            f"data.path={path!r} holds token id {found.bad_id} at token {found.bad_index} "
            f"(data.dtype={dtype!r}), outside model.vocab_size={vocab_size}; {fix}"
        ]
    guess = _likely_dtype(path, vocab_size, [w for w in _GUESSES if w > width])
    if guess:
        return [
            f"data.path={path!r} reads as {guess} ids that all fit model.vocab_size="
            f"{vocab_size}: it was almost certainly written as {guess}, and read as "
            f"data.dtype={dtype!r} each id comes out as {_WIDTH[guess] // width} ids, the "
            f"extra ones 0; set data.dtype = {guess!r}"
        ]
    return []

"""Text as training data for ``forge train``: tokenized once, cached, read in windows by step.

Provides :data:`TEXT_SUFFIXES` and :func:`is_text_data` (which ``data.path`` is text; defined
in :mod:`forge.job_config`, without torch, for the pure checks), :class:`TokenizedText` (a token
stream with its loss targets), :func:`tokenize_text` (a split of the tokenized corpus, through
the cache), :class:`TextData` (``batch(step)`` like :class:`forge.data.TokenFile`) and
:func:`text_data_problems` (the launcher's check, which also fills the cache so that the ranks
only read it).

What a file holds (loaded through Hugging Face ``datasets``, see :mod:`forge.text_tokens`):
``.jsonl``/``.json`` and ``.parquet`` rows, a directory saved by ``save_to_disk``, or a
``.txt``/``.text`` file of one document per line (``datasets``' text builder; blank lines are
skipped: to keep a longer text as one document, write it as one ``.jsonl`` row).

Modes: ``"pretrain"`` tokenizes ``data.text_field`` of each row with the tokenizer's own special
tokens (e.g. BOS) and ends it with EOS; documents are packed into one stream. ``"sft"`` renders
``data.messages_field`` (a list of role/content messages) through the tokenizer's chat template,
with the loss on the assistant's tokens only; ``data.packing`` packs conversations into one
stream, or puts one per row (cut to ``seq_len + 1`` tokens, padded with the pad token, else EOS).
Pretraining text is always packed.

Packed rows are windows of ``seq_len + 1`` tokens starting every ``seq_len`` tokens, visited in
a seeded order reshuffled every pass (as a token file's). ``positions`` restart at 0 where a
document starts and at the window's start, and a target that starts a document is masked: a
model that attends by positions never sees across a document, and never learns to guess a
document's first token from the previous one's EOS.

Cache (:mod:`forge.text_cache`): the corpus is tokenized once per (data contents, tokenizer
files, mode, column, library versions, format), keyed by sha256 of all of them, and stored under the cache directory as a safetensors file
(no pickle: nothing read from a file runs code), written to a temporary file and renamed into
place. A file at that name that does not read back as the key's is rewritten. The validation
split is cut after reading the whole corpus: changing ``data.validation_fraction`` (or
``seq_len``, ``packing``, the seed) does not tokenize again.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from forge_core import ForgeConfigError

from .data import Batch, StepData
from .job_config import TEXT_SUFFIXES, DataConfig, is_text_data
from .text_cache import cache_key, cache_path, read_cache, write_cache
from .text_tokens import (
    TokenizedText,
    load_tokenizer,
    one_line,
    open_rows,
    tokenize_conversations,
    tokenize_documents,
    tokenizer_dir_problem,
    tokenizer_mode_problem,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "TEXT_SUFFIXES",
    "TextData",
    "TokenizedText",
    "is_text_data",
    "text_data_problems",
    "tokenize_text",
]

#: Offset of the validation split's generator seed from the epochs' (``seed * 7919 + epoch``).
_SPLIT_STREAM = 1 << 40


def _loader(path: str) -> str:
    """The ``datasets`` builder of ``path``, or ``"disk"`` for a saved directory."""
    return "disk" if os.path.isdir(path) else TEXT_SUFFIXES[os.path.splitext(path)[1].lower()]


# --------------------------------------------------------------------------- corpus
def _settings(data: DataConfig) -> dict[str, str]:
    """What of ``data`` changes the tokens (the cache key's settings): the mode, the column it
    reads and the loader of the file."""
    assert data.path is not None
    column = data.text_field if data.mode == "pretrain" else data.messages_field
    return {"mode": data.mode, "column": column, "loader": _loader(data.path)}


def _tokenize_corpus(data: DataConfig, tokenizer_dir: str, cache_dir: str) -> TokenizedText:
    """Load ``data.path`` and the tokenizer, and tokenize every row (the cache's miss path)."""
    assert data.path is not None
    tokenizer = load_tokenizer(tokenizer_dir)
    with open_rows(data.path, _loader(data.path), cache_dir) as rows:
        if data.mode == "pretrain":
            return tokenize_documents(rows, tokenizer, text_field=data.text_field, path=data.path)
        return tokenize_conversations(
            rows, tokenizer, messages_field=data.messages_field, path=data.path
        )


def _corpus(data: DataConfig, tokenizer_dir: str, cache_dir: str) -> TokenizedText:
    """The whole tokenized corpus: from the cache, else tokenized and cached."""
    if data.path is None or not os.path.exists(data.path):
        raise ForgeConfigError(f"data.path={data.path!r} does not exist; set data.path")
    problem = tokenizer_dir_problem(tokenizer_dir)
    if problem:
        raise ForgeConfigError(problem)
    key = cache_key(data.path, tokenizer_dir, _settings(data))
    path = cache_path(cache_dir, key)
    text = read_cache(path, key)
    if text is None:
        text = _tokenize_corpus(data, tokenizer_dir, cache_dir)
        write_cache(path, key, text, {**_settings(data), "data_path": data.path})
    return text


# --------------------------------------------------------------------------- splits
def _select(text: TokenizedText, keep: torch.Tensor) -> TokenizedText:
    """The documents of ``text`` where ``keep`` (bool ``[D]``), in their order, as one stream."""
    lengths = text.doc_lengths()
    tokens_kept = keep.repeat_interleave(lengths)
    kept_lengths = lengths[keep]
    return TokenizedText(
        text.tokens[tokens_kept],
        text.target_mask[tokens_kept],
        torch.cumsum(kept_lengths, 0) - kept_lengths,
    )


def split_text(text: TokenizedText, fraction: float, seed: int, split: str) -> TokenizedText:
    """Split ``split`` of the corpus: with ``fraction > 0``, the first ``round(fraction * D)``
    (at least 1) documents of a permutation seeded by ``seed`` alone are ``"validation"``, the
    others ``"train"``; documents keep their order in the file."""
    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r}: choose 'train' or 'validation'")
    if fraction <= 0:
        if split == "validation":
            raise ForgeConfigError(
                "the validation loss ([metrics] validation_every) needs held-out documents: "
                "set data.validation_fraction > 0 (e.g. 0.01)"
            )
        return text
    n_docs = len(text.doc_starts)
    n_held = max(1, round(fraction * n_docs))
    if n_held >= n_docs:
        raise ForgeConfigError(
            f"data.validation_fraction={fraction} holds out {n_held} of the {n_docs} "
            "documents, leaving none to train on; lower it or add documents"
        )
    g = torch.Generator().manual_seed(seed * 7919 + _SPLIT_STREAM)
    held = torch.zeros(n_docs, dtype=torch.bool)
    held[torch.randperm(n_docs, generator=g)[:n_held]] = True
    return _select(text, held if split == "validation" else ~held)


def tokenize_text(
    data: DataConfig,
    *,
    tokenizer_dir: str,
    seq_len: int,
    seed: int,
    split: str = "train",
    cache_dir: str,
) -> TokenizedText:
    """Split ``split`` of ``data.path`` tokenized (see the module docstring), through the cache
    under ``cache_dir``. ``seq_len`` decides nothing here (the stream does not depend on it);
    it is taken so that callers pass one set of arguments to every function of this module."""
    del seq_len
    text = _corpus(data, tokenizer_dir, cache_dir)
    return split_text(text, data.validation_fraction, seed, split)


# --------------------------------------------------------------------------- batches
def _padded_rows(text: TokenizedText, seq_len: int) -> torch.Tensor:
    """The documents with at least one target among their first ``seq_len + 1`` tokens (a row
    without one adds nothing to the loss), int64 ``[R]``."""
    starts = text.doc_starts
    ends = torch.minimum(starts + text.doc_lengths(), starts + seq_len + 1)
    counts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(text.target_mask, 0)])
    return torch.nonzero(counts[ends] - counts[starts + 1] > 0).flatten()


def _size_problem(data: DataConfig, text: TokenizedText, seq_len: int, split: str) -> str | None:
    """Why split ``split`` of ``data.path`` cannot fill one row, else None."""
    where = (
        f"the {'training' if split == 'train' else 'validation'} split of data.path={data.path!r}"
    )
    fix = "add text" if split == "train" else "raise data.validation_fraction"
    if _packed(data) and len(text.tokens) < seq_len + 1:
        return (
            f"{where} has {len(text.tokens)} tokens, fewer than one window of "
            f"training.seq_len + 1 = {seq_len + 1}; {fix} or lower training.seq_len"
        )
    if not _packed(data) and len(_padded_rows(text, seq_len)) == 0:
        return (
            f"no conversation of {where} has an assistant token within its first "
            f"training.seq_len + 1 = {seq_len + 1} tokens; raise training.seq_len"
        )
    return None


def _packed(data: DataConfig) -> bool:
    """Whether rows are windows of one packed stream (pretraining text always is)."""
    return data.mode == "pretrain" or data.packing


class TextData(StepData[Batch]):
    """Tokenized text by optimizer step: ``batch(step)`` gives this rank's rows of the global
    batch, ``tokens [b, S+1]``, ``positions [b, S]`` and ``loss_mask [b, S]``.

    Holds the split's whole token stream in memory (int64 ids and a bool mask: 9 bytes a
    token); ranks read it from the cache that :func:`text_data_problems` filled.
    """

    def __init__(
        self,
        data: DataConfig,
        *,
        tokenizer_dir: str,
        seq_len: int,
        global_batch: int,
        seed: int,
        cache_dir: str,
        dp_rank: int,
        dp_size: int,
        split: str = "train",
    ) -> None:
        super().__init__(global_batch, dp_rank, dp_size)
        self.text = tokenize_text(
            data,
            tokenizer_dir=tokenizer_dir,
            seq_len=seq_len,
            seed=seed,
            split=split,
            cache_dir=cache_dir,
        )
        self.packed = _packed(data)
        problem = _size_problem(data, self.text, seq_len, split)
        if problem:
            raise ForgeConfigError(problem)
        self.seq_len, self.seed = seq_len, seed
        if self.packed:
            self.rows = torch.empty(0, dtype=torch.int64)
            self.n_items = (len(self.text.tokens) - 1) // seq_len
        else:
            self.rows = _padded_rows(self.text, seq_len)
            self.n_items = len(self.rows)
            self.pad_id = _pad_id(load_tokenizer(tokenizer_dir), tokenizer_dir)
        self._order: tuple[int, torch.Tensor] | None = None

    def _item(self, sample: int) -> int:
        """The window (packed) or row (padded) of global sample ``sample``: each pass over the
        data visits them in its own order, seeded by (seed, pass)."""
        epoch, index = divmod(sample, self.n_items)
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._order = (epoch, torch.randperm(self.n_items, generator=g))
        return int(self._order[1][index])

    def batch(self, step: int) -> Batch:
        first_sample = step * self.global_batch + self.first
        items = torch.tensor(
            [self._item(s) for s in range(first_sample, first_sample + self.local_batch)],
            dtype=torch.int64,
        )
        return self._packed(items) if self.packed else self._padded(items)

    def _packed(self, windows: torch.Tensor) -> Batch:
        """Windows ``windows`` of the stream, positions counted from each document's start or
        the window's, whichever is later."""
        text, seq_len = self.text, self.seq_len
        starts = windows * seq_len
        index = starts[:, None] + torch.arange(seq_len + 1)
        inputs = starts[:, None] + torch.arange(seq_len)  # NOTE: contiguous, for searchsorted
        doc = torch.searchsorted(text.doc_starts, inputs, right=True) - 1
        begins = torch.maximum(text.doc_starts[doc], starts[:, None])
        return Batch(
            text.tokens[index],
            positions=inputs - begins,
            loss_mask=text.target_mask[index[:, 1:]],
        )

    def _padded(self, rows: torch.Tensor) -> Batch:
        """One conversation per row, cut to ``seq_len + 1`` tokens, padding never a target."""
        text, width = self.text, self.seq_len + 1
        tokens = torch.full((len(rows), width), self.pad_id, dtype=torch.int64)
        targets = torch.zeros(len(rows), width, dtype=torch.bool)
        lengths = text.doc_lengths()
        for b, doc in enumerate(self.rows[rows].tolist()):
            start, n = int(text.doc_starts[doc]), min(int(lengths[doc]), width)
            tokens[b, :n] = text.tokens[start : start + n]
            targets[b, :n] = text.target_mask[start : start + n]
        positions = torch.arange(self.seq_len).expand(len(rows), -1).clone()
        return Batch(tokens, positions=positions, loss_mask=targets[:, 1:])


def _pad_id(tokenizer: PreTrainedTokenizerBase, tokenizer_dir: str) -> int:
    """The padding id of one-per-row SFT: the tokenizer's pad token, else its EOS."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ForgeConfigError(
            f"data.packing=false pads each conversation, but the tokenizer {tokenizer_dir!r} "
            "has neither a pad_token nor an eos_token; set one, or data.packing = true"
        )
    return int(pad)


# --------------------------------------------------------------------------- pre-launch check
def _tokenizer_problems(data: DataConfig, tokenizer_dir: str, vocab_size: int) -> list[str]:
    """The tokenizer against the model's vocabulary and what the mode needs of it."""
    tokenizer = load_tokenizer(tokenizer_dir)
    problems = []
    if len(tokenizer) > vocab_size:
        problems.append(
            f"the tokenizer {tokenizer_dir!r} has {len(tokenizer)} tokens, more than the "
            f"model's vocabulary model.vocab_size={vocab_size}; set model.vocab_size >= "
            f"{len(tokenizer)} or use the model's own tokenizer (data.tokenizer)"
        )
    problem = tokenizer_mode_problem(tokenizer, data.mode)
    if problem:
        problems.append(problem)
    if data.mode == "sft" and not data.packing:
        try:
            _pad_id(tokenizer, tokenizer_dir)
        except ForgeConfigError as error:
            problems.append(str(error))
    return problems


def text_data_problems(
    data: DataConfig,
    *,
    tokenizer_dir: str | None,
    vocab_size: int,
    seq_len: int,
    seed: int,
    cache_dir: str,
) -> list[str]:
    """What is wrong with text ``data.path`` for training, one line each (empty: fine).

    Run once by the launcher before any rank starts: it tokenizes the corpus (when the cache
    does not hold it yet), so that every rank then reads the cache. Checks the file, the
    tokenizer (its files, its vocabulary against ``vocab_size``, EOS or a chat template as the
    mode needs), the columns and rows, and that each split fills at least one row.
    """
    path = data.path
    if path is None or not os.path.exists(path):
        return [f"data.path={path!r} does not exist; set data.path to a file or directory"]
    if tokenizer_dir is None:
        return [f"data.path={path!r} is text: set data.tokenizer = DIR or model.hf"]
    try:
        problems = _tokenizer_problems(data, tokenizer_dir, vocab_size)
        if problems:
            return problems
        corpus = _corpus(data, tokenizer_dir, cache_dir)
        splits = ["train", "validation"] if data.validation_fraction > 0 else ["train"]
        for split in splits:
            text = split_text(corpus, data.validation_fraction, seed, split)
            problem = _size_problem(data, text, seq_len, split)
            if problem:
                return [problem]
    except ForgeConfigError as error:
        return [str(error)]
    except Exception as error:  # NOTE: datasets/transformers raise what they like
        return [f"data.path={path!r} could not be tokenized ({one_line(error)})"]
    return []

"""Text to token ids for :mod:`forge.text_data`: loading rows, the tokenizer, and tokenizing.

Provides :class:`TokenizedText` (a token stream with its loss targets and document starts),
:func:`open_rows` (a file or a saved dataset through Hugging Face ``datasets``),
:func:`load_tokenizer` (``transformers.AutoTokenizer``, local files, no remote code),
:func:`tokenize_documents` (pretraining text) and :func:`tokenize_conversations` (chat SFT).

Notable choices:

- Nothing read from a file may run code: ``trust_remote_code=False`` and local files only.
- ``datasets`` and ``transformers`` are imported inside the functions that use them, so that
  importing forge's data modules costs no more than torch; ``datasets`` loads with
  ``HF_DATASETS_OFFLINE=1`` and writes its arrow files in a scratch folder under the token
  cache (removed afterwards), never in ``~/.cache``.
- A blank document (empty or whitespace-only text) is skipped: a ``.txt`` file is one document
  per line, and the blank lines between paragraphs are not documents.
- A conversation with no assistant turn to learn (none, or only one that opens the conversation
  and so answers nothing) is skipped: every one of its tokens would be masked out.
- An assistant turn's tokens are found by rendering prefixes of the conversation (the chat
  template's own output, never a guess from role markers); a template whose prefix renders are
  not token prefixes of the full render (one that rewrites earlier turns) is refused.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from forge_core import ForgeConfigError

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "TokenizedText",
    "load_tokenizer",
    "one_line",
    "open_rows",
    "tokenize_conversations",
    "tokenize_documents",
    "tokenizer_dir_problem",
    "tokenizer_mode_problem",
]

#: Files of which a directory needs at least one to hold a tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
#: Environment read by ``datasets`` and ``huggingface_hub``: no network while loading.
_OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
#: The suffixes that name each format, for the refusals.
_SUFFIX_HINT = (".jsonl", ".parquet", ".txt")
_ROWS_PER_CHUNK = 1024  # NOTE: texts per tokenizer call: fast tokenizers batch them in Rust


@dataclass(frozen=True)
class TokenizedText:
    """A token stream: ``tokens`` (int64 ``[N]``), ``target_mask`` (bool ``[N]``: token ``i``
    counts as a loss target when predicted from ``tokens[:i]``) and ``doc_starts`` (int64
    ``[D]``: where each document or conversation starts; the first is 0)."""

    tokens: torch.Tensor
    target_mask: torch.Tensor
    doc_starts: torch.Tensor

    def doc_lengths(self) -> torch.Tensor:
        """The number of tokens of each document, int64 ``[D]``."""
        ends = torch.cat([self.doc_starts[1:], self.doc_starts.new_tensor([len(self.tokens)])])
        return ends - self.doc_starts


def one_line(error: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def _join(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> TokenizedText:
    """One stream from documents given as (ids, target mask) pairs, in order."""
    lengths = torch.tensor([len(ids) for ids, _ in pieces], dtype=torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    return TokenizedText(
        torch.cat([ids for ids, _ in pieces]).to(torch.int64),
        torch.cat([mask for _, mask in pieces]),
        starts,
    )


# --------------------------------------------------------------------------- loading
@contextmanager
def _offline() -> Iterator[None]:
    """``HF_DATASETS_OFFLINE=1`` (and the hub's) while loading, then the environment as it was.

    NOTE: ``datasets`` reads it when first imported, which happens inside this block in a
    process that has not loaded text before; loading local files needs no network anyway.
    """
    saved = {name: os.environ.get(name) for name in _OFFLINE}
    os.environ.update({name: "1" for name in _OFFLINE})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _one_split(rows: Any, path: str) -> Dataset:
    """The dataset of a ``load_from_disk`` result: a ``Dataset``, or a ``DatasetDict``'s
    ``train`` split (or its only split)."""
    if not hasattr(rows, "keys"):
        return rows
    names = sorted(rows.keys())
    if "train" in names or len(names) == 1:
        return rows["train" if "train" in names else names[0]]
    raise ForgeConfigError(
        f"data.path={path!r} is a saved DatasetDict with splits {names} and none is 'train'; "
        "save the split to train on alone (dataset['name'].save_to_disk(...))"
    )


def _load_failure(path: str, loader: str, error: Exception) -> str:
    """The one-line refusal for ``datasets`` failing to load ``path`` with ``loader``."""
    if loader == "disk":
        return (
            f"data.path={path!r} is a directory that datasets.load_from_disk cannot load "
            f"({one_line(error)}); a directory must be one saved by Dataset.save_to_disk"
        )
    return (
        f"data.path={path!r} could not be read as {loader} by datasets ({one_line(error)}); "
        f"fix the file, or give it the suffix of its format ({', '.join(_SUFFIX_HINT)})"
    )


@contextmanager
def open_rows(path: str, loader: str, scratch_parent: str) -> Iterator[Dataset]:
    """The rows of ``path`` as a ``datasets.Dataset``, valid inside the ``with`` block.

    ``loader``: ``"json"``, ``"parquet"`` or ``"text"`` (``datasets``' builders; ``"text"``
    gives one row per line, column ``text``), or ``"disk"`` for a ``save_to_disk`` directory.
    The builders' arrow files go to a scratch folder under ``scratch_parent``, removed at the
    end of the block.
    """
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        raise ForgeConfigError(
            f"data.path={path!r} is an empty file; point data.path at the text to train on"
        )
    with _offline():
        try:
            import datasets
        except ImportError:
            raise ForgeConfigError(
                f"data.path={path!r} is text to tokenize, which needs the datasets package: "
                "pip install 'forge-parallel[data]'"
            ) from None
        try:
            os.makedirs(scratch_parent, exist_ok=True)
            scratch_dir = tempfile.TemporaryDirectory(dir=scratch_parent, prefix=".arrow-")
        except OSError as error:
            raise ForgeConfigError(
                f"the token cache {scratch_parent!r} (data.cache_dir) cannot be written "
                f"({one_line(error)}); set data.cache_dir to a writable directory"
            ) from error
        with scratch_dir as scratch:
            try:
                if loader == "disk":
                    rows = _one_split(datasets.load_from_disk(path), path)
                else:
                    rows = datasets.load_dataset(
                        loader, data_files=path, split="train", cache_dir=scratch
                    )
            except ForgeConfigError:
                raise
            except Exception as error:
                raise ForgeConfigError(_load_failure(path, loader, error)) from error
            yield rows


def tokenizer_dir_problem(tokenizer_dir: str) -> str | None:
    """Why ``tokenizer_dir`` cannot hold a tokenizer (not a directory, or none of
    :data:`TOKENIZER_FILES` in it), else None."""
    where = f"the tokenizer directory {tokenizer_dir!r} (data.tokenizer, else model.hf)"
    if not os.path.isdir(tokenizer_dir):
        return f"{where} does not exist or is not a directory; set data.tokenizer = DIR"
    if not any(os.path.isfile(os.path.join(tokenizer_dir, f)) for f in TOKENIZER_FILES):
        return (
            f"{where} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            "save one there with tokenizer.save_pretrained(DIR)"
        )
    return None


def load_tokenizer(tokenizer_dir: str) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(tokenizer_dir)`` from local files, no remote code."""
    problem = tokenizer_dir_problem(tokenizer_dir)
    if problem:
        raise ForgeConfigError(problem)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ForgeConfigError(
            f"the tokenizer {tokenizer_dir!r} needs the transformers package: "
            "pip install 'forge-parallel[hf]'"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(
            tokenizer_dir, trust_remote_code=False, local_files_only=True
        )
    except Exception as error:
        raise ForgeConfigError(
            f"the tokenizer at {tokenizer_dir!r} (data.tokenizer, else model.hf) could not be "
            f"loaded ({one_line(error)}); it must load with trust_remote_code=False"
        ) from error


def _column(rows: Dataset, column: str, setting: str, path: str) -> Iterator[list[Any]]:
    """The values of ``column`` in chunks, refusing when there is no such column."""
    if column not in rows.column_names:
        raise ForgeConfigError(
            f"data.{setting}={column!r} is not a column of data.path={path!r}; its columns: "
            f"{rows.column_names}; set data.{setting} to one of them"
        )
    for chunk in rows.select_columns([column]).iter(batch_size=_ROWS_PER_CHUNK):
        yield list(chunk[column])


# --------------------------------------------------------------------------- pretraining text
def tokenizer_mode_problem(tokenizer: PreTrainedTokenizerBase, mode: str) -> str | None:
    """What ``data.mode`` needs of the tokenizer and it lacks: EOS to end each pretraining
    document, a chat template for SFT."""
    name = tokenizer.name_or_path
    if mode == "pretrain" and tokenizer.eos_token_id is None:
        return (
            f"data.mode='pretrain' ends each document with EOS, but the tokenizer {name!r} has "
            "no eos_token; set one in its tokenizer_config.json"
        )
    if mode == "sft" and not getattr(tokenizer, "chat_template", None):
        return (
            f"data.mode='sft' needs a chat template: the tokenizer at {name!r} has none; use "
            "a chat model's tokenizer (data.tokenizer) or set tokenizer.chat_template and save "
            "it there"
        )
    return None


def _texts(rows: Dataset, text_field: str, path: str) -> Iterator[tuple[int, list[str]]]:
    """Chunks of the non-blank texts of column ``text_field``, each with the number of rows
    it was read from; refuses a value that is not text."""
    row = 0
    for texts in _column(rows, text_field, "text_field", path):
        for i, text in enumerate(texts):
            if text is not None and not isinstance(text, str):
                raise ForgeConfigError(
                    f"data.text_field={text_field!r} holds a {type(text).__name__} in row "
                    f"{row + i} of data.path={path!r}, not text; point data.text_field at text"
                )
        row += len(texts)
        yield len(texts), [t for t in texts if t and not t.isspace()]


def tokenize_documents(
    rows: Dataset, tokenizer: PreTrainedTokenizerBase, *, text_field: str, path: str
) -> TokenizedText:
    """Each non-blank text of column ``text_field`` as ``tokenizer(text)["input_ids"]`` (with
    the tokenizer's own special tokens, e.g. BOS) then EOS (not doubled), concatenated; the
    first token of each document is no target (nothing before it predicts it)."""
    problem = tokenizer_mode_problem(tokenizer, "pretrain")
    if problem:
        raise ForgeConfigError(problem)
    eos = tokenizer.eos_token_id
    chunks: list[torch.Tensor] = []
    lengths: list[int] = []
    n_rows = 0
    for n_read, texts in _texts(rows, text_field, path):
        n_rows += n_read
        if not texts:
            continue
        docs = [ids if ids and ids[-1] == eos else [*ids, eos] for ids in _ids(tokenizer, texts)]
        chunks.append(torch.tensor([t for doc in docs for t in doc], dtype=torch.int64))
        lengths += [len(doc) for doc in docs]
    if not lengths:
        raise ForgeConfigError(
            f"data.path={path!r} has no text to train on: {n_rows} rows and every "
            f"data.text_field={text_field!r} is empty; check the file"
        )
    sizes = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes
    tokens = torch.cat(chunks)
    target_mask = torch.ones(len(tokens), dtype=torch.bool)
    target_mask[starts] = False
    return TokenizedText(tokens, target_mask, starts)


def _ids(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """``tokenizer(texts)["input_ids"]``, quiet about texts longer than the model's context
    (documents are cut into windows later)."""
    return tokenizer(texts, verbose=False)["input_ids"]


# --------------------------------------------------------------------------- conversations
def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], prompt: bool
) -> list[int]:
    """The chat template's token ids of ``messages`` (``prompt``: with the generation prompt)."""
    out: Any = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=prompt, return_dict=False
    )
    ids = out["input_ids"] if hasattr(out, "keys") else out  # NOTE: a dict in some versions
    return [int(i) for i in ids]


def _messages_problem(messages: Any) -> str | None:
    """What keeps ``messages`` from being a list of ``{"role": str, "content": str}``."""
    if not isinstance(messages, list):
        return f"a {type(messages).__name__}, not a list of messages"
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {k} is a {type(m).__name__}, not a dict"
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {k} has no string 'role' and 'content' (keys {sorted(m)})"
    return None


def _assistant_mask(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ids of a conversation and its target mask: True on each assistant turn's
    tokens ``[len(render(messages[:k], prompt)), len(render(messages[:k+1])))``."""
    full = _render(tokenizer, messages, prompt=False)
    mask = torch.zeros(len(full), dtype=torch.bool)
    for k in range(1, len(messages)):
        if messages[k]["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:k], prompt=True)
        upto = _render(tokenizer, messages[: k + 1], prompt=False)
        if full[: len(head)] != head or full[: len(upto)] != upto or len(head) > len(upto):
            raise ForgeConfigError(
                f"the chat template of {tokenizer.name_or_path!r} is not prefix-stable: "
                f"rendering the first {k} messages of {where} gives tokens that do not start "
                "the whole conversation's, so the assistant's tokens cannot be found; use a "
                "template that does not rewrite earlier turns"
            )
        mask[len(head) : len(upto)] = True
    return torch.tensor(full, dtype=torch.int64), mask


def _conversations(
    rows: Dataset, column: str, path: str
) -> Iterable[tuple[int, list[dict[str, Any]]]]:
    """Each row's index and messages, refusing a row that is not a list of role/content."""
    row = 0
    for chunk in _column(rows, column, "messages_field", path):
        for messages in chunk:
            problem = None if messages is None else _messages_problem(messages)
            if problem:
                raise ForgeConfigError(
                    f"data.messages_field={column!r} of row {row} of data.path={path!r} is "
                    f"{problem}; each row must hold a list of {{'role', 'content'}} messages"
                )
            yield row, messages or []
            row += 1


def tokenize_conversations(
    rows: Dataset, tokenizer: PreTrainedTokenizerBase, *, messages_field: str, path: str
) -> TokenizedText:
    """Each conversation of column ``messages_field`` through the tokenizer's chat template,
    concatenated, the targets on the assistant turns only (see :func:`_assistant_mask`)."""
    problem = tokenizer_mode_problem(tokenizer, "sft")
    if problem:
        raise ForgeConfigError(problem)
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    rows_read = 0
    for row, messages in _conversations(rows, messages_field, path):
        rows_read = row + 1
        if not any(m["role"] == "assistant" for m in messages[1:]):
            continue
        try:
            ids, mask = _assistant_mask(tokenizer, messages, f"row {row}")
        except ForgeConfigError:
            raise
        except Exception as error:
            raise ForgeConfigError(
                f"the chat template of {tokenizer.name_or_path!r} fails on row {row} of "
                f"data.path={path!r} ({one_line(error)}); fix the row or the template"
            ) from error
        if bool(mask.any()):
            pieces.append((ids, mask))
    if not pieces:
        raise ForgeConfigError(
            f"data.path={path!r} has no conversation to learn from: none of its {rows_read} "
            f"rows of data.messages_field={messages_field!r} has an assistant turn after the "
            "first message; check the file"
        )
    return _join(pieces)

"""The token cache of :mod:`forge.text_data`: a tokenized corpus stored once per content key.

Provides :func:`cache_key` (sha256 of what the tokens depend on), :func:`cache_path` (the one
file name forge owns for a key), :func:`read_cache` and :func:`write_cache`.

Notable choices:

- The key is the *contents*, not names or dates: the data's bytes (every file of a saved
  directory, with its relative name), every file of the tokenizer directory but weights, the
  settings that change the tokens, the versions of ``transformers`` and ``tokenizers`` (they
  render and split the text) and :data:`CACHE_FORMAT`.
- safetensors, not pickle: nothing read from a file can run code. Ids are stored as int32 when
  they fit (half the disk) and read back as int64.
- Written atomically (a temporary file in the same folder, fsynced, renamed): a rank never
  reads half a file. A file at the key's name that does not read back as that key's corpus is
  ignored and rewritten; no other file is ever touched.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile

import torch
from forge_core import ForgeConfigError

from .text_tokens import TokenizedText, one_line

__all__ = ["CACHE_FORMAT", "cache_key", "cache_path", "read_cache", "write_cache"]

#: Bumped when the tokenization or the cache file changes meaning: old caches are not read.
CACHE_FORMAT = 1
#: Files of a tokenizer directory left out of the key: weights, which the tokenizer never reads.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_CHUNK_BYTES = 1 << 24  # NOTE: 16 MiB per read while hashing


def _hash_file(h: hashlib._Hash, path: str, name: str) -> None:
    """Add ``name``, the size and the bytes of file ``path`` to ``h``."""
    h.update(name.encode() + b"\0" + os.path.getsize(path).to_bytes(8, "little"))
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)


def _files(root: str) -> list[tuple[str, str]]:
    """Every file under directory ``root`` as (path, name relative to ``root``), sorted."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            found.append((path, os.path.relpath(path, root).replace(os.sep, "/")))
    return sorted(found, key=lambda pair: pair[1])


def _versions() -> list[str]:
    """``package=version`` of the libraries whose behaviour the tokens depend on."""
    versions = []
    for package in ("transformers", "tokenizers"):
        try:
            versions.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package}=none")
    return versions


def cache_key(data_path: str, tokenizer_dir: str, settings: dict[str, str]) -> str:
    """sha256 over :data:`CACHE_FORMAT`, ``settings`` (what changes the tokens: mode, column,
    loader), the library versions, the data (a file's bytes, or every file of a directory with
    its relative name) and the tokenizer directory's top-level files but weights."""
    h = hashlib.sha256()
    lines = [f"format={CACHE_FORMAT}", *(f"{k}={v}" for k, v in sorted(settings.items()))]
    h.update("\n".join([*lines, *_versions()]).encode() + b"\0")
    if os.path.isdir(data_path):
        for path, name in _files(data_path):
            _hash_file(h, path, "data/" + name)
    else:
        _hash_file(h, data_path, "data")
    for name in sorted(os.listdir(tokenizer_dir)):
        path = os.path.join(tokenizer_dir, name)
        if os.path.isfile(path) and not name.endswith(_WEIGHT_SUFFIXES):
            _hash_file(h, path, "tokenizer/" + name)
    return h.hexdigest()


def cache_path(cache_dir: str, key: str) -> str:
    """The one file name forge owns for ``key`` under ``cache_dir``."""
    return os.path.join(cache_dir, f"text-{key}.safetensors")


def _well_formed(text: TokenizedText) -> bool:
    """Whether the tensors read back make a token stream (a check against damage)."""
    n, starts = len(text.tokens), text.doc_starts
    return (
        text.tokens.dim() == 1
        and text.target_mask.dtype == torch.bool
        and text.target_mask.shape == text.tokens.shape
        and starts.dtype == torch.int64
        and starts.dim() == 1
        and len(starts) > 0
        and int(starts[0]) == 0
        and bool((starts[1:] > starts[:-1]).all())
        and int(starts[-1]) < n
    )


def read_cache(path: str, key: str) -> TokenizedText | None:
    """The corpus cached at ``path`` for ``key``; None when absent, damaged or another key's."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        return None
    try:
        with safe_open(path, framework="pt") as f:
            if (f.metadata() or {}).get("key") != key:
                return None
            text = TokenizedText(
                f.get_tensor("tokens").to(torch.int64),
                f.get_tensor("target_mask"),
                f.get_tensor("doc_starts"),
            )
    except Exception:
        return None  # NOTE: damaged (cut short, overwritten): tokenized again and rewritten
    return text if _well_formed(text) else None


def write_cache(path: str, key: str, text: TokenizedText, metadata: dict[str, str]) -> None:
    """Store ``text`` at ``path`` atomically (a temporary file in the same folder, renamed),
    with ``key`` and ``metadata`` (for a person reading the file) in its header."""
    from safetensors.torch import save_file

    folder = os.path.dirname(path)
    tokens = text.tokens
    if len(tokens) and int(tokens.max()) < 2**31 and int(tokens.min()) >= 0:
        tokens = tokens.to(torch.int32)
    tensors = {"tokens": tokens, "target_mask": text.target_mask, "doc_starts": text.doc_starts}
    header = {**metadata, "key": key, "format": str(CACHE_FORMAT)}
    try:
        os.makedirs(folder, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=folder, prefix=".text-", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, temporary, metadata=header)
            with open(temporary, "rb") as f:
                os.fsync(f.fileno())
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
    except OSError as error:
        raise ForgeConfigError(
            f"the token cache {folder!r} (data.cache_dir) cannot be written ({one_line(error)}); "
            "set data.cache_dir to a writable directory"
        ) from error

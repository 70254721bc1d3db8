"""A Hugging Face model trained by forge, written back as a Hugging Face model directory.

:func:`export_hf_model` writes what ``from_pretrained`` reads: the weights as safetensors shards
of at most ``max_shard_bytes`` with ``model.safetensors.index.json`` (one ``model.safetensors``
when they fit in one), the source directory's ``config.json`` (its dtype field set to the
weights' dtype, so ``dtype="auto"`` keeps it) and its tokenizer and generation files. The
tensors come from a callable that fills one shard's names at a time (from a checkpoint's DCP
shards: :func:`load_checkpoint_tensors`), so at most one shard's tensors exist at once: no
process ever holds the whole model.

Nothing forge did not write is overwritten: ``.forge-export.json`` in the output records the
SHA-256 of every file forge wrote there, and a file about to be replaced must still have it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from forge_core import ForgeConfigError
from forge_core.tensor_source import TensorSource
from torch import Tensor

from .export import EXPORT_MANIFEST, _write_then_rename, check_output, save_safetensors

__all__ = [
    "COPIED_FILES",
    "export_hf_model",
    "load_checkpoint_tensors",
    "shard_plan",
    "stored_layout",
]

#: The source directory's files an export carries along (those present).
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_MANIFEST = EXPORT_MANIFEST
_INDEX = "model.safetensors.index.json"

#: ``fill(tensors)``: put the values of each named tensor into the given empty tensor.
Filler = Callable[[dict[str, Tensor]], None]
#: A tensor's full shape and dtype.
Shape = tuple[tuple[int, ...], torch.dtype]
#: What one stored tensor is made of: ``(model tensor, its source, its row or None)`` per part.
_Parts = list[tuple[str, TensorSource, int | None]]


def _stored_parts(
    shapes: Mapping[str, Shape], sources: Mapping[str, TensorSource]
) -> dict[str, _Parts]:
    """Each stored tensor's parts, in the model's order; a constant (nothing stored) is left
    out."""
    parts: dict[str, _Parts] = {}
    for name in shapes:
        source = sources.get(name)
        if source is None:
            parts[name] = [(name, TensorSource((name,)), None)]
        elif source.stacked:
            for row, stored in enumerate(source.stored):
                parts.setdefault(stored, []).append((name, source, row))
        elif source.stored:
            parts.setdefault(source.stored[0], []).append((name, source, None))
    return parts


def _combine(pieces: list[tuple[TensorSource, Tensor]]) -> Tensor:
    """The stored tensor from its parts' values (each laid out as its model tensor's row)."""
    pieces = sorted(pieces, key=lambda p: p[0].part)
    source = pieces[0][0]
    values = [v for _, v in pieces]
    if source.parts == 1:
        out = values[0]
    elif source.interleaved:
        out = torch.stack(values, dim=-1).flatten(-2)
    else:
        out = torch.cat(values, dim=-1)
    return out.transpose(-1, -2) if source.transpose else out


def stored_layout(
    shapes: Mapping[str, Shape], sources: Mapping[str, TensorSource], fill: Filler
) -> tuple[dict[str, Shape], Filler]:
    """The model's tensors (``shapes``, filled by ``fill``) as a checkpoint that ``sources``
    describes stores them: the stored names with their shapes, and a filler that computes
    them (the inverse of reading with the sources: converted MoE experts written back one by
    one, or fused, as the original checkpoint held them). A filler call loads only the model
    tensors its stored names are made of."""
    parts = _stored_parts(shapes, sources)
    stored: dict[str, Shape] = {}
    for name, made_of in parts.items():
        target, source, row = made_of[0]
        shape, dtype = shapes[target]
        full = list(shape[1:] if row is not None else shape)
        full[-1] *= source.parts
        if source.transpose:
            full[-1], full[-2] = full[-2], full[-1]
        stored[name] = (tuple(full), dtype)

    def fill_stored(tensors: dict[str, Tensor]) -> None:
        needed = {t for name in tensors for t, _, _ in parts[name]}
        values = {t: torch.empty(shapes[t][0], dtype=shapes[t][1]) for t in needed}
        fill(values)
        for name, tensor in tensors.items():
            pieces = [
                (source, values[t] if row is None else values[t][row])
                for t, source, row in parts[name]
            ]
            tensor.copy_(_combine(pieces))

    return stored, fill_stored


def shard_plan(
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], max_shard_bytes: int
) -> list[list[str]]:
    """The tensors' names grouped in order into shards of at most ``max_shard_bytes`` (a
    tensor larger than that is a shard of its own)."""
    if max_shard_bytes <= 0:
        raise ForgeConfigError(f"max_shard_bytes={max_shard_bytes} must be positive")
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in shapes.items():
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _owned(out: Path) -> dict[str, str]:
    """The files forge wrote into ``out`` before and their hashes (none: no manifest). A file
    of the manifest's name that is not one (not a JSON table of names to hashes) is not
    forge's: it is refused, not replaced."""
    path = out / _MANIFEST
    if not os.path.lexists(path):
        return {}
    try:
        owned = json.loads(path.read_text()) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        owned = None
    if not isinstance(owned, dict) or not all(isinstance(v, str) for v in owned.values()):
        raise ForgeConfigError(
            f"out {str(out)!r} holds {_MANIFEST!r}, which is not forge's record of an export: "
            "choose another folder, or move it away"
        )
    return owned


def _check_replaceable(out: Path, names: Iterable[str], owned: Mapping[str, str]) -> None:
    """Refuse to replace a file of ``out`` unless forge wrote it and it is unchanged since."""
    for name in names:
        target = out / name
        if not os.path.lexists(target):
            continue
        if target.is_file() and not target.is_symlink() and owned.get(name) == _sha256(target):
            continue
        raise ForgeConfigError(
            f"out {str(out)!r} holds {name!r}, which forge did not write (or which changed "
            "since): forge overwrites only its own exports; choose another folder, or move it "
            "away"
        )


def _config_json(source: Path, dtype: torch.dtype) -> bytes:
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    name = str(dtype).removeprefix("torch.")
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def export_hf_model(
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    fill: Filler,
    source_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write the Hugging Face model directory ``out_dir``: the tensors ``shapes`` names (in
    Hugging Face's names), filled one shard at a time by ``fill``, with ``source_dir``'s
    config.json and tokenizer files. Returns ``out_dir``."""
    out = check_output(out_dir, folder=True, name="out")
    source = Path(source_dir)
    plan = shard_plan(shapes, max_shard_bytes)
    count = len(plan)
    files = (
        ["model.safetensors"]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    copied = [n for n in COPIED_FILES if (source / n).is_file()]
    owned = _owned(out)
    _check_replaceable(out, [*files, _INDEX, "config.json", *copied], owned)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    dtypes = {dtype for _, dtype in shapes.values()}
    for file, names in zip(files, plan, strict=True):
        tensors = {n: torch.empty(shapes[n][0], dtype=shapes[n][1]) for n in names}
        fill(tensors)
        save_safetensors(tensors, out / file, metadata={"format": "pt"})
        written[file] = _sha256(out / file)
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    if count > 1:
        total = sum(torch.Size(s).numel() * d.itemsize for s, d in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_bytes(out / _INDEX, (json.dumps(index, indent=2) + "\n").encode(), written)
    dtype = max(dtypes, key=lambda d: d.itemsize) if dtypes else torch.float32
    _write_bytes(out / "config.json", _config_json(source, dtype), written)
    for name in copied:
        _copy(source / name, out / name)
        written[name] = _sha256(out / name)
    kept = _drop_stale_weights(out, owned, written)
    manifest = (json.dumps({**kept, **written}, indent=2, sort_keys=True) + "\n").encode()
    _write_then_rename(out / _MANIFEST, lambda tmp: tmp.write_bytes(manifest))
    return out


def _drop_stale_weights(
    out: Path, owned: dict[str, str], written: dict[str, str]
) -> dict[str, str]:
    """Remove the weight files an earlier export wrote that this one did not (another shard
    count): left beside the new ones, a stale ``model.safetensors`` or index could be what
    ``from_pretrained`` reads. Only forge's own, unchanged files go; the rest of ``owned`` is
    returned."""
    kept = {}
    for name, sha in owned.items():
        stale = name not in written and (name.endswith(".safetensors") or name == _INDEX)
        path = out / name
        if stale and path.is_file() and not path.is_symlink() and _sha256(path) == sha:
            path.unlink()
            continue
        kept[name] = sha
    return kept


def _copy(source: Path, target: Path) -> None:
    _write_then_rename(target, lambda tmp: shutil.copyfile(source, tmp))


def _write_bytes(path: Path, data: bytes, written: dict[str, str]) -> None:
    _write_then_rename(path, lambda tmp: tmp.write_bytes(data))
    written[path.name] = hashlib.sha256(data).hexdigest()


def load_checkpoint_tensors(checkpoint: str | os.PathLike[str]) -> Filler:
    """A :data:`Filler` reading a ``forge train`` checkpoint's model tensors by name, in one
    process, only the names asked for (DCP reads the slices they need)."""
    from .dcp import load_model_tensors

    def fill(tensors: dict[str, Tensor]) -> None:
        load_model_tensors(checkpoint, tensors)

    return fill

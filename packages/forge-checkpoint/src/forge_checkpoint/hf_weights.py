"""Hugging Face weights in, sharded: fill a parallelized model from a model directory, each rank
reading only the slices of each tensor it owns.

A Hugging Face model directory holds ``model.safetensors`` or several safetensors files with an
index (``model.safetensors.index.json``: tensor name -> file). :func:`load_hf_weights` loads them
into a model whose parameters are already sharded (FSDP2, HSDP, TP, any mix: DTensors) or plain,
through torch.distributed.checkpoint's Hugging Face storage reader, which reads each rank's
slices with ``safetensors``' lazy slicing: no rank ever holds a whole tensor it does not own, let
alone the whole model. Values are converted to each parameter's dtype as they are copied.
A model whose names or layouts differ from the files' (a Hugging Face MoE model with its blocks
converted to stacked experts) is loaded with ``sources``: for each such name, a
:class:`forge_core.tensor_source.TensorSource` made by the layer that knows the layout; each
rank then assembles its own shard from the stored tensors (:mod:`forge_checkpoint.hf_sourced`).

:func:`hf_weight_problems` is the check before any rank starts: every name and shape the model
expects against the files' headers (read as JSON, no tensor data and no torch), one line per
kind of mismatch. A tensor the model ties to another (a language model head sharing the
embedding) may be absent from the files, as transformers writes it.

A process may hold only part of the model (a pipeline rank holds its stages' layers):
``load_hf_weights(..., partial=True)`` then reads only the tensors that process holds, and checks
the whole model, the union of every process's part, against the files, so that a tensor another
process holds is no error while one that no process holds, or one that some process needs and the
files lack, is refused on every rank in the same line.
"""

from __future__ import annotations

import json
import os
import re
import struct
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forge_core import ForgeConfigError
from forge_core.errors import refuse
from forge_core.tensor_source import TensorSource

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = [
    "HF_INDEX",
    "HF_SINGLE",
    "hf_weight_files",
    "hf_weight_problems",
    "hf_weight_shapes",
    "load_hf_weights",
]

HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
#: A tensor name of one expert of an MoE block (``model.layers.0.mlp.experts.3.up_proj.weight``).
_PER_EXPERT = re.compile(r"\.experts\.\d+\.")
#: A safetensors header larger than this is refused (the format's own readers cap it at 100 MB).
_MAX_HEADER = 100 * 1024 * 1024


def _index_files(directory: Path) -> dict[str, Path]:
    index = directory / HF_INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ForgeConfigError(f"{index}: not a readable safetensors index ({err})") from err
    if not isinstance(weight_map, dict):
        raise ForgeConfigError(f"{index}: 'weight_map' must map tensor names to files")
    files: dict[str, Path] = {}
    for name, file in weight_map.items():
        path = (directory / str(file)).resolve()
        if path.parent != directory.resolve() or not path.is_file():
            raise ForgeConfigError(
                f"{index}: tensor {name!r} names {file!r}, which is not a file in {directory}"
            )
        files[str(name)] = path
    return files


def hf_weight_files(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Each tensor name of a Hugging Face model directory -> the safetensors file holding it.

    Refuses, with one line naming the directory, one without weights, an index that names a
    file outside the directory or a missing one.
    """
    folder = Path(directory)
    if (folder / HF_INDEX).is_file():
        return _index_files(folder)
    single = folder / HF_SINGLE
    if single.is_file():
        return dict.fromkeys(_header(single), single)
    raise ForgeConfigError(
        f"{folder}: no {HF_SINGLE} or {HF_INDEX}: a Hugging Face model directory holds its "
        "weights as safetensors (save_pretrained writes them)"
    )


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's JSON header (8-byte little-endian length, then JSON), read without
    the tensor data: nothing in it can run code. Raises ``ValueError`` (or ``OSError``) for a
    file that is not one, or whose header is over 100 MB or past the file's end."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if not 2 <= size <= min(_MAX_HEADER, path.stat().st_size - 8):
            raise ValueError(f"header length {size} does not fit the file")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header


def _header(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a safetensors file's header records."""
    try:
        shapes = {
            str(name): tuple(int(d) for d in entry["shape"])
            for name, entry in safetensors_header(path).items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise ForgeConfigError(f"{path}: not a readable safetensors file ({err})") from err
    return shapes


def hf_weight_shapes(directory: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face model directory -> its shape, from the headers alone."""
    shapes: dict[str, tuple[int, ...]] = {}
    files = hf_weight_files(directory)
    for path in sorted(set(files.values())):
        shapes.update(_header(path))
    missing = sorted(set(files) - set(shapes))
    if missing:
        raise ForgeConfigError(
            f"{directory}: the index names {len(missing)} tensor(s) its files do not hold "
            f"({', '.join(missing[:3])})"
        )
    return {name: shapes[name] for name in files}


def _names(names: Iterable[str]) -> str:
    listed = sorted(names)
    more = f" and {len(listed) - 3} more" if len(listed) > 3 else ""
    return ", ".join(listed[:3]) + more


def _source_problems(
    expected: Mapping[str, tuple[int, ...]],
    stored: Mapping[str, tuple[int, ...]],
    sources: Mapping[str, TensorSource],
) -> tuple[set[str], list[str]]:
    """The stored tensors ``sources`` need that ``stored`` lacks, and those it holds in another
    shape than the source needs (``name [stored] (model: [needed])``)."""
    missing: set[str] = set()
    wrong = []
    for target, source in sorted(sources.items()):
        need = source.stored_shape(tuple(expected[target]))
        for name in source.stored:
            if name not in stored:
                missing.add(name)
            elif tuple(stored[name]) != need:
                wrong.append(f"{name} {list(stored[name])} (model: {list(need)}, for {target})")
    return missing, wrong


def hf_weight_problems(
    expected: Mapping[str, tuple[int, ...]],
    directory: str | os.PathLike[str],
    *,
    tied: Iterable[str] = (),
    sources: Mapping[str, TensorSource] | None = None,
) -> list[str]:
    """What stops ``directory``'s weights from filling a model that expects ``expected`` (name ->
    full shape): missing tensors (``tied`` ones excepted), tensors the model does not have, and
    shapes that differ, each one line naming the directory. An unreadable directory gives its
    own one line.

    ``sources`` (model name -> :class:`TensorSource`) names the tensors the files hold under
    other names or layouts (a converted MoE block's experts: ``forge_moe_ep``'s
    ``hf_checkpoint_sources``): for those, the stored tensors they are read from are checked,
    names and shapes, and counted as used.
    """
    try:
        stored = hf_weight_shapes(directory)
    except ForgeConfigError as err:
        return [str(err)]
    sources = {n: s for n, s in (sources or {}).items() if n in expected}
    direct = {n: shape for n, shape in expected.items() if n not in sources}
    used = {name for source in sources.values() for name in source.stored}
    missing = set(direct) - set(stored) - set(tied)
    per_expert = sorted(n for n in set(stored) - set(expected) - used if _PER_EXPERT.search(n))
    if per_expert and any(".experts." in n for n in missing):
        return [
            f"{directory}: the weights hold experts one by one ({per_expert[0]}, ...) where the "
            "model holds them stacked; they are read into converted MoE blocks only (sources= "
            "from forge_moe_ep.hf_checkpoint_sources; forge converts the blocks when tp or ep "
            "> 1): loading them into Hugging Face's own fused experts is not supported yet: use "
            "tp or ep > 1, or load the model with from_pretrained"
        ]
    source_missing, wrong = _source_problems(expected, stored, sources)
    problems = []
    if missing or source_missing:
        lacking = missing | source_missing
        problems.append(
            f"{directory}: the weights lack {len(lacking)} tensor(s) the model has "
            f"({_names(lacking)}); is the directory this model's (config.json)?"
        )
    unexpected = set(stored) - set(expected) - used
    if unexpected:
        problems.append(
            f"{directory}: the weights hold {len(unexpected)} tensor(s) the model does not have "
            f"({_names(unexpected)}); is config.json the one these weights were saved with?"
        )
    wrong = [
        f"{n} {list(stored[n])} (model: {list(direct[n])})"
        for n in sorted(set(stored) & set(direct))
        if tuple(stored[n]) != tuple(direct[n])
    ] + wrong
    if wrong:
        more = f" and {len(wrong) - 2} more" if len(wrong) > 2 else ""
        problems.append(
            f"{directory}: {len(wrong)} tensor(s) have another shape than the model's: "
            + "; ".join(wrong[:2])
            + more
        )
    return problems


def _tied_names(model: nn.Module, stored: Iterable[str]) -> set[str]:
    """Names absent from the files whose parameter is the very object a stored name holds (a
    tied head); ``state_dict(keep_vars=True)`` keeps the objects, which plain state dicts
    detach into distinct tensors."""
    present = set(stored)
    objects = model.state_dict(keep_vars=True)
    held = {id(t) for name, t in objects.items() if name in present}
    return {name for name, t in objects.items() if name not in present and id(t) in held}


def _whole_model_problems(
    shapes: dict[str, tuple[int, ...]],
    directory: str | os.PathLike[str],
    tied: set[str],
    sources: dict[str, TensorSource],
) -> list[str]:
    """:func:`hf_weight_problems` of the whole model whose parts the processes of the default
    group hold (each its names and shapes, tied names and sources, gathered to every rank): the
    same lines on every rank, so that all of them refuse together, before any collective read.
    Without a process group this process's part is the whole model."""
    import torch.distributed as dist

    parts: list[Any] = [(shapes, tied, sources)]
    if dist.is_available() and dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (shapes, tied, sources))
    expected: dict[str, tuple[int, ...]] = {}
    all_tied: set[str] = set()
    all_sources: dict[str, TensorSource] = {}
    for part_shapes, part_tied, part_sources in parts:
        expected.update(part_shapes)
        all_tied |= part_tied
        all_sources.update(part_sources)
    return hf_weight_problems(expected, directory, tied=all_tied, sources=all_sources)


def load_hf_weights(
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    sources: Mapping[str, TensorSource] | None = None,
    partial: bool = False,
) -> None:
    """Fill ``model`` (parallelized or not, materialized on its device) from a Hugging Face model
    directory's safetensors, each rank reading only its own slices.

    Collective when a process group is initialized: every rank of the model's group calls it.
    The model's parameter names must be the directory's tensor names (a model built from the
    directory's config.json), except those ``sources`` maps (model name ->
    :class:`TensorSource`: a converted MoE block's tensors, ``forge_moe_ep``'s
    ``hf_checkpoint_sources``); anything else is refused with one line, before any read. A
    renamed tensor is read as a direct one; the others are assembled on each rank for its own
    shard only (:func:`forge_checkpoint.hf_sourced.read_sourced`: the experts it holds, sliced).

    ``partial``: each process of the default group holds only a part of the model (a pipeline
    rank: its stages' layers, under the unsplit names). This process then reads only its part,
    and the names and shapes checked against the files are those of every process's part
    together (gathered: a collective even before the read), so that the tensors another process
    holds are not refused here, while a stored tensor no process holds, or one some process
    needs and the files lack, is refused on every rank with one line.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from .hf_sourced import read_sourced

    sources = dict(sources or {})
    state_dict = get_model_state_dict(model)
    stored = hf_weight_shapes(directory)
    tied = _tied_names(model, stored)
    shapes = {n: tuple(getattr(t, "shape", ())) for n, t in state_dict.items()}
    if partial:
        refuse(_whole_model_problems(shapes, directory, tied, sources))
    else:
        refuse(hf_weight_problems(shapes, directory, tied=tied, sources=sources))
    wanted = {name: t for name, t in state_dict.items() if name not in tied}
    renamed = {n: s.rename for n, s in sources.items() if s.rename is not None}
    direct = {
        renamed.get(name, name): t
        for name, t in wanted.items()
        if name not in sources or name in renamed
    }
    one_process = not (dist.is_available() and dist.is_initialized())
    reader = HuggingFaceStorageReader(str(directory))
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message=".*single process")
        dcp_load(direct, storage_reader=reader, no_dist=one_process)
    sourced = {n: s for n, s in sources.items() if n in wanted and n not in renamed}
    targets = {n: t for n, t in wanted.items() if n in sourced and isinstance(t, torch.Tensor)}
    read_sourced(targets, sourced, hf_weight_files(directory))
    set_model_state_dict(model, wanted, options=StateDictOptions(strict=False))

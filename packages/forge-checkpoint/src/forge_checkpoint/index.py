"""Reading DCP's index (``.metadata``) without running code from it.

DCP writes a checkpoint's index with :mod:`pickle`, and an unpickler imports every global a
pickle names and calls what the pickle tells it to: an unrestricted one runs whatever a file
asks for. This module's unpickler admits an allow-list of exact ``(module, name)`` pairs, the
globals DCP's index is made of (its metadata dataclasses, ``torch.Size``, the dtypes, a layout by
name, ``pathlib.PosixPath``, ``collections.OrderedDict``), and nothing else: no module-prefix
rule, no dotted name (pickle protocol 4 resolves ``a.b.c`` as an attribute chain: a prefix rule
once let ``torch.distributed.checkpoint.metadata.os.system`` through), no import. Each admitted
object only builds plain data; the classes among them are checked unchanged after every load
(a pickle can set attributes on an object it names).

What comes out is then checked for shape (:func:`_index_problem`): the types DCP's planner relies
on, sizes that are non-negative integers, chunks inside their tensors, a storage entry for every
chunk, shard files inside the checkpoint directory. A truncated, garbage or hostile index is one
:class:`~forge_checkpoint.files.CheckpointDamaged` line, never a traceback from inside DCP.
"""

from __future__ import annotations

import collections
import pathlib
import pickle
from enum import EnumMeta
from pathlib import Path
from typing import IO, Any, cast

import torch
from forge_core.torch_compat import dcp_index_globals, dcp_metadata_path
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .files import CheckpointDamaged

__all__ = ["RefusedPickle", "SafeFileSystemReader", "load_index", "model_shapes"]


class RefusedPickle(CheckpointDamaged, pickle.UnpicklingError):
    """A checkpoint index naming a global outside DCP's metadata (it is never resolved)."""


#: The globals of DCP's index, by the (module, name) a pickle names them with, resolved once
#: by exact lookup: DCP's public metadata classes, its private storage record and memory-format
#: enum (``forge_core.torch_compat.dcp_index_globals``: the index cannot be read without them),
#: the dtypes (``torch.float32`` pickles as the global ``torch float32``), ``torch.Size``,
#: ``pathlib.PosixPath`` (``StorageMeta.checkpoint_id``) and ``collections.OrderedDict``.
_PLAIN: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls
        for cls in (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )
    },
    **{k: v for k, v in dcp_index_globals().items() if k[1] != "_get_layout"},
    **{("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)},
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "Path"): pathlib.Path,
    ("collections", "OrderedDict"): collections.OrderedDict,
}
_STORAGE_INFO = _PLAIN[("torch.distributed.checkpoint.filesystem", "_StorageInfo")]
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _allowed() -> dict[tuple[str, str], Any]:
    """Every global an index may name, and what it stands for (a fresh table per load)."""
    layouts = dict(_LAYOUTS)
    # NOTE: a layout pickles as torch.serialization._get_layout("torch.strided"); this stands in
    # for it (a lookup in a fresh table, so a pickle cannot change torch's own cache).
    return {**_PLAIN, ("torch.serialization", "_get_layout"): lambda name: layouts[name]}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits exactly the globals of :func:`_allowed`; any other is refused, never imported."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self.allowed = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is None:
            raise RefusedPickle(
                f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's "
                "metadata; refusing to load it (the file may not come from "
                "torch.distributed.checkpoint)"
            )
        return found


def _mutable() -> list[Any]:
    """The admitted objects that have attributes a pickle could set (its BUILD opcode sets them
    on whatever object it names): the classes and the enum members."""
    found: list[Any] = [v for v in _PLAIN.values() if hasattr(v, "__dict__")]
    for enum in (v for v in _PLAIN.values() if isinstance(v, EnumMeta)):
        found += list(enum.__members__.values())
    return found


_MUTABLE = _mutable()


def load_index(stream: IO[bytes], name: str) -> Metadata:
    """Unpickle and check a DCP index from ``stream`` (``name``: the checkpoint, for messages).

    Raises :class:`CheckpointDamaged` (:class:`RefusedPickle` for a foreign global) with one line.
    """
    unpickler = _MetadataUnpickler(stream)
    before = {obj: dict(vars(obj)) for obj in _MUTABLE}
    try:
        metadata = unpickler.load()
    except RefusedPickle as e:
        raise RefusedPickle(f"{name}: {e}") from None
    except Exception as e:  # NOTE: a cut or garbage pickle fails in any way; all mean damaged
        raise CheckpointDamaged(
            f"{name}: .metadata is not a readable DCP index (truncated or not written by "
            f"torch.distributed.checkpoint: {type(e).__name__}: {e})"
        ) from None
    finally:
        changed = _restore(before)
    if changed:
        raise RefusedPickle(f"{name}: checkpoint metadata sets attributes of {changed}")
    try:
        problem = _index_problem(metadata)
    except Exception as e:  # NOTE: objects built without their fields (NEWOBJ, no BUILD)
        problem = f"{type(e).__name__}: {e}"
    if problem:
        raise CheckpointDamaged(f"{name}: .metadata is not a valid DCP index: {problem}")
    return metadata


def _restore(before: dict[Any, dict[str, Any]]) -> str | None:
    """Put back every attribute a pickle set on an admitted object; the first such object's
    name, or None when nothing changed."""
    changed = [obj for obj, attrs in before.items() if vars(obj) != attrs]
    for obj in changed:
        for key in set(vars(obj)) - set(before[obj]):
            delattr(obj, key)
        for key, value in before[obj].items():
            if vars(obj).get(key) is not value:
                setattr(obj, key, value)
    return getattr(changed[0], "__name__", repr(changed[0])) if changed else None


def _sizes(value: object, what: str) -> str | None:
    if not isinstance(value, torch.Size) or any(
        not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in value
    ):
        return f"{what} is {value!r}, not a size"
    return None


def _tensor_problem(key: str, item: TensorStorageMetadata) -> str | None:
    props = item.properties
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        return f"{key} has properties {props!r}"
    problem = _sizes(item.size, f"the size of {key}")
    if problem or not isinstance(item.chunks, list):
        return problem or f"the chunks of {key} are {item.chunks!r}"
    for chunk in item.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            return f"a chunk of {key} is {chunk!r}"
        problem = _sizes(chunk.offsets, f"a chunk offset of {key}") or _sizes(
            chunk.sizes, f"a chunk size of {key}"
        )
        if problem:
            return problem
        ends = [o + s for o, s in zip(chunk.offsets, chunk.sizes, strict=False)]
        if (
            len(chunk.offsets) != len(item.size)
            or len(chunk.sizes) != len(item.size)
            or any(end > dim for end, dim in zip(ends, item.size, strict=True))
        ):
            return f"a chunk of {key} lies outside its size {tuple(item.size)}"
    return None


def _storage_problem(index: object, info: object) -> str | None:
    if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
        return f"a storage key is {index!r}"
    if index.offset is not None and _sizes(index.offset, "an offset"):
        return f"the storage key of {index.fqn} has offset {index.offset!r}"
    if not isinstance(info, _STORAGE_INFO):
        return f"the storage of {index.fqn} is {info!r}"
    file = getattr(info, "relative_path", None)
    if not isinstance(file, str) or not file or "/" in file or "\\" in file or file[0] == ".":
        return f"{index.fqn} is stored in {file!r}, not a file of the checkpoint directory"
    numbers = (getattr(info, "offset", None), getattr(info, "length", None))
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
        return f"{index.fqn} has offset / length {numbers!r}"
    if getattr(info, "transform_descriptors", None):  # NOTE: forge writes no compression
        return f"{index.fqn} is stored with transforms {info.transform_descriptors!r}"
    return None


def _index_problem(metadata: object) -> str | None:
    """What is wrong with an unpickled index, or None."""
    if type(metadata) is not Metadata:
        return f"it holds a {type(metadata).__name__}, not DCP Metadata"
    items = metadata.state_dict_metadata
    if not isinstance(items, dict):
        return "its state_dict_metadata is not a dict"
    stored = metadata.storage_data
    if not isinstance(stored, dict):
        return "its storage_data is not a dict"
    for index, info in stored.items():
        problem = _storage_problem(index, info)
        if problem:
            return problem
    chunks = {(i.fqn, tuple(i.offset) if i.offset is not None else None) for i in stored}
    for key, item in items.items():
        if not isinstance(key, str):
            return f"a key is {key!r}"
        if isinstance(item, BytesStorageMetadata):
            continue  # refused by SafeFileSystemReader, naming the key
        if not isinstance(item, TensorStorageMetadata):
            return f"{key} is a {type(item).__name__}"
        problem = _tensor_problem(key, item)
        if problem:
            return problem
        lost = [c for c in item.chunks if (key, tuple(c.offsets)) not in chunks]
        if lost:
            return f"a chunk of {key} at {tuple(lost[0].offsets)} has no storage entry"
    return _extras_problem(metadata)


def _extras_problem(metadata: Metadata) -> str | None:
    """What is wrong with an index's storage record and planner data, or None."""
    meta = getattr(metadata, "storage_meta", None)
    if meta is not None and not isinstance(meta, StorageMeta):
        return f"its storage_meta is a {type(meta).__name__}"
    planner = getattr(metadata, "planner_data", None)
    if planner is not None and (
        not isinstance(planner, dict)
        or not all(
            isinstance(path, tuple | list) and all(isinstance(p, str | int) for p in path)
            for path in planner.values()
        )
    ):
        return "its planner_data is not a map of key paths"
    return None


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the restricted unpickler for ``.metadata``
    (:func:`load_index`) and no byte items (pickled objects)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forge_read: dict[int | None, Metadata] = {}  # the index, once read (per rank)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked index (:func:`load_index`), read once per reader; raises
        :class:`CheckpointDamaged`.

        NOTE: DCP's load catches a failure here and retries with a rank's own index (a file
        forge never writes), so that the error it then raises names neither: callers that want
        the plain line read the index themselves before ``dcp.load``, which then reuses it.
        """
        rank = kwargs.get("rank")
        if rank not in self._forge_read:
            self._forge_read[rank] = self._forge_load(rank)
        metadata = self._forge_read[rank]
        # NOTE: FileSystemReader.read_metadata also stamps a load id; keep that behaviour.
        storage_meta: StorageMeta | None = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def _forge_load(self, rank: int | None) -> Metadata:
        name = Path(str(self.path)).name
        try:
            with self.fs.create_stream(dcp_metadata_path(self, rank), "rb") as stream:
                metadata = load_index(cast(IO[bytes], stream), name)
        except OSError as e:
            raise CheckpointDamaged(
                f"{name}: .metadata cannot be read ({e.strerror or type(e).__name__})"
            ) from None
        pickled = [
            k
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, BytesStorageMetadata)
        ]
        if pickled:
            raise CheckpointDamaged(
                f"{str(self.path)!r} stores pickled objects {pickled[:3]}; forge checkpoints hold "
                "tensors only and forge does not unpickle arbitrary objects"
            )
        return metadata


def model_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The shape of every model tensor (parameters and persistent buffers, under their
    unsharded names) that checkpoint ``path``'s index records; read safely, no tensor data."""
    metadata = SafeFileSystemReader(Path(path)).read_metadata()
    return {
        key.removeprefix("model."): tuple(item.size)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }

"""Training checkpoints: sharded, resharding, atomic, optionally asynchronous.

A checkpoint is one directory ``<dir>/step-00000005`` holding

=========================  ======================================================================
``.metadata, *.distcp``    torch.distributed.checkpoint (DCP): model and optimizer tensors, keyed
                           by parameter name, each rank writing its own shards
``train_state.json``       step, data position, LR-scheduler state, optimizer hyperparameters,
                           the layout that saved it and the whole config
``rng/rank00000.pt``       each rank's torch RNG state (tensors only)
``manifest.json``          written last: the size and CRC-32 of every other file
=========================  ======================================================================

Resharding comes from DCP: tensors are stored with their global shapes and offsets, and
``torch.distributed.checkpoint.state_dict`` presents FSDP2 / TP / EP (DTensor) and plain models
under the same names. So a checkpoint saved by FSDP2 on 4 ranks loads into dp_shard 2 x tp 2,
another ep degree, or a single process.

Atomic: every save writes into ``<dir>/.tmp-step-N`` and rank 0 renames it to ``step-N`` only
after every rank has finished writing. A save killed half-way leaves a ``.tmp-*`` directory that
loading ignores (and the next save removes); the previous ``step-*`` is untouched.

Verified: rank 0 writes ``manifest.json`` after every rank's files are on disk, fsyncs every
file and the manifest, and only then renames the directory into place; the directory's names,
the manifest, its verification and the run lock are in :mod:`forge_checkpoint.files` (no
torch import: a launcher verifies before any rank starts).

Safe to load: nothing is unpickled with ``weights_only=False``. DCP's index file is read by an
unpickler that admits only DCP's own metadata classes; the state dict holds tensors only
(non-tensor state goes to JSON), RNG files load with ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from forge_core import ForgeConfigError
from forge_core.torch_compat import dcp_metadata_path
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .files import (
    MANIFEST,
    PREFIX,
    STATE_FILE,
    fsync_dir,
    read_train_state,
    step_dir,
    step_dirs,
    write_manifest,
)

__all__ = [
    "CheckpointIOError",
    "Checkpointer",
    "SafeFileSystemReader",
    "load_model_weights",
    "optimizer_hyperparameters",
]


class CheckpointIOError(RuntimeError):
    """A checkpoint save or load that failed on some rank (a full disk, a lost file system)."""


@contextmanager
def _plain_errors(what: str) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` into a :class:`CheckpointIOError` with one line.

    NOTE: ``CheckpointException`` derives from ``BaseException``, so ``except Exception`` handlers
    (torch's launcher records a rank's error that way) miss it, and its text is every failing
    rank's traceback. The line names the first rank and its own exception instead.
    """
    try:
        yield
    except CheckpointException as e:
        failures = getattr(e, "failures", None) or {}
        if not failures:
            raise CheckpointIOError(f"{what} failed: {str(e).splitlines()[0]}") from None
        rank = min(failures)
        cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        others = f" (and on rank(s) {sorted(failures)[1:]})" if len(failures) > 1 else ""
        raise CheckpointIOError(
            f"{what} failed on rank {rank}{others}: {type(cause).__name__}: {cause}"
        ) from None


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's metadata is made of; anything else is refused, never imported."""

    _MODULES = ("torch.distributed.checkpoint.metadata",)
    _NAMES = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "Path"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module in self._MODULES and not name.startswith("__")) or (
            (module, name) in self._NAMES
        )
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's "
                "metadata; refusing to load it (the file may not come from torch.distributed.checkpoint)"
            )
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with a restricted unpickler for ``.metadata`` and no byte items."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        with self.fs.create_stream(dcp_metadata_path(self, rank), "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise ForgeConfigError(f"{str(self.path)!r}: .metadata is not DCP metadata")
        pickled = [
            k
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, BytesStorageMetadata)
        ]
        if pickled:
            raise ForgeConfigError(
                f"{str(self.path)!r} stores pickled objects {pickled[:3]}; forge checkpoints hold "
                "tensors only and forge does not unpickle arbitrary objects"
            )
        # NOTE: FileSystemReader.read_metadata also stamps a load id; keep that behaviour.
        storage_meta: StorageMeta | None = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class Checkpointer:
    """Saves and loads training checkpoints under ``root``.

    ``process_group``: the group DCP coordinates on. With ``async_save`` pass a group used for
    nothing else (a gloo group): the background writer runs its collectives on it while training
    runs its own. ``keep``: how many newest ``step-*`` directories survive a save.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        keep: int = 2,
        async_save: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.root = Path(root)
        self.keep = keep
        self.async_save = async_save
        self.group = process_group
        self._pending: tuple[Future, Path, Path] | None = None

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: Mapping[str, Any],
    ) -> Path:
        """Write the checkpoint of ``step`` (returns its final path; with ``async_save`` the
        directory appears when :meth:`wait` or the next save finalizes it).

        ``train_state`` (JSON) goes to ``train_state.json`` with ``step``, ``world_size`` and the
        optimizer's param-group settings added, which :meth:`load` needs.
        """
        self.wait()
        world = dist.get_world_size() if dist.is_initialized() else 1
        facts = {"step": step, "param_groups": optimizer_hyperparameters(optimizer)}
        train_state = {**train_state, **facts, "world_size": world}
        tmp, final = self.root / f".tmp-{PREFIX}{step:08d}", step_dir(self.root, step)
        if _is_rank0():
            for stale in self.root.glob(f".tmp-{PREFIX}*"):  # leftovers of killed saves
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
            (tmp / STATE_FILE).write_text(json.dumps(dict(train_state), indent=1))
        self._barrier()
        rank = dist.get_rank() if dist.is_initialized() else 0
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(), tmp / "rng" / f"rank{rank:05d}.pt")
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer)["state"],
        }
        writer = FileSystemWriter(tmp)
        if self.async_save:
            with _plain_errors(f"writing checkpoint {final.name}"):
                future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
            # an AsyncSaveResponse comes only with a non-blocking async_stager, never passed here
            assert isinstance(future, Future)
            self._pending = (future, tmp, final)
        else:
            with _plain_errors(f"writing checkpoint {final.name}"):
                dcp.save(state, storage_writer=writer, process_group=self.group)
            self._finalize(tmp, final)
        return final

    def wait(self) -> None:
        """Finish a pending asynchronous save: wait for every rank's writes, then publish it."""
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        with _plain_errors(f"writing checkpoint {final.name}"):
            future.result()
        self._finalize(tmp, final)

    def _finalize(self, tmp: Path, final: Path) -> None:
        self._barrier()  # every rank's shards are on disk
        if _is_rank0():
            write_manifest(tmp)  # NOTE: last, fsynced, and before the rename publishes it
            if final.exists():  # the same step saved again (a resumed run): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
            done = [p for p in step_dirs(self.root) if (p / MANIFEST).is_file()]
            for old in done[self.keep :]:
                shutil.rmtree(old, ignore_errors=True)
        self._barrier()

    def load(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> dict[str, Any]:
        """Load model and optimizer state from ``path`` into this layout; returns the JSON state.

        The RNG state is restored only when the saving world size equals this one (per rank);
        otherwise each rank keeps its own seeded generator (``rng_restored`` says which).
        """
        path = Path(path)
        train_state = read_train_state(path)
        model_sd = get_model_state_dict(model)
        optim_sd = get_optimizer_state_dict(model, optimizer)  # creates AdamW's state tensors
        state = {"model": model_sd, "optim": optim_sd["state"]}
        with _plain_errors(f"loading checkpoint {path.name}"):
            dcp.load(state, storage_reader=SafeFileSystemReader(path), process_group=self.group)
        set_model_state_dict(model, model_sd)
        optim_sd["state"] = state["optim"]
        saved_groups = train_state["param_groups"]
        groups = optim_sd["param_groups"]
        assert isinstance(groups, list)  # get_optimizer_state_dict: a list of dicts, one a group
        if len(saved_groups) != len(groups):
            raise ForgeConfigError(
                f"{str(path)!r} has {len(saved_groups)} optimizer param groups, this optimizer "
                f"{len(groups)}: it was saved for another model or optimizer"
            )
        for group, saved in zip(groups, saved_groups, strict=True):
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
        set_optimizer_state_dict(model, optimizer, optim_sd)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        rng_file = path / "rng" / f"rank{rank:05d}.pt"
        restored = train_state.get("world_size") == world and rng_file.is_file()
        if restored:
            _set_rng_state(torch.load(rng_file, weights_only=True))
        return {**train_state, "rng_restored": restored}


def optimizer_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's JSON-able settings (lr, betas, ...), without the parameters."""
    return [
        {
            k: v
            for k, v in g.items()
            if k != "params" and isinstance(v, int | float | bool | tuple | str)
        }
        for g in optimizer.param_groups
    ]


def load_model_weights(path: str | os.PathLike[str], model: nn.Module) -> nn.Module:
    """Load only the model weights of checkpoint ``path`` into a plain model, in one process.

    For export: ``model`` is the unsharded model (materialized on the CPU); no process group is
    needed. Every tensor of the model must be in the checkpoint.
    """
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message=".*single process")
        with _plain_errors(f"loading checkpoint {Path(path).name}"):
            dcp.load(state, storage_reader=SafeFileSystemReader(Path(path)), no_dist=True)
    model.load_state_dict(state["model"])
    return model


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

"""Training checkpoints: sharded, resharding, atomic, verified, optionally asynchronous.

A checkpoint is one directory ``<dir>/step-00000005`` holding

=========================  ======================================================================
``.forge-checkpoint``      written first: the checkpoint's random id and step (forge wrote this)
``.metadata, *.distcp``    torch.distributed.checkpoint (DCP): model and optimizer tensors, keyed
                           by parameter name, each rank writing its own shards (and its binding)
``train_state.json``       step, checkpoint id, data position, LR-scheduler state, optimizer
                           hyperparameters, the layout that saved it and the whole config
``rng/rank00000.pt``       each rank's torch RNG state and binding (tensors only)
``manifest.json``          written last: the size and CRC-32 of every other file
=========================  ======================================================================

Resharding comes from DCP: tensors are stored with their global shapes and offsets, and
``torch.distributed.checkpoint.state_dict`` presents FSDP2 / TP / EP (DTensor) and plain models
under the same names. So a checkpoint saved by FSDP2 on 4 ranks loads into dp_shard 2 x tp 2,
another ep degree, or a single process.

Atomic: every save writes into ``<dir>/.tmp-step-N`` (marker first) and rank 0 renames it to
``step-N`` only after every rank has finished writing. A save killed half-way leaves a
``.tmp-*`` directory that loading ignores and the next save removes; the previous ``step-*`` is
untouched. Only directories forge marked (or empty ones) are ever removed or replaced: a
``step-N`` someone else put there stops the save with one line, and pruning (``keep``) passes
it by.

Verified: rank 0 writes ``manifest.json`` after every rank's files are on disk, fsyncs every
file and the manifest, and only then renames the directory into place (the names, the marker,
the manifest and its checks are in :mod:`forge_checkpoint.files`, without torch). Each shard
and RNG file carries the checkpoint's binding, compared at every load
(:mod:`forge_checkpoint.binding`).

Finite: a save counts the NaN/inf values in what it would write (model parameters and buffers,
optimizer state, the JSON train state) on every rank and agrees over the process group; with
any, it raises ``FloatingPointError`` before anything is written.

Safe to load: nothing is unpickled with ``weights_only=False``. DCP's index file is read by an
unpickler that admits an allow-list of exact globals (:mod:`forge_checkpoint.index`); the
state dict holds tensors only (non-tensor state goes to JSON), RNG files load with
``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from forge_core import ForgeConfigError
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from .binding import (
    BINDING_BYTES,
    ID_KEY,
    binding,
    binding_problem,
    expected_binding,
    first_cause,
    load_rng,
    rank_key,
    verify_shards,
)
from .files import (
    MANIFEST,
    STATE_FILE,
    TMP_PREFIX,
    CheckpointDamaged,
    forge_written,
    fsync_dir,
    nonfinite_at,
    read_train_state,
    remove_forge_dir,
    saved_param_groups,
    saved_world,
    step_dir,
    step_dirs,
    write_manifest,
    write_marker,
)
from .index import SafeFileSystemReader, model_shapes

__all__ = [
    "CheckpointIOError",
    "Checkpointer",
    "SafeFileSystemReader",
    "count_nonfinite",
    "load_model_weights",
    "model_shapes",
    "optimizer_hyperparameters",
    "verify_shards",
]

_T = TypeVar("_T")


class CheckpointIOError(RuntimeError):
    """A checkpoint save or load that failed on some rank (a full disk, a lost file system)."""


@contextmanager
def _plain_errors(what: str) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` into a :class:`CheckpointIOError` with one line (or
    the :class:`ForgeConfigError` a rank raised, such as :class:`CheckpointDamaged`, as is).

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
        rank, cause = min(failures), first_cause(e)
        if isinstance(cause, ForgeConfigError):
            raise cause from None
        others = f" (and on rank(s) {sorted(failures)[1:]})" if len(failures) > 1 else ""
        raise CheckpointIOError(
            f"{what} failed on rank {rank}{others}: {type(cause).__name__}: {cause}"
        ) from None


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _rank_and_world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def count_nonfinite(state: Mapping[str, Any]) -> tuple[int, str | None]:
    """How many NaN/inf values the floating-point tensors of a nested state dict hold on this
    rank (a DTensor: its local shard), and the key of the first one (``model.norm.weight``)."""
    named: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, key: str) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            if local.is_floating_point() or local.is_complex():
                named.append((key, local))

    walk(state, "")
    if not named:
        return 0, None
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    counts = [0] * len(named)
    for indices in by_device.values():  # NOTE: one device-to-host copy per device
        finite = torch.stack([torch.isfinite(named[i][1]).sum() for i in indices]).tolist()
        for i, n in zip(indices, finite, strict=True):
            counts[i] = named[i][1].numel() - int(n)
    first = next((named[i][0] for i, n in enumerate(counts) if n), None)
    return sum(counts), first


class Checkpointer:
    """Saves and loads training checkpoints under ``root``.

    ``process_group``: the group DCP coordinates on. With ``async_save`` pass a group used for
    nothing else (a gloo group): the background writer runs its collectives on it while training
    runs its own. ``keep``: how many newest ``step-*`` checkpoints forge wrote survive a save
    (directories forge did not write are never removed).
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

    def _on_rank0(self, what: str, fn: Callable[[], _T]) -> _T:
        """``fn()`` on rank 0, and its result on every rank; a failure raises on every rank
        (rank 0's own exception there, one line naming it on the others).

        NOTE: the other ranks wait on this broadcast, so an error on rank 0 alone must reach
        them, or they would wait for rank 0 forever.
        """
        outcome: list[Any] = [None]
        error: Exception | None = None
        if _is_rank0():
            try:
                outcome = [(True, fn())]
            except Exception as e:
                error = e
                outcome = [(False, type(e).__name__, str(e), isinstance(e, ForgeConfigError))]
        if dist.is_initialized():
            dist.broadcast_object_list(outcome, src=0, group=self.group)
        if error is not None:
            raise error
        if not outcome[0][0]:
            _, kind, message, config = outcome[0]
            if config:
                raise ForgeConfigError(message)
            raise CheckpointIOError(f"{what} failed on rank 0: {kind}: {message}")
        return outcome[0][1]

    def _refuse_nonfinite(self, state: Mapping[str, Any], name: str) -> None:
        """Raise ``FloatingPointError`` on every rank when any rank's ``state`` holds NaN/inf
        (agreed over the group, before anything of checkpoint ``name`` is written)."""
        model_bad, model_first = count_nonfinite({"model": state["model"]})
        optim_bad, optim_first = count_nonfinite({"optim": state["optim"]})
        json_at = nonfinite_at(state["train_state"])
        counts = torch.tensor([model_bad, optim_bad, int(json_at is not None)], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(counts, group=self.group)
        if not int(counts.sum()):
            return
        first = model_first or optim_first or (json_at and f"train_state.{json_at}")
        if dist.is_initialized():  # the first offending name of any rank, for the message
            names: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(names, first, group=self.group)
            first = next((n for n in names if n), first)
        parts = [
            f"{n} in {what}"
            for n, what in zip(
                counts.tolist(),
                ("the model (parameters and buffers)", "the optimizer state", "the train state"),
                strict=True,
            )
            if n
        ]
        raise FloatingPointError(
            f"non-finite values (NaN/inf): {', '.join(parts)} (first: {first}); checkpoint "
            f"{name} is not written"
        )

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: Mapping[str, Any],
    ) -> Path:
        """Write the checkpoint of ``step`` (returns its final path; with ``async_save`` the
        directory appears when :meth:`wait` or the next save finalizes it).

        ``train_state`` (JSON) goes to ``train_state.json`` with ``step``, ``world_size``, the
        ``checkpoint_id`` and the optimizer's param-group settings added, which :meth:`load`
        needs. Raises ``FloatingPointError`` (on every rank, nothing written) when the model,
        the optimizer state or ``train_state`` holds NaN/inf, and :class:`ForgeConfigError`
        when ``step-N`` exists and forge did not write it.
        """
        self.wait()
        rank, world = _rank_and_world()
        tmp, final = self.root / f"{TMP_PREFIX}{step:08d}", step_dir(self.root, step)
        state: dict[str, Any] = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer)["state"],
        }
        facts = {"step": step, "param_groups": optimizer_hyperparameters(optimizer)}
        self._refuse_nonfinite({**state, "train_state": {**train_state, **facts}}, final.name)
        full_state = {**train_state, **facts, "world_size": world}
        ident, text = self._on_rank0(
            f"writing checkpoint {final.name}", lambda: self._begin(tmp, final, step, full_state)
        )
        bound = binding(ident, text)
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save({**_rng_state(), "binding": bound}, tmp / "rng" / f"{rank_key(rank)}.pt")
        state[ID_KEY] = {rank_key(rank): bound}  # NOTE: a key of its own: in this rank's file
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

    def _begin(
        self, tmp: Path, final: Path, step: int, train_state: dict[str, Any]
    ) -> tuple[str, bytes]:
        """Rank 0: clear leftovers of killed saves, make ``tmp`` with its marker and the train
        state; returns the new checkpoint id and the train state's text."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in sorted(self.root.glob(f"{TMP_PREFIX}*")):
            remove_forge_dir(stale)  # NOTE: only what forge marked (or an empty directory)
        for path in (final, tmp):  # final, if forge's, is replaced once this save is complete
            if not forge_written(path) and not remove_forge_dir(path):
                raise ForgeConfigError(_foreign(path))
        ident = uuid.uuid4().hex
        tmp.mkdir()
        write_marker(tmp, ident, step)
        text = json.dumps({**train_state, "checkpoint_id": ident}, indent=1, allow_nan=False)
        (tmp / STATE_FILE).write_text(text)
        return ident, text.encode()

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
        self._on_rank0(f"publishing checkpoint {final.name}", lambda: self._publish(tmp, final))

    def _publish(self, tmp: Path, final: Path) -> None:
        """Rank 0: manifest, rename into place, prune to ``keep`` (forge's directories only)."""
        write_manifest(tmp)  # NOTE: last, fsynced, and before the rename publishes it
        if (final.exists() or final.is_symlink()) and not remove_forge_dir(final):  # step again
            raise ForgeConfigError(_foreign(final))
        os.replace(tmp, final)
        fsync_dir(self.root)
        done = [p for p in step_dirs(self.root) if forge_written(p) and (p / MANIFEST).is_file()]
        for old in done[self.keep :]:
            remove_forge_dir(old)

    def load(
        self,
        path: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> dict[str, Any]:
        """Load model and optimizer state from ``path`` into this layout; returns the JSON state.

        Every saved rank's binding (its shard's and its RNG file's) is compared with the
        checkpoint's, each by one rank, and the ranks agree: any mismatch raises
        :class:`CheckpointDamaged` on every rank. The RNG state is restored only when the
        saving world size equals this one (per rank); otherwise each rank keeps its own seeded
        generator (``rng_restored`` says which).
        """
        path = Path(path)
        train_state = read_train_state(path)
        expected = expected_binding(path, train_state)
        rank, world = _rank_and_world()
        mine = range(rank, saved_world(train_state, path), world)
        bindings = {rank_key(r): torch.zeros(BINDING_BYTES, dtype=torch.uint8) for r in mine}
        model_sd = get_model_state_dict(model)
        optim_sd = get_optimizer_state_dict(model, optimizer)  # creates AdamW's state tensors
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd["state"]}
        if bindings:
            state[ID_KEY] = bindings
        reader = SafeFileSystemReader(path)
        reader.read_metadata()  # NOTE: a damaged index is one plain line, the same on every rank
        with _plain_errors(f"loading checkpoint {path.name}"):
            dcp.load(state, storage_reader=reader, process_group=self.group)
        rng: dict[int, dict[str, torch.Tensor]] = {}
        try:
            problem = binding_problem(path, reader, bindings, expected)
            rng = {r: load_rng(path, r, expected) for r in mine} if problem is None else {}
        except CheckpointDamaged as e:
            problem = str(e)
        self._agree_intact(problem)
        set_model_state_dict(model, model_sd)
        optim_sd["state"] = state["optim"]
        saved_groups = saved_param_groups(train_state, path)
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
        restored = train_state.get("world_size") == world and rank in rng
        if restored:
            _set_rng_state(rng[rank])
        return {**train_state, "rng_restored": restored}

    def _agree_intact(self, problem: str | None) -> None:
        """Raise :class:`CheckpointDamaged` on every rank when any rank found ``problem``."""
        problems: list[Any] = [problem]
        if dist.is_initialized():
            problems = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(problems, problem, group=self.group)
        found = next((p for p in problems if p), None)
        if found:
            raise CheckpointDamaged(found)


def _foreign(path: Path) -> str:
    return (
        f"{str(path)!r} was not written by forge (no valid marker in it): forge never removes "
        f"or replaces it; move it out of {str(path.parent)!r}, or choose another checkpoint "
        "directory"
    )


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
    needed. Every tensor of the model must be in the checkpoint, and every saved rank's shard
    must carry the checkpoint's binding (:class:`CheckpointDamaged` otherwise).
    """
    state = model.state_dict()
    load_model_tensors(path, state)
    model.load_state_dict(state)
    return model


def load_model_tensors(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor]) -> None:
    """Fill ``tensors`` (model state-dict names -> whole tensors of their shapes) from
    checkpoint ``path`` in one process, reading only those names' slices: a caller that asks a
    few names at a time holds no more than those (an export writing shard by shard)."""
    path = Path(path)
    train_state = read_train_state(path)
    expected = expected_binding(path, train_state)
    world = saved_world(train_state, path)
    bindings = {rank_key(r): torch.zeros(BINDING_BYTES, dtype=torch.uint8) for r in range(world)}
    state = {"model": tensors, ID_KEY: bindings}
    reader = SafeFileSystemReader(path)
    reader.read_metadata()  # NOTE: a damaged index is one plain line (see read_metadata)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message=".*single process")
        with _plain_errors(f"loading checkpoint {path.name}"):
            dcp.load(state, storage_reader=reader, no_dist=True)
    problem = binding_problem(path, reader, bindings, expected)
    if problem:
        raise CheckpointDamaged(problem)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

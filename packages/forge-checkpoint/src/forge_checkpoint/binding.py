"""Every shard and RNG file bound to its checkpoint, which a recomputed manifest cannot fake.

The manifest proves that a checkpoint's files are the ones written, unless someone rewrote it
too; it cannot say which checkpoint a file came from. A shard copied in from another run of the
same model (with its manifest entry) has the right name and offsets and would load silently.
So each save draws a random checkpoint id. Rank 0 writes it into the marker and
``train_state.json``; every rank writes a 32-byte *binding* into its DCP shard (a uint8 tensor
under its own key ``forge_checkpoint_id.rankNNNNN``, so it lands in that rank's ``.distcp``
file) and into its RNG file: the id and the first 16 bytes of the SHA-256 of
``train_state.json`` as written, so an edited train state shows too. Loading compares them
(:func:`binding_problem`, :func:`load_rng`); :func:`verify_shards` reads every rank's in one
process (a launcher, before any rank starts).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from .files import STATE_FILE, CheckpointDamaged, is_checkpoint_id, read_train_state, saved_world
from .index import SafeFileSystemReader

__all__ = [
    "BINDING_BYTES",
    "ID_KEY",
    "binding",
    "binding_problem",
    "expected_binding",
    "first_cause",
    "load_rng",
    "rank_key",
    "verify_shards",
]

#: The DCP state-dict key under which each rank saves its binding (``<ID_KEY>.rankNNNNN``).
ID_KEY = "forge_checkpoint_id"
#: 16 bytes of checkpoint id, 16 of the train state's SHA-256.
BINDING_BYTES = 32


def rank_key(rank: int) -> str:
    return f"rank{rank:05d}"


def binding(checkpoint_id: str, state_text: bytes) -> torch.Tensor:
    """The binding of a checkpoint with id ``checkpoint_id`` whose ``train_state.json`` holds
    ``state_text``: a uint8 tensor of :data:`BINDING_BYTES`."""
    raw = bytes.fromhex(checkpoint_id) + hashlib.sha256(state_text).digest()[:16]
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def expected_binding(path: Path, state: Mapping[str, Any]) -> torch.Tensor:
    """The binding every file of checkpoint ``path`` (train state ``state``) must carry."""
    ident = state.get("checkpoint_id")
    if not is_checkpoint_id(ident):
        raise CheckpointDamaged(f"{path.name}: {STATE_FILE} has no valid checkpoint_id ({ident!r})")
    return binding(str(ident), (path / STATE_FILE).read_bytes())


def _mismatch(name: str, file: str, got: torch.Tensor, expected: torch.Tensor) -> str:
    if torch.equal(got[:16], expected[:16]):
        return (
            f"{name}: {STATE_FILE} was changed after the shards were written ({file} records "
            "another train state)"
        )
    return (
        f"{name}: {file} belongs to another checkpoint (id {bytes(got[:16].tolist()).hex()}, "
        f"this checkpoint is {bytes(expected[:16].tolist()).hex()}): a file copied from elsewhere"
    )


def _shard_file(reader: FileSystemReader, key: str) -> str:
    fqn = f"{ID_KEY}.{key}"
    found = (i for idx, i in reader.storage_data.items() if idx.fqn == fqn)
    return str(getattr(next(found, None), "relative_path", f"the shard holding {fqn}"))


def binding_problem(
    path: Path, reader: FileSystemReader, loaded: Mapping[str, torch.Tensor], expected: torch.Tensor
) -> str | None:
    """What is wrong with the bindings ``loaded`` (rank key -> tensor) that ``reader`` read
    from checkpoint ``path``'s shards, or None."""
    for key, got in loaded.items():
        if not torch.equal(got, expected):
            return _mismatch(path.name, _shard_file(reader, key), got, expected)
    return None


def load_rng(path: Path, rank: int, expected: torch.Tensor) -> dict[str, torch.Tensor]:
    """The RNG state saved by ``rank`` in checkpoint ``path``, after checking its binding and
    shape (``weights_only``: tensors only). Raises :class:`CheckpointDamaged`."""
    rel = f"rng/{rank_key(rank)}.pt"
    try:
        state = torch.load(path / rel, weights_only=True, map_location="cpu")
    except Exception as e:  # NOTE: a cut or foreign file fails in any way; all mean damaged
        raise CheckpointDamaged(
            f"{path.name}: {rel} is not a readable RNG state ({type(e).__name__})"
        ) from None
    cpu_size = torch.get_rng_state().numel()
    if (
        not isinstance(state, dict)
        or not set(state) <= {"cpu", "cuda", "binding"}
        or not all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in state.values())
        or "cpu" not in state
        or state["cpu"].shape != (cpu_size,)
    ):
        raise CheckpointDamaged(f"{path.name}: {rel} is not an RNG state saved by forge")
    got = state.get("binding")
    if got is None or got.shape != (BINDING_BYTES,):
        raise CheckpointDamaged(f"{path.name}: {rel} carries no checkpoint id")
    if not torch.equal(got, expected):
        raise CheckpointDamaged(_mismatch(path.name, rel, got, expected))
    return state


def verify_shards(path: str | Path) -> None:
    """Check that every rank's shard and RNG file of checkpoint ``path`` belong to it (their
    bindings equal the one of its id and train state); one process, no process group, reading
    32 bytes per shard. Raises :class:`CheckpointDamaged` naming the file."""
    path = Path(path)
    state = read_train_state(path)
    expected = expected_binding(path, state)
    world = saved_world(state, path)
    loaded = {rank_key(r): torch.zeros(BINDING_BYTES, dtype=torch.uint8) for r in range(world)}
    reader = SafeFileSystemReader(path)
    reader.read_metadata()  # NOTE: a damaged index is one plain line (see read_metadata)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.load({ID_KEY: loaded}, storage_reader=reader, no_dist=True)
    except (CheckpointException, Exception) as e:  # NOTE: DCP's is a BaseException
        cause = first_cause(e)
        if isinstance(cause, CheckpointDamaged):
            raise cause from None
        raise CheckpointDamaged(
            f"{path.name}: the shards' checkpoint ids cannot be read "
            f"({type(cause).__name__}: {str(cause).partition(chr(10))[0]})"
        ) from None
    problem = binding_problem(path, reader, loaded, expected)
    if problem:
        raise CheckpointDamaged(problem)
    for rank in range(world):
        load_rng(path, rank, expected)


def first_cause(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException`` (else ``error``)."""
    failures = getattr(error, "failures", None) or {}
    if not failures:
        return error
    failure = failures[min(failures)]
    return failure[0] if isinstance(failure, tuple) else failure

"""Deterministic parameter initialization that gives the same values sharded or not.

Each parameter is filled from its own generator, seeded by ``(seed, canonical name)``. The full
tensor is generated on the CPU and, for a DTensor parameter (FSDP2 shard, TP shard), only the
local slice is copied in, using the DTensor's own layout. So rank r of any mesh holds exactly the
slice of the tensor a single-device model would hold: bit-identical, with no collective.
Generating the full tensor costs one parameter's worth of CPU memory at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from .torch_compat import local_shape_and_offset

__all__ = ["canonical_name", "copy_full_", "fill_param_", "param_seed"]

# Name segments that activation checkpointing, torch.compile and FSDP1 insert.
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def canonical_name(fqn: str) -> str:
    """The parameter name without wrapper segments, so init does not depend on wrapping."""
    return ".".join(p for p in fqn.split(".") if p not in _WRAPPER_SEGMENTS)


def param_seed(seed: int, fqn: str) -> int:
    """A 63-bit seed from the global seed and the canonical name (stable across processes)."""
    digest = hashlib.sha256(f"{seed}:{canonical_name(fqn)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def fill_param_(
    param: torch.Tensor,
    fqn: str,
    seed: int,
    init_fn: Callable[[torch.Tensor, torch.Generator], object],
) -> None:
    """Fill ``param`` in place with ``init_fn(full_tensor, generator)``, sharded or not."""
    full = torch.empty(param.shape, dtype=torch.float32, device="cpu")
    init_fn(full, torch.Generator(device="cpu").manual_seed(param_seed(seed, fqn)))
    copy_full_(param, full)


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into ``param`` its part of ``full`` (the whole tensor's values): for a DTensor only
    the local slice its layout gives this rank, with no collective; else everything."""
    if isinstance(param, DTensor):
        local = param.to_local()
        shape, offset = local_shape_and_offset(param.shape, param.device_mesh, param.placements)
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        local.copy_(full[index])
    else:
        param.copy_(full)

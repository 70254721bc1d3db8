"""Tensors read from a Hugging Face checkpoint under other names or layouts, each rank reading
only its own part: :func:`read_sourced`.

A :class:`forge_core.tensor_source.TensorSource` says where a model tensor's values lie (one
stored tensor per expert, or a slice of a fused one). For a sharded tensor (a DTensor: FSDP2
and expert parallelism shard the experts, dim 0) this rank's box, its local shape at its offset
in the whole tensor, is mapped onto the stored tensors and only that is read, with
``safetensors``' lazy slicing: the experts the rank holds, and within them only its rows and
columns. Nothing is exchanged between ranks, so it runs on every rank in any order; a plain
tensor is read whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from forge_core.tensor_source import TensorSource
from forge_core.torch_compat import local_shape_and_offset
from torch.distributed.tensor import DTensor

__all__ = ["local_box", "read_sourced", "stored_slices"]


def local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(local tensor, its shape, its offset in the whole tensor)`` of this rank."""
    if isinstance(tensor, DTensor):
        shape, offset = local_shape_and_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return tensor.to_local(), shape, offset
    return tensor, tuple(tensor.shape), (0,) * tensor.dim()


def stored_slices(
    source: TensorSource,
    target: tuple[int, ...],
    shape: tuple[int, ...],
    offset: tuple[int, ...],
) -> tuple[tuple[slice, ...], int]:
    """What to read of each stored tensor for the box ``shape`` at ``offset`` of a target of
    shape ``target``: the slices, in the stored tensor's own dim order (without the expert dim
    when ``source.stacked``: one stored tensor per row), and the step still to take along the
    stored dim that is the target's last (interleaved parts; 1 when none)."""
    box = list(zip(offset, shape, strict=True))
    if source.stacked:
        box = box[1:]
    slices = [slice(start, start + size) for start, size in box]
    step = 1
    if box:
        start, size = box[-1]
        first, stop, step = source.last_dim(target[-1], start, size)
        slices[-1] = slice(first, stop)
    if source.transpose and len(slices) >= 2:
        slices[-2], slices[-1] = slices[-1], slices[-2]
    return tuple(slices), step


class _Files:
    """The checkpoint's files, each opened once (lazily) for the reads of one load."""

    def __init__(self, files: Mapping[str, Path], stack: contextlib.ExitStack) -> None:
        self.files, self.stack = files, stack
        self.open: dict[Path, Any] = {}

    def read(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """``name[slices]``, reading only that part of the file."""
        import safetensors

        path = self.files[name]
        if path not in self.open:
            handle = safetensors.safe_open(str(path), framework="pt", device="cpu")
            self.open[path] = self.stack.enter_context(handle)
        return self.open[path].get_slice(name)[slices]


def _assemble(
    files: _Files,
    source: TensorSource,
    target: tuple[int, ...],
    shape: tuple[int, ...],
    offset: tuple[int, ...],
) -> torch.Tensor:
    """This rank's box of the target, read from the stored tensors and laid out as the target."""
    slices, step = stored_slices(source, target, shape, offset)

    def laid_out(stored: torch.Tensor) -> torch.Tensor:
        if step > 1:
            index = [slice(None)] * stored.dim()
            index[-2 if source.transpose else -1] = slice(None, None, step)
            stored = stored[tuple(index)]
        return stored.transpose(-1, -2) if source.transpose else stored

    if not source.stacked:
        return laid_out(files.read(source.stored[0], slices))
    rows = range(offset[0], offset[0] + shape[0])
    return torch.stack([laid_out(files.read(source.stored[row], slices)) for row in rows])


@torch.no_grad()
def read_sourced(
    targets: Mapping[str, torch.Tensor],
    sources: Mapping[str, TensorSource],
    files: Mapping[str, Path],
) -> None:
    """Fill each of ``targets`` (model name -> its tensor, a DTensor or plain) from the stored
    tensors ``sources`` names, this rank's part only; ``files``: stored name -> its file
    (:func:`forge_checkpoint.hf_weights.hf_weight_files`). Values are converted to each
    target's dtype. The names and shapes are assumed checked
    (:func:`forge_checkpoint.hf_weights.hf_weight_problems` with the same sources)."""
    with contextlib.ExitStack() as stack:
        reader = _Files(files, stack)
        for name, tensor in targets.items():
            source = sources[name]
            local, shape, offset = local_box(tensor)
            if source.constant is not None:
                local.fill_(source.constant)
                continue
            if local.numel() == 0:
                continue  # an empty shard (more ranks than rows): nothing to read
            values = _assemble(reader, source, tuple(tensor.shape), shape, offset)
            if tuple(values.shape) != tuple(local.shape):
                raise RuntimeError(
                    f"{name}: read {tuple(values.shape)} for a local shard of {tuple(local.shape)}"
                )
            local.copy_(values)

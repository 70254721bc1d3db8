"""What autograd holds for backward, measured: the peak bytes of the storages saved tensors
keep alive (forge plan's activation estimates are checked against it, in tests and in
tools/bench_plan_accuracy.py).

Each tensor a ``saved_tensors_hooks`` pack hook sees counts while autograd keeps it (a weak
reference to the packed handle tells when it is freed), once per storage; a pipeline stage's
outputs can be counted the same way (:meth:`SavedTensorPeak.hold`). Weights are left out: any
storage of a tensor registered as a parameter or buffer of the model when it is saved (FSDP2's
unsharded weights, gathered again for backward; the weights ``F.linear`` saves).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["SavedTensorPeak"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor, waited for when it is an asynchronous collective's."""
    t = t.to_local() if isinstance(t, DTensor) else t
    wait = getattr(t, "trigger_wait", None)  # NOTE: functional collectives' lazy result
    return wait() if callable(wait) else t


class _Saved:
    """A detached alias of a saved tensor. NOTE: the tensor itself would tie the autograd node
    that saved its own output into a cycle through C++, which zero-bubble pipeline schedules
    (input and weight gradients apart, part of the graph never run twice) never free."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()


class SavedTensorPeak:
    """The storages held for backward now (``now``) and at their peak (``peak``), in bytes."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.now = self.peak = 0

    def _weights(self) -> set[int]:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return {_local(t).untyped_storage().data_ptr() for t in tensors}

    def hold(self, owner: object, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage while ``owner`` lives (once however many hold it)."""
        local = _local(tensor)
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if local.is_meta or key == 0 or key in self._weights():
            return
        if not self.refs.get(key):
            self.size[key] = storage.nbytes()
            self.now += self.size[key]
            self.peak = max(self.peak, self.now)
        self.refs[key] = self.refs.get(key, 0) + 1
        weakref.finalize(owner, self._drop, key)

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.now -= self.size.pop(key)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        self.hold(saved, tensor)
        return saved

    @contextlib.contextmanager
    def measuring(self, outputs_of: Sequence[nn.Module] = ()) -> Iterator[SavedTensorPeak]:
        """Count what autograd saves inside the block, and the outputs of ``outputs_of`` (a
        pipeline's stage modules: torch's stage keeps each output until its backward)."""

        def output_hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            self.hold(output, output)

        hooks = [m.register_forward_hook(output_hook) for m in outputs_of]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda s: s.tensor):
                yield self
        finally:
            for hook in hooks:
                hook.remove()

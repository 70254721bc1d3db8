"""Catch device->host synchronizations: :func:`no_host_sync` raises, :func:`count_host_syncs` counts.

A host sync (``.item()``, a data-dependent output shape, a copy to the host) stalls the CPU until
the GPU drains its queue, which serialises compute with communication. These guards find them.

- On CUDA they use torch's own detector, ``torch.cuda.set_sync_debug_mode``, which sees real syncs.
- Elsewhere (CPU tests) nothing actually synchronizes, so the guards flag the ops that *would*
  synchronize a GPU: a :class:`~torch.utils._python_dispatch.TorchDispatchMode` checks every aten op
  against :data:`SYNC_OPS`. The mode is thread-local; CPU backward passes run on the calling thread,
  so syncs inside ``loss.backward()`` (custom autograd Functions included) are caught too.
- ``Tensor.tolist()`` and ``Tensor.numpy()`` copy to the host without going through the dispatcher,
  so a dispatch mode never sees them. While a guard is active, ``torch.Tensor.tolist`` and
  ``torch.Tensor.numpy`` are replaced by reporting wrappers: a process-global patch, restored on
  exit (also on error). Wrappers report only on the thread that entered the guard, nest, and
  unlink correctly even if guards on two threads exit out of order.
- Eager mode only. torch.compile cannot run under a dispatch mode, so the CPU guard also sets
  ``torch.compiler.set_stance("force_eager")``: compiled modules run their eager code inside the
  block, and the guard checks those ops (a compiled graph may fuse some of them away).

Not seen on CPU: host copies via ``.cpu()`` / ``.to("cpu")`` (a no-op on CPU tensors), syncs hidden
inside an op's kernel (e.g. ``torch.tensor([t0, t1])`` from 0-d tensors, linalg error checks).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, NamedTuple, NoReturn

import torch

from ..torch_compat import TorchDispatchMode, overload_name

__all__ = [
    "SYNC_OPS",
    "HostSyncCounter",
    "HostSyncError",
    "SyncOp",
    "count_host_syncs",
    "no_host_sync",
]


class SyncOp(NamedTuple):
    """One flagged op: its name, how Python code usually spells it, and what to do instead."""

    name: str
    spelling: str
    instead: str


_KEEP_ON_DEVICE = (
    "keep the value on the device as a tensor (torch.where, clamp, masked_fill, arithmetic) "
    "and read it on the host once, outside the step"
)
_STATIC_SHAPE = (
    "use a static-size formulation: torch.where(cond, a, b), masked_fill, scatter/scatter_add_, "
    "or torch.nonzero_static(x, size=...)"
)
_BOOL_INDEX = (
    "boolean-mask indexing needs nonzero: use torch.where(mask, x, y) or x.masked_fill_(mask, v) "
    "(v may be a 0-d tensor), or index with integer indices"
)

#: The ops that synchronize a GPU with the host, matched by overload packet (``aten.index`` covers
#: every overload). Three are flagged only in the form that syncs: ``aten.repeat_interleave``
#: without ``output_size``, and ``aten.index`` / ``aten.index_put(_)`` with a bool or uint8 index
#: (``x[mask] = scalar`` runs as ``masked_fill_``, directly or inside ``index_put_``: not flagged).
#: ``Tensor.tolist`` / ``Tensor.numpy`` are caught by patching, not by the dispatch mode.
SYNC_OPS: tuple[SyncOp, ...] = (
    SyncOp(
        "aten._local_scalar_dense", "t.item(), int(t), float(t), bool(t), `if t:`", _KEEP_ON_DEVICE
    ),
    # Composite: normally arrives as _local_scalar_dense; listed in case it is dispatched whole.
    SyncOp("aten.is_nonzero", "torch.is_nonzero(t), bool(t)", _KEEP_ON_DEVICE),
    SyncOp(
        "aten.equal", "torch.equal(a, b)", "compare on the device: (a == b).all() stays a tensor"
    ),
    SyncOp("aten.allclose", "torch.allclose(a, b)", "torch.isclose(a, b).all() stays a tensor"),
    SyncOp("aten.nonzero", "t.nonzero(), torch.argwhere(t), torch.where(cond)", _STATIC_SHAPE),
    SyncOp("aten._unique2", "torch.unique(t), t.unique()", _STATIC_SHAPE),
    SyncOp("aten._unique", "torch._unique(t)", _STATIC_SHAPE),
    SyncOp("aten.unique_dim", "torch.unique(t, dim=...)", _STATIC_SHAPE),
    SyncOp("aten.unique_consecutive", "torch.unique_consecutive(t)", _STATIC_SHAPE),
    SyncOp("aten.masked_select", "t.masked_select(mask)", _STATIC_SHAPE),
    SyncOp(
        "aten.bincount",
        "torch.bincount(t)",
        "it reads max(t) on the host: use torch.zeros(n).scatter_add_(0, t, ones) with a known n",
    ),
    SyncOp(
        "aten.repeat_interleave",
        "t.repeat_interleave(repeats_tensor) without output_size",
        "pass output_size=... (the total, known on the host) so the output size is not read back",
    ),
    SyncOp("aten.index", "x[mask] with a bool/uint8 mask", _BOOL_INDEX),
    SyncOp("aten.index_put", "x.index_put((mask,), values) with a bool/uint8 mask", _BOOL_INDEX),
    SyncOp("aten.index_put_", "x[mask] = tensor with a bool/uint8 mask", _BOOL_INDEX),
    SyncOp("Tensor.tolist", "t.tolist()", _KEEP_ON_DEVICE),
    SyncOp("Tensor.numpy", "t.numpy(), np.asarray(t)", _KEEP_ON_DEVICE),
)

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


class HostSyncError(RuntimeError):
    """An op inside :func:`no_host_sync` would synchronize the GPU with the host."""


@dataclass
class HostSyncCounter:
    """Host syncs seen by :func:`count_host_syncs`: the total and a count per op name.

    On CUDA torch's warning does not name the op, so ``ops`` is keyed by call site
    (``"file.py:12"``) instead, and both fields are filled in when the block exits.
    """

    count: int = 0
    ops: Counter[str] = field(default_factory=Counter)

    def add(self, key: str) -> None:
        self.count += 1
        self.ops[key] += 1


def _on_cuda(device: torch.device | str | None) -> bool:
    if not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


def _op(name: str) -> SyncOp:
    return next(op for op in SYNC_OPS if op.name == name)


def _flagged(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    host_value: torch.Tensor | None = None,
) -> SyncOp | None:
    """The entry of :data:`SYNC_OPS` that this call hits, or None when it does not sync.

    ``host_value``: the output of the op just before this one if that was ``aten.lift_fresh``
    (a Python scalar made into a host tensor by indexing; see :func:`_fills_like_masked_fill`).
    """
    name = str(func.overloadpacket)
    op = next((op for op in SYNC_OPS if op.name == name), None)
    if op is None:
        return None
    if name == "aten.repeat_interleave":
        return (
            op if overload_name(func) != "self_int" and kwargs.get("output_size") is None else None
        )
    if name in ("aten.index", "aten.index_put", "aten.index_put_"):
        masks = [i for i in args[1] if i is not None and i.dtype in (torch.bool, torch.uint8)]
        if not masks:
            return None
        if name == "aten.index_put_" and _fills_like_masked_fill(args, kwargs, masks, host_value):
            return None
        return op
    return op


def _fills_like_masked_fill(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    masks: list[torch.Tensor],
    host_value: torch.Tensor | None,
) -> bool:
    """Whether ATen runs this ``index_put_`` as ``masked_fill_`` (no ``nonzero``, no sync).

    NOTE: torch <= 2.14 sends ``x[mask] = 0.0`` to ``index_put_`` with the scalar in a fresh
    host tensor (``lift_fresh`` just before); torch 2.15 calls ``masked_fill_`` directly. ATen's
    ``index_put_`` takes the masked-fill path for one bool mask on ``self``'s device, no
    accumulation and a one-element value on the host. On CPU every tensor is on the host, so a
    value counts as a host value only when it is the tensor lifted by the op just before (the
    scalar of ``x[mask] = 0.0``); a tensor built earlier counts as a device tensor (where it
    would sync).
    """
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    value = args[2]
    return (
        isinstance(value, torch.Tensor)
        and not accumulate
        and len(masks) == 1
        and masks[0].device == args[0].device
        and value is host_value
        and value.numel() == 1
    )


def _call_site() -> str:
    """``" at file:line in fn"`` for the innermost frame outside torch and this module."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None:
        return ""
    return f" at {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _raise(op: SyncOp) -> NoReturn:
    raise HostSyncError(
        f"{op.name} ({op.spelling}) would synchronize the GPU with the host{_call_site()}. "
        f"Instead: {op.instead}."
    )


class _SyncDetector(TorchDispatchMode):
    """Reports every aten op in :data:`SYNC_OPS`, then runs it."""

    def __init__(self, report: Callable[[SyncOp], None]) -> None:
        super().__init__()
        self._report = report
        self._lifted: torch.Tensor | None = None  # output of the previous op if lift_fresh

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        op = _flagged(func, args, kwargs, self._lifted)
        self._lifted = None
        if op is not None:
            self._report(op)
        out = func(*args, **kwargs)
        if func.overloadpacket is torch.ops.aten.lift_fresh:
            self._lifted = out
        return out


class _HostCopyPatch:
    """Replaces ``torch.Tensor.<name>`` by a wrapper that reports, then calls what was there."""

    def __init__(self, name: str, report: Callable[[SyncOp], None]) -> None:
        self.name, self.active, self.busy, self.owner = name, True, False, threading.get_ident()
        self.saved = torch.Tensor.__dict__.get(name)  # None: inherited from torch._C.TensorBase
        inner = getattr(torch.Tensor, name)  # the original, or an enclosing guard's wrapper
        op = _op(f"Tensor.{name}")

        @functools.wraps(inner)
        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.owner or not self.active or self.busy:
                return inner(tensor, *args, **kwargs)
            report(op)
            # A subclass's __torch_function__ calls torch.Tensor.<name> (this wrapper) again.
            self.busy = True
            try:
                return inner(tensor, *args, **kwargs)
            finally:
                self.busy = False

        wrapper._forge_patch = self  # type: ignore[attr-defined]
        self.wrapper = wrapper
        setattr(torch.Tensor, name, wrapper)

    def remove(self) -> None:
        self.active = False  # from now on the wrapper only passes through
        if torch.Tensor.__dict__.get(self.name) is not self.wrapper:
            return  # a guard entered later on another thread wraps us; it unlinks us on its exit
        saved = self.saved
        while (patch := getattr(saved, "_forge_patch", None)) is not None and not patch.active:
            saved = patch.saved  # skip wrappers of guards that already exited
        if saved is None:
            delattr(torch.Tensor, self.name)
        else:
            setattr(torch.Tensor, self.name, saved)


@contextlib.contextmanager
def _detect(report: Callable[[SyncOp], None]) -> Iterator[None]:
    """Call ``report`` for every would-be sync in the block (dispatch mode + tolist/numpy patch)."""
    with contextlib.ExitStack() as stack:
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is not None:
            stack.enter_context(set_stance("force_eager"))
        for name in ("tolist", "numpy"):
            stack.callback(_HostCopyPatch(name, report).remove)
        stack.enter_context(_SyncDetector(report))
        yield


@contextlib.contextmanager
def no_host_sync(device: torch.device | str | None = None) -> Iterator[None]:
    """Raise on any device->host synchronization inside the block.

    ``device`` None means CUDA if available, else CPU. On CUDA this sets
    ``torch.cuda.set_sync_debug_mode("error")`` (torch raises ``RuntimeError``) and restores the
    previous mode on exit. Elsewhere every op that would sync a GPU raises :class:`HostSyncError`
    naming the op, the call site and what to do instead. Nesting: the innermost guard reports first;
    a :func:`count_host_syncs` inside counts the op, then this guard raises.
    """
    if _on_cuda(device):
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return
    with _detect(_raise):
        yield


@contextlib.contextmanager
def count_host_syncs(device: torch.device | str | None = None) -> Iterator[HostSyncCounter]:
    """Count device->host synchronizations inside the block instead of raising.

    Same detection as :func:`no_host_sync` on CPU (counts are live). On CUDA this sets the sync
    debug mode to ``"warn"`` (kept at ``"error"`` inside a :func:`no_host_sync`, so an enclosing
    guard still raises) and counts torch's warnings when the block exits; other warnings are
    re-emitted, and sync warnings too if the mode outside was already ``"warn"`` (an enclosing
    counter then counts them as well).
    """
    counter = HostSyncCounter()
    if not _on_cuda(device):
        with _detect(lambda op: counter.add(op.name)):
            yield counter
        return
    previous = torch.cuda.get_sync_debug_mode()
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(max(previous, 1))
            try:
                yield counter
            finally:
                torch.cuda.set_sync_debug_mode(previous)
    finally:
        for w in caught:
            is_sync = _CUDA_SYNC_WARNING in str(w.message)
            if is_sync:
                counter.add(f"{w.filename}:{w.lineno}")
            if not is_sync or previous >= 1:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)

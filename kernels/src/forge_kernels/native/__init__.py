"""Native sync-free ops of the MoE expert-parallel path (namespace ``forge``), with fallbacks.

Provides:

- :func:`routing_layout` (``torch.ops.forge.routing_layout``): the expert-major padded layout of
  a top-k routing, sized from shapes only, with no host synchronization on CUDA.
- :func:`routing_layout_reference`: the same contract in pure PyTorch (also sync-free and
  ``torch.compile``-friendly); used when the native library is unavailable or disabled.
- :func:`stage_to_host` (``torch.ops.forge.stage_to_host``) and :class:`StagedSplits`: start the
  device-to-host copy of all-to-all split sizes early, block only when the host needs them.
- :func:`load_native`, :func:`implementation`, :func:`native_error`: build/load the library and
  say which implementation is active.

``routing_layout(expert_ids [T, K] int32|int64, num_experts E, align)`` contract (slot
``s = t*K + k``, ``pad(c) = ceil(c/align)*align``, ``capacity = T*K`` if ``align == 1`` else
``T*K + E*(align-1)``):

- ``counts`` int32 [E]: slots per expert (unpadded); ``offs`` int32 [E]: inclusive cumulative
  ends of the padded groups (the ``offs`` of ``torch._grouped_mm``).
- ``gather_idx`` int64 [capacity]: the slot each row of the layout holds; ``T*K`` for padding
  rows and rows past ``offs[-1]``. ``scatter_idx`` int64 [T*K]: each slot's row.
- Within an expert, slots keep increasing slot order (stable). Ids outside ``[0, E)`` are
  dropped on every backend: not counted, never in ``gather_idx``, ``scatter_idx = capacity``.

Notable choices:

- The library is built with CMake on first use and cached by a hash of its sources and the torch
  version (:mod:`forge_kernels.native._build`: ``~/.cache/forge-kernels/<key>/`` by default). A failed
  build warns and falls back to PyTorch, unless ``FORGE_KERNELS_REQUIRE_NATIVE=1`` or
  ``load_native(require=True)``, which raise. ``FORGE_KERNELS_NATIVE=0`` forces the fallback.
- Fake kernels are registered here (the C++ library names this module with
  ``set_python_module``); outputs are sized from shapes, so ``torch.compile(fullgraph=True)``
  traces both ops. Call :func:`load_native` before compiling so that the native-or-fallback
  choice is made outside the traced code.
- Autograd: none is registered, on purpose. Every output is an integer index tensor and the
  inputs are integer ids, so there is nothing to differentiate; gradients flow through the
  gathers and scatters that use these indices.
- Process-global state: whether the library is loaded (torch's op registry is per process).
  Nothing else is global; configuration travels in arguments or the environment.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ..routing import RoutingLayout, check_routing_args, routing_capacity, routing_layout_reference
from . import _build
from ._build import NativeBuildError

__all__ = [
    "NativeBuildError",
    "RoutingLayout",
    "StagedSplits",
    "implementation",
    "load_native",
    "native_error",
    "routing_capacity",
    "routing_layout",
    "routing_layout_reference",
    "stage_to_host",
]


# --------------------------------------------------------------------------- library loading
@dataclass
class _NativeState:
    attempted: bool = False
    library: Path | None = None
    error: str | None = None
    # Device types with a native routing_layout kernel, read once at load time so that the
    # dispatch in routing_layout is a plain attribute read under torch.compile.
    device_types: frozenset[str] = frozenset()


_STATE = _NativeState()
_LOAD_LOCK = threading.Lock()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _native_disabled() -> bool:
    return os.environ.get("FORGE_KERNELS_NATIVE", "").strip().lower() in {"0", "false", "no", "off"}


def load_native(*, require: bool | None = None) -> bool:
    """Build (first use only) and load the native library; True when its ops are available.

    Tried once per process. On failure it warns and returns False (callers then use the
    pure-PyTorch fallback), or raises :class:`NativeBuildError` when ``require`` is true
    (default: ``FORGE_KERNELS_REQUIRE_NATIVE=1``). ``FORGE_KERNELS_NATIVE=0`` disables loading.
    """
    if require is None:
        require = _env_flag("FORGE_KERNELS_REQUIRE_NATIVE")
    if not _STATE.attempted:
        with _LOAD_LOCK:
            if not _STATE.attempted:
                _try_load()
    if _STATE.library is None and require:
        raise NativeBuildError(f"forge native ops required but unavailable: {_STATE.error}")
    return _STATE.library is not None


def _try_load() -> None:
    try:
        if _native_disabled():
            raise NativeBuildError("disabled by FORGE_KERNELS_NATIVE=0")
        path = _build.build_library()
        torch.ops.load_library(str(path))
        _register_fakes()
        _STATE.device_types = frozenset(
            device_type
            for device_type, key in (("cpu", "CPU"), ("cuda", "CUDA"))
            if torch._C._dispatch_has_kernel_for_dispatch_key("forge::routing_layout", key)
        )
        _STATE.library = path
    except (NativeBuildError, OSError, RuntimeError, ValueError) as exc:
        _STATE.error = str(exc)
        if not _native_disabled():
            warnings.warn(
                f"forge native ops unavailable, using the PyTorch fallback: {exc}", stacklevel=3
            )
    finally:
        _STATE.attempted = True


def native_error() -> str | None:
    """Why the native library is not loaded (None when it is, or before the first attempt)."""
    return _STATE.error


def implementation(device: torch.device | str = "cpu") -> Literal["native", "pytorch"]:
    """Which implementation :func:`routing_layout` uses for tensors on ``device`` (loads lazily).

    ``"native"`` needs the library loaded and a kernel for the device type (the CUDA kernel is
    compiled only where nvcc and a GPU were found at build time); otherwise ``"pytorch"``.
    """
    if not _STATE.attempted:
        load_native()
    return "native" if torch.device(device).type in _STATE.device_types else "pytorch"


# --------------------------------------------------------------------------- routing layout
def routing_layout(expert_ids: torch.Tensor, num_experts: int, align: int = 1) -> RoutingLayout:
    """``(counts, offs, gather_idx, scatter_idx)`` of a routing; native op when available.

    No host synchronization on either path; outputs are sized from shapes only. Arguments are
    checked here before the op is called: on the lent H200 a C++ exception out of the library
    killed the process (SIGSEGV, cause not yet found; benchmarks/gpu.md), so forge's Python
    entry points never reach the op's own checks, which stay for direct ``torch.ops`` callers.
    """
    check_routing_args(expert_ids, num_experts, align)
    if implementation(expert_ids.device) == "native":
        return RoutingLayout(*torch.ops.forge.routing_layout(expert_ids, num_experts, align))
    return routing_layout_reference(expert_ids, num_experts, align)


# --------------------------------------------------------------------------- host staging
def _check_stage_args(src: torch.Tensor, pinned_dst: torch.Tensor) -> None:
    # Same checks and messages as stage_to_host in kernels/csrc/ops.cpp.
    if pinned_dst.device.type != "cpu":
        raise ValueError(f"stage_to_host: pinned_dst must be a CPU tensor, got {pinned_dst.device}")
    if not pinned_dst.is_contiguous():
        raise ValueError("stage_to_host: pinned_dst must be contiguous")
    if src.numel() != pinned_dst.numel():
        raise ValueError(
            f"stage_to_host: src has {src.numel()} elements but pinned_dst has {pinned_dst.numel()}"
        )
    if src.dtype != pinned_dst.dtype:
        raise ValueError(
            f"stage_to_host: src is {src.dtype} but pinned_dst is {pinned_dst.dtype}; "
            "convert src on its device first"
        )


def stage_to_host(src: torch.Tensor, pinned_dst: torch.Tensor) -> None:
    """Copy ``src`` into the CPU tensor ``pinned_dst`` without blocking the host.

    For a device ``src`` the copy is enqueued on the current stream and ``pinned_dst`` must be
    pinned (an unpinned destination would make the copy synchronous, so it is refused); record
    an event after this call and synchronize on it before reading ``pinned_dst`` — or use
    :class:`StagedSplits`, which does both. For a CPU ``src`` it is a plain, finished copy.
    """
    _check_stage_args(src, pinned_dst)  # before the op too: see routing_layout
    if src.device.type != "cpu" and not pinned_dst.is_pinned():
        raise ValueError(
            f"stage_to_host: pinned_dst is not in pinned memory, so a copy from {src.device} "
            "would block the host; allocate it with pin_memory=True"
        )
    if _STATE.library is not None or load_native():
        torch.ops.forge.stage_to_host(src, pinned_dst)
        return
    pinned_dst.view(-1).copy_(src.reshape(-1), non_blocking=True)


def _report_sync_to_debug_mode(what: str) -> None:
    mode = torch.cuda.get_sync_debug_mode()
    message = f"{what} synchronizes the host with the device"
    if mode == 2:
        raise RuntimeError(f"called a synchronizing CUDA operation: {message}")
    if mode == 1:
        warnings.warn(f"called a synchronizing CUDA operation: {message}", stacklevel=3)


class StagedSplits:
    """Device-to-host staging of split sizes (e.g. tokens per expert) for an all-to-all.

    Owns a pinned host buffer and a CUDA event. Usage in an EP MoE layer::

        staged = StagedSplits(num_experts, device=x.device)   # once, at construction
        ...
        counts_E = routing_layout(ids, E, align).counts
        staged.start(counts_E)      # enqueue the copy right after counts exist; no blocking
        shared_out = shared_expert(x)   # device work overlaps the copy, host keeps launching
        splits = staged.wait()      # the ONLY blocking point: when the host needs the numbers

    One copy in flight per instance: ``start`` again only after ``wait``. ``start`` uses the
    current stream, which must be (or be ordered after) the stream that produced ``src``. On a
    CPU device there is nothing to overlap: the buffer is ordinary memory, ``start`` copies
    immediately and ``wait`` returns at once. Eager only: ``wait`` is a host sync by nature,
    so call both outside ``torch.compile`` regions.
    """

    def __init__(
        self,
        numel: int,
        *,
        device: torch.device | str,
        dtype: torch.dtype = torch.int64,
    ) -> None:
        if numel < 0:
            raise ValueError(f"StagedSplits: numel must be >= 0, got {numel}")
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        self.host = torch.empty(numel, dtype=dtype, pin_memory=on_cuda)
        self._event = torch.cuda.Event() if on_cuda else None
        self._pending = False

    def start(self, src: torch.Tensor) -> StagedSplits:
        """Enqueue the copy of ``src`` (any int dtype, converted on its device) and return."""
        if self._pending:
            raise RuntimeError("StagedSplits.start: the previous copy was never wait()ed for")
        if src.device.type != self.device.type:
            raise ValueError(
                f"StagedSplits.start: src is on {src.device} but this buffer stages from "
                f"{self.device}; build one StagedSplits per device"
            )
        if src.numel() != self.host.numel():
            raise ValueError(
                f"StagedSplits.start: src has {src.numel()} elements, the buffer {self.host.numel()}"
            )
        if src.dtype != self.host.dtype:
            src = src.to(self.host.dtype)  # on the device, stream-ordered: no host sync
        stage_to_host(src, self.host)
        if self._event is not None:
            self._event.record(torch.cuda.current_stream(src.device))
        self._pending = True
        return self

    def ready(self) -> bool:
        """Whether :meth:`wait` would return without blocking (never blocks)."""
        return not self._pending or self._event is None or self._event.query()

    def wait(self) -> list[int]:
        """Block until the copy has landed and return the values (the only blocking call)."""
        if not self._pending:
            raise RuntimeError("StagedSplits.wait: nothing staged; call start() first")
        if self._event is not None:
            # NOTE: the one host sync of the staging path, deferred to when the host needs it.
            # An event wait is invisible to torch.cuda.set_sync_debug_mode, so report it the way
            # a stream synchronize would be reported.
            _report_sync_to_debug_mode("StagedSplits.wait")
            self._event.synchronize()
        self._pending = False
        return self.host.tolist()


# --------------------------------------------------------------------------- fake kernels
def _routing_layout_fake(
    expert_ids: torch.Tensor, num_experts: int, align: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check_routing_args(expert_ids, num_experts, align)
    num_slots = expert_ids.numel()
    capacity = routing_capacity(num_slots, 1, num_experts, align)
    return (
        expert_ids.new_empty(num_experts, dtype=torch.int32),
        expert_ids.new_empty(num_experts, dtype=torch.int32),
        expert_ids.new_empty(capacity, dtype=torch.int64),
        expert_ids.new_empty(num_slots, dtype=torch.int64),
    )


def _register_fakes() -> None:
    torch.library.register_fake("forge::routing_layout", _routing_layout_fake)
    # The fake of an op without outputs only checks its arguments.
    torch.library.register_fake("forge::stage_to_host", _check_stage_args)

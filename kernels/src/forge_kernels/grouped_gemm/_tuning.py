"""Launch configurations of the Triton grouped GEMM (:mod:`forge_kernels.grouped_gemm._triton`).

Provides:

- :class:`GemmConfig`: one tile shape / launch configuration (frozen).
- :data:`INTERPRETER_CONFIG`: the one configuration used under the Triton interpreter.
- The autotuning candidates for Hopper (sm90): ``CONFIGS_16BIT`` / ``CONFIGS_FP32`` for
  ``gmm_rows`` (forward and dX), ``DW_CONFIGS_16BIT`` / ``DW_CONFIGS_FP32`` for ``gmm_ragged_k``
  (dW), and their TMA candidates ``TMA_CONFIGS_16BIT`` / ``TMA_DW_CONFIGS_16BIT``, offered only
  when every operand meets the tensor-memory-accelerator rules (:func:`tma_eligible`).

- :func:`candidates`, :func:`autotuned`, :func:`best_configs`: the autotuners (built on first
  use: triton < 3.4 binds an autotuner to the GPU driver when it is constructed) and what they
  picked; ``BLOCK_HOOKS`` set the tensor descriptors' block shapes to each config's tiles.

No kernel is decorated here, so the kernel module can be reloaded (interpreter vs compiled)
without this one; its kernels are handed to :func:`autotuned`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import triton

try:  # host-side tensor descriptors: triton >= 3.4 (forge supports older tritons without TMA)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover - old triton
    _TensorDescriptor = None

__all__ = [
    "BLOCK_HOOKS",
    "CONFIGS_16BIT",
    "CONFIGS_FP32",
    "DW_CONFIGS_16BIT",
    "DW_CONFIGS_FP32",
    "INTERPRETER_CONFIG",
    "TMA_CONFIGS_16BIT",
    "TMA_DW_CONFIGS_16BIT",
    "GemmConfig",
    "autotuned",
    "best_configs",
    "candidates",
    "descriptors",
    "tma_eligible",
]


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the grouped GEMM kernels.

    For ``gmm_rows`` ``block_m`` tiles the rows (tokens), ``block_n`` the output columns and
    ``block_k`` the reduction. For ``gmm_ragged_k`` ``block_m`` tiles the K rows of the
    weight gradient, ``block_n`` its columns, ``block_k`` the reduction over tokens.
    ``group_m`` is the L2 swizzle width (row tiles visited together per column band),
    ``persistent`` launches one program per SM that loops over tiles (``gmm_rows`` only), and
    ``tma`` loads the operand tiles through tensor descriptors (the Hopper tensor memory
    accelerator) instead of pointer arithmetic; see :func:`tma_eligible` for when it applies.
    ``warp_specialize`` (with ``tma``) asks Triton to split the K loop into loading and math
    warps (``tl.range(..., warp_specialize=True)``); it is in no autotuning list yet, only in
    ``tools/sweep_grouped_gemm.py``'s experiments, until a GPU has timed it.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    persistent: bool = False
    tma: bool = False
    warp_specialize: bool = False

    def meta(self) -> dict[str, int | bool]:
        """The kernel meta-parameters this config fixes (names as in the kernels)."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
            "PERSISTENT": self.persistent,
            "TMA": self.tma,
            "WARP_SPEC": self.warp_specialize,
        }


#: The one config used under the interpreter: big blocks (few ``tl.dot`` calls, ~10 ms each on
#: numpy) for the tiny shapes tests use.
INTERPRETER_CONFIG = GemmConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=1)


def tma_eligible(*tensors: torch.Tensor) -> bool:
    """Whether tensor descriptors can address every tensor in ``tensors``.

    The rules of a Hopper TMA descriptor: a 16-byte aligned base, unit stride in the last
    dimension, every other stride a multiple of 16 bytes, and no empty dimension. Shapes and
    strides only: deciding needs no device work and no host sync.
    """
    for t in tensors:
        if t.dim() == 0 or t.numel() == 0 or t.stride(-1) != 1:
            return False
        size = t.element_size()
        if t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:-1]):
            return False
    return True


# Reasoning (H100 SXM / H200: sm90, 132 SMs, up to 227 KB of shared memory per block):
# - 16-bit inputs: 128x256x64 with 8 warps (two warpgroups, each a 64x256 wgmma) is the
#   highest-throughput triton tile on sm90 for K >= 1k; 3 stages = 3 x 48 KB of shared memory.
#   128x128x64 (4 stages, 32 KB each) keeps more CTAs in flight when N or the number of row tiles
#   is small (Qwen3 down-projection dX: N = 768 -> only 3 column tiles of 256).
# - Ragged groups waste on average half a row tile per expert: with DeepSeek-V3 at 4k tokens an
#   expert averages 128 rows, so 64-row tiles are offered too (M_BUCKET in the autotune key is
#   log2 of the average rows per group, so small and large batches tune separately).
# - The persistent variant (one program per SM looping over tiles) saves the launch and
#   early-exit cost of the E + 1 spare row tiles and smooths the last wave; without warp
#   specialization it does not overlap the epilogue, so it is one candidate, not the default.
# - TMA (the first H200 run, benchmarks/gpu/2026-11-27-h200: the pointer path reached 0.76x to
#   1.07x of torch._grouped_mm, whose CUTLASS kernels load through TMA). Loads only: a row tile
#   of `a` may run past its group's last row into the next group's rows, which is harmless for
#   a load (those output rows are masked at the store, and rows past M are zero-filled by the
#   descriptor) but not for a store, so `c` keeps masked pointer stores. The dW kernel reduces
#   over rows, where a foreign row would add into the sum: its whole row tiles load through
#   TMA and the last partial tile of each group through masked pointer loads.
# - Pruned by that measurement (H200, 2026-11-27, 8k tokens, Qwen3-30B-A3B and DeepSeek-V3
#   shapes, balanced and skewed): with TMA offered, the rows kernel picked a TMA config at all 8
#   tuning keys (128x256x64, 8 warps; 3 or 4 stages, persistent at 4 keys), so where TMA can
#   run only TMA configs are timed; dW picked TMA at 1 of 4 keys, so it times both. Every
#   candidate costs a compile per shape specialization (about a second each) on first use.
# - Tried on the fourth lease (H200, 2026-11-28): the gap to torch._grouped_mm is largest where
#   each tile's K loop is short (Qwen3-30B-A3B: K 768 forward, 512 rows per expert in dW), which
#   pointed at the un-overlapped prologue and epilogue of a one-CTA-per-SM tile. Candidates that
#   fit two CTAs per SM (128x128x64, 3 stages, 4 or 8 warps; dW also with BLOCK_K 128) and a
#   4-stage persistent 128x256 were offered. 128x128x64 with 4 warps won at one rows key (Qwen3
#   up-projection dX), the 4-stage persistent one at another (DeepSeek-V3 down-projection
#   forward), no new dW candidate won, and the Qwen3 rows stayed where they were (0.80x-0.99x
#   of torch._grouped_mm; all 16 rows 0.80x-1.24x, from 0.79x-1.14x). The losers are pruned
#   again: the gap is not the CTA count (benchmarks/gpu/2026-11-28-h200/grouped_gemm.md).
# - fp32 inputs: block_k 32 keeps 4-byte tiles inside shared memory (TF32/IEEE paths); no TMA
#   candidates (fp32 grouped GEMMs are for tests, not speed).
# The weight-gradient kernel reduces over tokens (block_k) and tiles K x N of the weight.

CONFIGS_16BIT: tuple[GemmConfig, ...] = (
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=5),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, persistent=True),
)
TMA_CONFIGS_16BIT: tuple[GemmConfig, ...] = (
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, tma=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, tma=True),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, persistent=True, tma=True),
    # each picked at one key of eight on the fourth lease (below)
    GemmConfig(128, 128, 64, num_warps=4, num_stages=3, tma=True),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=4, persistent=True, tma=True),
)
CONFIGS_FP32: tuple[GemmConfig, ...] = (
    GemmConfig(128, 128, 32, num_warps=8, num_stages=3),
    GemmConfig(64, 128, 32, num_warps=4, num_stages=4),
)
DW_CONFIGS_16BIT: tuple[GemmConfig, ...] = (
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4),
)
TMA_DW_CONFIGS_16BIT: tuple[GemmConfig, ...] = (
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, tma=True),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=True),
)
DW_CONFIGS_FP32: tuple[GemmConfig, ...] = (
    GemmConfig(128, 128, 32, num_warps=8, num_stages=3),
    GemmConfig(64, 128, 32, num_warps=4, num_stages=4),
)


def _rows_blocks(nargs: dict[str, Any]) -> None:
    """Autotuner pre-hook of ``gmm_rows``: the descriptors' block shapes follow the config."""
    if nargs["a_desc"] is not None:
        bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
        nargs["a_desc"].block_shape = [bm, bk]
        nargs["b_desc"].block_shape = [1, bn, bk] if nargs["B_TRANS"] else [1, bk, bn]


def _ragged_k_blocks(nargs: dict[str, Any]) -> None:
    """Autotuner pre-hook of ``gmm_ragged_k`` (rows are the reduction, ``BLOCK_K``)."""
    if nargs["a_desc"] is not None:
        bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
        nargs["a_desc"].block_shape = [bk, bm]
        nargs["b_desc"].block_shape = [bk, bn]


BLOCK_HOOKS = {"rows": _rows_blocks, "ragged_k": _ragged_k_blocks}


def _triton_configs(kernel: str, configs: tuple[GemmConfig, ...]) -> list[triton.Config]:
    hook = BLOCK_HOOKS[kernel]
    return [
        triton.Config(c.meta(), num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=hook)
        for c in configs
    ]


# Autotuned entry points (compiled mode only), built on first use: triton < 3.4 binds the
# autotuner to the active GPU driver when it is constructed, which fails on a CPU-only machine.
# The strides are in the key because the forward (b = w) and dX (b = w^T) can share N and K but
# not the layout.
_ROWS_KEY = ["N", "K", "M_BUCKET", "stride_bk", "stride_bn"]
_DW_KEY = ["N", "K", "M_BUCKET", "stride_am", "stride_bm"]


def candidates(kernel: str, fp32: bool, tma: bool) -> tuple[GemmConfig, ...]:
    """The configs the autotuner times for ``kernel`` ("rows" or "ragged_k"), input width and
    whether the operands allow TMA (16-bit inputs only)."""
    if fp32:
        return CONFIGS_FP32 if kernel == "rows" else DW_CONFIGS_FP32
    if kernel == "rows":
        return TMA_CONFIGS_16BIT if tma else CONFIGS_16BIT
    return DW_CONFIGS_16BIT + TMA_DW_CONFIGS_16BIT if tma else DW_CONFIGS_16BIT


#: Below this many multiply-adds a grouped GEMM takes microseconds on a GPU, less than compiling
#: one more candidate (about a second per shape specialization, on first use): such problems get
#: the autotune bucket SMALL_BUCKET, whose only candidate is the first one.
SMALL_PROBLEM_MACS = 1 << 28
SMALL_BUCKET = 0


def _prune_small(configs: list[Any], named_args: dict[str, Any], **_: Any) -> list[Any]:
    """Autotuner pruning: the first candidate alone for the small-problem bucket."""
    return configs[:1] if named_args["M_BUCKET"] == SMALL_BUCKET else configs


# NOTE: module state, each autotuner (with its per-key tuning cache) built once per process.
_TUNERS: dict[tuple[str, Any, bool, bool], Any] = {}


def autotuned(kernel: str, jit: Any, fp32: bool, tma: bool) -> Any:
    """The autotuner of ``jit`` (the ``kernel`` "rows" or "ragged_k") over the candidates for
    the input width and TMA eligibility, built on first use and kept for the process."""
    name = (kernel, jit, fp32, tma)
    if name not in _TUNERS:
        configs = _triton_configs(kernel, candidates(kernel, fp32, tma))
        key = _ROWS_KEY if kernel == "rows" else _DW_KEY
        prune = {"early_config_prune": _prune_small}
        _TUNERS[name] = triton.autotune(configs, key=key, prune_configs_by=prune)(jit)
    return _TUNERS[name]


def best_configs() -> list[tuple[str, tuple, GemmConfig]]:
    """(kernel, tuning key, config) the autotuners picked so far, for benchmarks to report."""
    picked = []
    for (kernel, _, _, _), tuner in _TUNERS.items():
        for key, config in getattr(tuner, "cache", {}).items():
            kw = config.kwargs
            chosen = GemmConfig(
                kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], config.num_warps,
                config.num_stages, kw["GROUP_M"], kw["PERSISTENT"], kw["TMA"], kw["WARP_SPEC"],
            )  # fmt: skip
            picked.append((kernel, key, chosen))
    return picked


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    # NOTE: memoized device property (not configuration).
    return torch.cuda.get_device_capability(device_index)


def descriptors(
    kernel: str, a: torch.Tensor, b: torch.Tensor, *, interpreted: bool
) -> tuple[Any, Any, bool]:
    """Tensor descriptors of ``a`` and ``b`` (block shapes set per config by the hooks), or
    ``(None, None)`` where TMA cannot run; and whether ``b`` is read transposed (dX)."""
    b_trans = kernel == "rows" and b.stride(2) != 1 and b.stride(1) == 1
    b_base = b.transpose(1, 2) if b_trans else b
    supported = _TensorDescriptor is not None and (
        interpreted or (a.is_cuda and _capability(a.device.index or 0) >= (9, 0))
    )
    if not (supported and tma_eligible(a, b_base)):
        return None, None, b_trans

    def desc(t: torch.Tensor) -> Any:
        return _TensorDescriptor(t, list(t.shape), list(t.stride()), [16] * t.dim())

    return desc(a), desc(b_base), b_trans

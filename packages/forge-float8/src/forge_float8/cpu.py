"""Float8 on CPU: which kernel runs torch's CPU fp8 GEMMs.

NOTE: on CPUs with AMX but no native fp8 (this project's CI machines), torch's CPU
``_scaled_mm`` hands fp8 GEMMs to oneDNN, which has no optimised fp8 kernel there and runs its
reference one (``ref:any`` in ``ONEDNN_VERBOSE``): a 256x256x256 product took 0.30 s against
0.65 ms on torch's own CPU path (measured 2026-11-27, torch 2.15), which made a 10-step Float8
test take minutes. A GPU never reads this setting.
"""

from __future__ import annotations

import functools

import torch
from forge_core.torch_compat import scaled_mm

__all__ = ["cpu_scaled_mm_supports", "use_torch_cpu_fp8_kernels"]


def use_torch_cpu_fp8_kernels() -> bool:
    """Turn oneDNN off for this process so that CPU fp8 GEMMs take torch's own kernel; returns
    the previous setting (``torch.backends.mkldnn.enabled``) for a caller that restores it.

    Process-wide, like ``torch.set_num_threads``: call it in a process that runs Float8 on CPU
    (forge's CPU ranks do when ``float8.enabled``). Other CPU ops then skip oneDNN too.
    """
    previous = bool(torch.backends.mkldnn.enabled)
    torch.backends.mkldnn.set_flags(False)
    return previous


@functools.cache
def cpu_scaled_mm_supports(recipe: str) -> bool:
    """Whether this torch's CPU ``_scaled_mm`` runs the fp8 GEMMs of ``recipe``.

    torch 2.11's CPU kernel takes one scale per tensor only (it asserts on the row/column
    scales of "rowwise", found on the GPU machine's torch, 2026-11-27); later ones take both.
    Probed once per recipe on a 16x16 product (a property of the torch build, memoized).
    """
    if recipe == "tensorwise":
        return True
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    previous = bool(torch.backends.mkldnn.enabled)
    try:
        for onednn in (False, True):  # torch's own CPU kernel and oneDNN's must both take it
            torch.backends.mkldnn.set_flags(onednn)
            scaled_mm(a, b, torch.ones(16, 1), torch.ones(1, 16), torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    finally:
        torch.backends.mkldnn.set_flags(previous)
    return True

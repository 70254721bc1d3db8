"""forge_kernels: compute kernels for the MoE expert-parallel path and native sync-free ops.

Depends on torch and triton only (no forge layer). One subpackage per concept, each with its
private kernels beside it:

- :mod:`forge_kernels.grouped_gemm`  grouped GEMM (Triton on CUDA / interpreter, torch._grouped_mm on CPU)
- :mod:`forge_kernels.permute`       routing layouts, token permute / unpermute / combine
- :mod:`forge_kernels.routing`       the routing-layout contract and its pure-PyTorch implementation
- :mod:`forge_kernels.native`        TORCH_LIBRARY ops (namespace ``forge``), built with CMake on
  first use (``native._build``: only that build needs cmake and ninja, the ``native`` extra)
"""

__version__ = "0.1.0"

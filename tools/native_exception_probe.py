"""Where does a C++ exception from a custom op crash the process? (a GPU-machine diagnosis)

On the lent H200 (2026-11-27) ``torch.ops.forge.routing_layout`` with a bad argument killed the
process with SIGSEGV instead of raising ValueError, with the library built by GCC 13.3 with or
without its CUDA kernels; on the CPU machines the same sources raise. This builds one small
probe library with ``torch.utils.cpp_extension.load_inline`` (default visibility, not forge's
CMake recipe) and runs each way of failing in a process of its own:

- ``check``: ``TORCH_CHECK_VALUE`` as forge's ops do (c10 captures a C++ backtrace);
- ``no_backtrace``: ``throw c10::ValueError(msg)``, the constructor that captures none;
- ``std``: ``throw std::invalid_argument`` (no c10 type at all);
- ``torch``: an error torch itself raises (``torch.zeros(2).view(3)``), no probe library.

Usage: ``python tools/native_exception_probe.py [BUILD_DIR]``; prints one line per case with
the exit status (0: the Python exception arrived; -11: SIGSEGV).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <torch/library.h>
#include <c10/util/Exception.h>
#include <stdexcept>

at::Tensor probe_check(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2, "probe: 2-D expected, got ", x.dim(), "-D");
  return x;
}
at::Tensor probe_no_backtrace(const at::Tensor& x) {
  if (x.dim() != 2) throw c10::ValueError("probe: 2-D expected (no backtrace)");
  return x;
}
at::Tensor probe_std(const at::Tensor& x) {
  if (x.dim() != 2) throw std::invalid_argument("probe: 2-D expected (std)");
  return x;
}
TORCH_LIBRARY(forge_probe, m) {
  m.def("check(Tensor x) -> Tensor", &probe_check);
  m.def("no_backtrace(Tensor x) -> Tensor", &probe_no_backtrace);
  m.def("std(Tensor x) -> Tensor", &probe_std);
}
"""

CASE = """
import sys, torch
if sys.argv[1] != "torch":
    torch.ops.load_library(sys.argv[2])
try:
    if sys.argv[1] == "torch":
        torch.zeros(2).view(3)
    else:
        getattr(torch.ops.forge_probe, sys.argv[1])(torch.zeros(4))
except Exception as err:
    print(type(err).__name__, str(err).splitlines()[0][:80])
"""


def build(build_dir: Path) -> Path:
    """Compile the probe library; returns its path."""
    from torch.utils.cpp_extension import load_inline

    load_inline(
        "forge_exception_probe",
        cpp_sources=SOURCE,
        is_python_module=False,
        build_directory=str(build_dir),
        verbose=False,
    )
    return build_dir / "forge_exception_probe.so"


def main() -> int:
    build_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build(build_dir)
    for case in ("torch", "check", "no_backtrace", "std"):
        proc = subprocess.run(
            [sys.executable, "-c", CASE, case, str(library)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        said = proc.stdout.strip() or (proc.stderr.strip().splitlines() or [""])[-1]
        print(f"{case:13s} exit {proc.returncode:4d}  {said[:110]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

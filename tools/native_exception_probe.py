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

With ``--forge`` it asks the same of forge's own op (``routing_layout`` with 1-D ids), CPU
kernels only, built three ways, to tell the recipe from the code (the third lease, 2026-11-27,
saw ``FORGE_CHECK_VALUE``, a no-backtrace throw, still crash in forge's library):

- ``forge_cmake``: forge's CMake recipe as shipped (hidden symbol visibility);
- ``forge_cmake_default_vis``: the same recipe with the visibility preset removed;
- ``forge_inline``: ``kernels/csrc/ops.cpp`` through ``load_inline`` (cpp_extension's flags).

The fourth call of that lease found all three crash, while the probe's ``no_backtrace`` op had
raised cleanly a lease earlier: the code, not the recipe. ``--matrix`` builds one library whose
ops each differ from ``no_backtrace`` in one way forge's op does (message built by
``c10::str``, a CPU-key kernel instead of a catch-all one, ``pt2_compliant_tag``,
``set_python_module``, an anonymous namespace, a 4-tensor tuple result, forge's own
``FORGE_CHECK_VALUE`` macro, forge's argument check followed by ``AT_DISPATCH`` and
``at::parallel_for``) and calls each in a process of its own.

Usage: ``python tools/native_exception_probe.py [--forge | --matrix] [BUILD_DIR]``; prints one
line per case with the exit status (0: the Python exception arrived; -11: SIGSEGV).
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


MATRIX_SOURCE = r"""
#include <torch/library.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <sstream>
#include <string>
#include <tuple>
#include "routing_layout.h"
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

using T4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
at::Tensor literal(const at::Tensor& x) {
  if (x.dim() != 2) throw c10::ValueError("probe: 2-D expected");
  return x;
}
at::Tensor built(const at::Tensor& x) {
  if (x.dim() != 2) throw c10::ValueError(c10::str("probe: 2-D expected, got ", x.dim(), "-D"));
  return x;
}
at::Tensor forge_macro(const at::Tensor& x) {
  FORGE_CHECK_VALUE(x.dim() == 2, "probe: 2-D expected, got ", x.dim(), "-D");
  return x;
}
at::Tensor streamed(const at::Tensor& x) {
  if (x.dim() != 2) {
    std::ostringstream text;
    text << "probe: 2-D expected, got " << x.dim() << "-D";
    throw c10::ValueError(text.str());
  }
  return x;
}
at::Tensor concatenated(const at::Tensor& x) {
  if (x.dim() != 2) {
    throw c10::ValueError(std::string("probe: 2-D expected, got ") + std::to_string(x.dim()) + "-D");
  }
  return x;
}
T4 tuple4(const at::Tensor& x) {
  if (x.dim() != 2) throw c10::ValueError("probe: 2-D expected");
  return {x, x, x, x};
}
T4 tuple4_int(const at::Tensor& x, int64_t e, int64_t a) {
  if (x.dim() != 2 || e < 0 || a < 0) throw c10::ValueError("probe: 2-D expected");
  return {x, x, x, x};
}
T4 dispatched(const at::Tensor& x, int64_t e, int64_t a) {
  forge::check_routing_args(x, e, a);
  at::Tensor out = at::full({x.numel()}, 0, x.options());
  AT_DISPATCH_INDEX_TYPES(x.scalar_type(), "probe", [&] {
    const index_t* in = x.const_data_ptr<index_t>();
    index_t* o = out.mutable_data_ptr<index_t>();
    at::parallel_for(0, x.numel(), 1, [&](int64_t b, int64_t end) {
      for (int64_t i = b; i < end; ++i) o[i] = in[i];
    });
  });
  return {out, out, at::empty({e}, x.options()), out};
}
namespace {
at::Tensor anonymous(const at::Tensor& x) {
  if (x.dim() != 2) throw c10::ValueError("probe: 2-D expected");
  return x;
}
}  // namespace
TORCH_LIBRARY(forge_matrix, m) {
  m.def("literal_def(Tensor x) -> Tensor", &literal);
  m.def("built_def(Tensor x) -> Tensor", &built);
  m.def("literal_cpu(Tensor x) -> Tensor");
  m.def("tagged_cpu(Tensor x) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("anonymous_cpu(Tensor x) -> Tensor");
  m.def("macro_cpu(Tensor x) -> Tensor");
  m.def("stream_cpu(Tensor x) -> Tensor");
  m.def("concat_cpu(Tensor x) -> Tensor");
  m.def("tuple_cpu(Tensor x) -> (Tensor a, Tensor b, Tensor c, Tensor d)");
  m.def("forge_like_cpu(Tensor x, int e, int a) -> (Tensor a, Tensor b, Tensor c, Tensor d)",
        {at::Tag::pt2_compliant_tag});
  m.def("dispatched_cpu(Tensor x, int e, int a) -> (Tensor a, Tensor b, Tensor c, Tensor d)");
}
TORCH_LIBRARY_FRAGMENT(forge_matrix_py, m) {
  m.set_python_module("json");
  m.def("pymodule_cpu(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(forge_matrix, CPU, m) {
  m.impl("literal_cpu", &literal);
  m.impl("tagged_cpu", &literal);
  m.impl("anonymous_cpu", &anonymous);
  m.impl("macro_cpu", &forge_macro);
  m.impl("stream_cpu", &streamed);
  m.impl("concat_cpu", &concatenated);
  m.impl("tuple_cpu", &tuple4);
  m.impl("forge_like_cpu", &tuple4_int);
  m.impl("dispatched_cpu", &dispatched);
}
TORCH_LIBRARY_IMPL(forge_matrix_py, CPU, m) {
  m.impl("pymodule_cpu", &literal);
}
"""

MATRIX_CASES = (
    "forge_matrix.literal_def", "forge_matrix.built_def", "forge_matrix.literal_cpu",
    "forge_matrix.tagged_cpu", "forge_matrix.anonymous_cpu", "forge_matrix.macro_cpu",
    "forge_matrix.stream_cpu", "forge_matrix.concat_cpu",
    "forge_matrix.tuple_cpu", "forge_matrix.forge_like_cpu", "forge_matrix.dispatched_cpu",
    "forge_matrix_py.pymodule_cpu",
)  # fmt: skip

MATRIX_CASE = """
import sys, torch
torch.ops.load_library(sys.argv[1])
namespace, name = sys.argv[2].split(".")
op = getattr(getattr(torch.ops, namespace), name)
three = name in ("forge_like_cpu", "dispatched_cpu")
args = (torch.zeros(4, dtype=torch.int64), 4, 1) if three else (torch.zeros(4),)
try:
    op(*args)
except Exception as err:
    print(type(err).__name__, str(err).splitlines()[0][:80])
"""


def matrix(build_dir: Path) -> None:
    """Build the one-difference matrix library and call each op in a process of its own."""
    from torch.utils.cpp_extension import load_inline

    root = Path(__file__).resolve().parent.parent
    load_inline("forge_exception_matrix", cpp_sources=MATRIX_SOURCE, is_python_module=False,
                build_directory=str(build_dir), verbose=False,
                extra_include_paths=[str(root / "kernels" / "csrc")])  # fmt: skip
    library = build_dir / "forge_exception_matrix.so"
    for case in MATRIX_CASES:
        proc = subprocess.run([sys.executable, "-c", MATRIX_CASE, str(library), case],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        said = proc.stdout.strip() or (proc.stderr.strip().splitlines() or [""])[-1]
        print(f"{case:32s} exit {proc.returncode:4d}  {said[:100]}", flush=True)


FORGE_CASE = """
import sys, torch
torch.ops.load_library(sys.argv[1])
try:
    torch.ops.forge.routing_layout(torch.zeros(4, dtype=torch.int64), 4, 1)
except Exception as err:
    print(type(err).__name__, str(err).splitlines()[0][:80])
"""


def forge_libraries(build_dir: Path) -> dict[str, Path]:
    """forge's op library built the three ways of the module docstring (CPU kernels only)."""
    import os
    import shutil

    root = Path(__file__).resolve().parent.parent
    libs: dict[str, Path] = {}
    default_vis = build_dir / "src-default-vis"
    shutil.copytree(root / "kernels" / "csrc", default_vis / "kernels" / "csrc", dirs_exist_ok=True)
    cmake = (root / "CMakeLists.txt").read_text()
    cmake = cmake.replace("  CXX_VISIBILITY_PRESET hidden\n", "").replace(
        "  CUDA_VISIBILITY_PRESET hidden", ""
    )
    (default_vis / "CMakeLists.txt").write_text(cmake)
    for name, source in (("forge_cmake", root), ("forge_cmake_default_vis", default_vis)):
        env = dict(os.environ, FORGE_KERNELS_CUDA="0", FORGE_KERNELS_SOURCE_DIR=str(source))
        env["FORGE_KERNELS_CACHE_DIR"] = str(build_dir / name)
        code = "from forge_kernels.native import _build; print(_build.build_library())"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=240)  # fmt: skip
        if out.returncode != 0:
            print(f"{name:13s} build failed: {(out.stderr.strip().splitlines() or [''])[-1]}")
            continue
        libs[name] = Path(out.stdout.strip().splitlines()[-1])
    from torch.utils.cpp_extension import load

    inline_dir = build_dir / "inline"
    inline_dir.mkdir(exist_ok=True)
    load("forge_ops_inline", [str(root / "kernels" / "csrc" / "ops.cpp")],
         extra_include_paths=[str(root / "kernels" / "csrc")], is_python_module=False,
         build_directory=str(inline_dir), verbose=False)  # fmt: skip
    libs["forge_inline"] = inline_dir / "forge_ops_inline.so"
    return libs


def main() -> int:
    args = sys.argv[1:]
    forge, matrix_mode = "--forge" in args, "--matrix" in args
    args = [a for a in args if a not in ("--forge", "--matrix")]
    build_dir = Path(args[0]) if args else Path(tempfile.mkdtemp())
    if matrix_mode:
        build_dir.mkdir(parents=True, exist_ok=True)
        matrix(build_dir)
        return 0
    if forge:
        build_dir.mkdir(parents=True, exist_ok=True)
        for case, library in forge_libraries(build_dir).items():
            proc = subprocess.run([sys.executable, "-c", FORGE_CASE, str(library)],
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            said = proc.stdout.strip() or (proc.stderr.strip().splitlines() or [""])[-1]
            print(f"{case:24s} exit {proc.returncode:4d}  {said[:110]}", flush=True)
        return 0
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

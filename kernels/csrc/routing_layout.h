// Shared declarations of the forge routing-layout kernels (CPU in ops.cpp, CUDA in
// routing_layout_cuda.cu): argument checks and the static capacity, so both backends agree on
// every error message and every output size.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <cstdint>
#include <limits>
#include <tuple>

// An argument error as a Python ValueError, without the C++ backtrace that TORCH_CHECK_VALUE
// captures while it builds the exception: on the lent H200 (GCC 13.3 there, 2026-11-27) that
// capture crashed the process (SIGSEGV) for any library built on the machine, while the same
// c10::ValueError built without a backtrace reached Python cleanly
// (tools/native_exception_probe.py, benchmarks/gpu.md). A bad argument needs no C++ stack.
#define FORGE_CHECK_VALUE(cond, ...)                         \
  do {                                                       \
    if (!(cond)) {                                           \
      throw ::c10::ValueError(::c10::str(__VA_ARGS__));      \
    }                                                        \
  } while (false)

namespace forge {

using RoutingLayout = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Rows of the expert-major padded layout: T*K when align == 1, else T*K + E*(align-1) (every
// expert can waste at most align-1 padding rows). Depends on shapes only, never on the routing.
inline int64_t routing_capacity(int64_t num_slots, int64_t num_experts, int64_t align) {
  return align == 1 ? num_slots : num_slots + num_experts * (align - 1);
}

inline void check_routing_args(const at::Tensor& expert_ids, int64_t num_experts, int64_t align) {
  FORGE_CHECK_VALUE(
      expert_ids.dim() == 2, "routing_layout: expert_ids must be 2-D [T, K], got ",
      expert_ids.dim(), "-D");
  FORGE_CHECK_VALUE(
      expert_ids.scalar_type() == at::kInt || expert_ids.scalar_type() == at::kLong,
      "routing_layout: expert_ids must be int32 or int64, got ", expert_ids.scalar_type());
  FORGE_CHECK_VALUE(num_experts >= 1, "routing_layout: num_experts must be >= 1, got ", num_experts);
  FORGE_CHECK_VALUE(align >= 1, "routing_layout: align must be >= 1, got ", align);
  FORGE_CHECK_VALUE(
      num_experts < std::numeric_limits<int32_t>::max() &&
          align < std::numeric_limits<int32_t>::max(),
      "routing_layout: num_experts and align must fit in int32");
  // Rows and counts are int32 inside the kernels (offs is int32 by contract).
  const int64_t capacity = routing_capacity(expert_ids.numel(), num_experts, align);
  FORGE_CHECK_VALUE(
      capacity < std::numeric_limits<int32_t>::max(),
      "routing_layout: capacity T*K + E*(align-1) = ", capacity, " does not fit in int32");
}

}  // namespace forge

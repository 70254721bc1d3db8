// Shared declarations of the forge routing-layout kernels (CPU in ops.cpp, CUDA in
// routing_layout_cuda.cu): argument checks and the static capacity, so both backends agree on
// every error message and every output size.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>

// An argument error as a Python ValueError, its message built without C++ streams and without
// the C++ backtrace that TORCH_CHECK_VALUE captures. On the lent H200 (GCC 13.3 there) any
// library built on the machine crashed the process (SIGSEGV) when its message went through
// std::ostringstream (c10::str with a number in it), and when TORCH_CHECK_VALUE captured a
// backtrace; a c10::ValueError from a plain string reached Python cleanly
// (tools/native_exception_probe.py --matrix, benchmarks/gpu.md). So the message is appended
// piece by piece: strings as they are, integers through std::to_string, dtypes and devices by
// their names.
#define FORGE_CHECK_VALUE(cond, ...)                                   \
  do {                                                                 \
    if (!(cond)) {                                                     \
      throw ::c10::ValueError(::forge::detail::message(__VA_ARGS__));  \
    }                                                                  \
  } while (false)

namespace forge::detail {

inline void append(std::string& out, const char* text) { out += text; }
inline void append(std::string& out, const std::string& text) { out += text; }
inline void append(std::string& out, at::ScalarType dtype) { out += c10::toString(dtype); }
inline void append(std::string& out, const c10::Device& device) { out += device.str(); }
template <typename Int, std::enable_if_t<std::is_integral_v<Int>, int> = 0>
inline void append(std::string& out, Int value) {
  out += std::to_string(value);
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string out;
  (append(out, parts), ...);
  return out;
}

}  // namespace forge::detail

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

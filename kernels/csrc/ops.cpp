// forge native ops: the `forge` schemas and their CPU kernels.
//
// Provides
//   forge::routing_layout(Tensor expert_ids, int num_experts, int align)
//       -> (Tensor counts, Tensor offs, Tensor gather_idx, Tensor scatter_idx)
//   forge::stage_to_host(Tensor src, Tensor(a!) pinned_dst) -> ()
//
// Notable choices
// - TORCH_LIBRARY_FRAGMENT, not TORCH_LIBRARY: other forge code may define ops in the same
//   namespace from Python (torch.library.custom_op registers fragments too).
// - set_python_module: the fake (meta) kernels live in forge_kernels.native; FakeTensor imports
//   that module if someone loads this library without it.
// - routing_layout on CPU runs the same three phases as the CUDA kernel (per-chunk histogram,
//   scan over experts and chunks, per-chunk stable placement), with at::parallel_for over
//   chunks. Ids outside [0, E) are dropped: not counted, never in gather_idx, and their
//   scatter_idx is `capacity` (one past the last row), on every backend.
// - stage_to_host is one kernel registered for both CPU and CUDA dispatch keys: it is
//   Tensor::copy_(non_blocking=true), which is an asynchronous cudaMemcpyAsync on the current
//   stream when the destination is pinned; it refuses an unpinned destination for a device
//   source because that copy would silently block the host.
#include "routing_layout.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace forge {
namespace {

// Slots per CPU work item (ATen's usual grain size); below this the kernel is serial.
constexpr int64_t kCpuChunk = 32768;

template <typename index_t>
void routing_layout_cpu_kernel(
    const index_t* ids, int64_t n, int64_t num_experts, int64_t align, int64_t capacity,
    int32_t* counts, int32_t* offs, int64_t* gather, int64_t* scatter) {
  const int64_t E = num_experts;
  const int64_t chunk = kCpuChunk;
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  // Per-chunk histogram first, then rewritten in place to each chunk's first row per expert.
  std::vector<int64_t> chunk_rows(static_cast<size_t>(num_chunks * E), 0);

  at::parallel_for(0, num_chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    for (int64_t c = c_begin; c < c_end; ++c) {
      int64_t* hist = chunk_rows.data() + c * E;
      const int64_t s_end = std::min(n, (c + 1) * chunk);
      for (int64_t s = c * chunk; s < s_end; ++s) {
        const int64_t e = static_cast<int64_t>(ids[s]);
        if (e >= 0 && e < E) {
          ++hist[e];
        }
      }
    }
  });

  // Padded group starts (exclusive scan over experts), and each chunk's first row per expert
  // (exclusive scan over chunks): slots keep their slot order inside an expert.
  int64_t group_start = 0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t row = group_start;
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t h = chunk_rows[c * E + e];
      chunk_rows[c * E + e] = row;
      row += h;
    }
    const int64_t count = row - group_start;
    counts[e] = static_cast<int32_t>(count);
    group_start += (count + align - 1) / align * align;
    offs[e] = static_cast<int32_t>(group_start);
  }

  at::parallel_for(0, num_chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    for (int64_t c = c_begin; c < c_end; ++c) {
      int64_t* next_row = chunk_rows.data() + c * E;
      const int64_t s_end = std::min(n, (c + 1) * chunk);
      for (int64_t s = c * chunk; s < s_end; ++s) {
        const int64_t e = static_cast<int64_t>(ids[s]);
        if (e >= 0 && e < E) {
          const int64_t row = next_row[e]++;
          scatter[s] = row;
          gather[row] = s;
        } else {
          scatter[s] = capacity;
        }
      }
    }
  });
}

RoutingLayout routing_layout_cpu(const at::Tensor& expert_ids, int64_t num_experts, int64_t align) {
  check_routing_args(expert_ids, num_experts, align);
  const at::Tensor ids = expert_ids.contiguous();
  const int64_t n = ids.numel();
  const int64_t capacity = routing_capacity(n, num_experts, align);
  const auto int_opts = ids.options().dtype(at::kInt);
  const auto long_opts = ids.options().dtype(at::kLong);

  at::Tensor counts = at::empty({num_experts}, int_opts);
  at::Tensor offs = at::empty({num_experts}, int_opts);
  at::Tensor gather_idx = at::full({capacity}, n, long_opts);  // sentinel T*K
  at::Tensor scatter_idx = at::empty({n}, long_opts);

  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "forge::routing_layout (CPU)", [&] {
    routing_layout_cpu_kernel<index_t>(
        ids.const_data_ptr<index_t>(), n, num_experts, align, capacity,
        counts.mutable_data_ptr<int32_t>(), offs.mutable_data_ptr<int32_t>(),
        gather_idx.mutable_data_ptr<int64_t>(), scatter_idx.mutable_data_ptr<int64_t>());
  });
  return {counts, offs, gather_idx, scatter_idx};
}

void stage_to_host(const at::Tensor& src, const at::Tensor& pinned_dst) {
  FORGE_CHECK_VALUE(
      pinned_dst.device().is_cpu(), "stage_to_host: pinned_dst must be a CPU tensor, got ",
      pinned_dst.device());
  FORGE_CHECK_VALUE(
      pinned_dst.is_contiguous(), "stage_to_host: pinned_dst must be contiguous");
  FORGE_CHECK_VALUE(
      src.numel() == pinned_dst.numel(), "stage_to_host: src has ", src.numel(),
      " elements but pinned_dst has ", pinned_dst.numel());
  FORGE_CHECK_VALUE(
      src.scalar_type() == pinned_dst.scalar_type(), "stage_to_host: src is ",
      src.scalar_type(), " but pinned_dst is ", pinned_dst.scalar_type(),
      "; convert src on its device first");
  if (!src.device().is_cpu()) {
    FORGE_CHECK_VALUE(
        pinned_dst.is_pinned(), "stage_to_host: pinned_dst is not in pinned memory, so a copy from ",
        src.device(), " would block the host; allocate it with pin_memory=True");
  }
  // NOTE: asynchronous on src's current stream when src is on a device and dst is pinned; the
  // caller records an event after this call and synchronizes on it before reading dst.
  pinned_dst.view({-1}).copy_(src.reshape({-1}), /*non_blocking=*/true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(forge, m) {
  m.set_python_module("forge_kernels.native");
  m.def(
      "routing_layout(Tensor expert_ids, int num_experts, int align) -> "
      "(Tensor counts, Tensor offs, Tensor gather_idx, Tensor scatter_idx)",
      {at::Tag::pt2_compliant_tag});
  m.def("stage_to_host(Tensor src, Tensor(a!) pinned_dst) -> ()", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(forge, CPU, m) {
  m.impl("routing_layout", &routing_layout_cpu);
  m.impl("stage_to_host", &stage_to_host);
}

// The CUDA key is picked whenever src is a CUDA tensor (dst is always CPU). Registering the
// same host function needs no CUDA compiler, so staging works even without the CUDA kernels.
TORCH_LIBRARY_IMPL(forge, CUDA, m) {
  m.impl("stage_to_host", &stage_to_host);
}

}  // namespace forge

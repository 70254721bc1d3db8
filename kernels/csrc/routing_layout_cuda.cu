// forge::routing_layout on CUDA: three launches on the current stream, no host synchronization.
//
// 1. chunk_histogram: one block per chunk of slots counts its slots per expert with
//    shared-memory atomics (global atomics into its own row when E does not fit in shared
//    memory). Integer atomics commute, so the counts are exact whatever their order.
// 2. expert_offsets: one block. counts[e] = sum over chunks; padded group starts are an
//    exclusive scan over experts (offs = inclusive ends); each chunk's first row per expert is
//    an exclusive scan over chunks of that expert's column.
// 3. place: one warp per chunk walks its slots 32 at a time in slot order. __match_any_sync
//    groups lanes with the same expert; a lane's rank is the number of lower lanes in its group,
//    and the group's highest lane advances the chunk's running row for that expert. Rows
//    therefore never depend on atomic order: the result is bit-identical to the CPU kernel.
//
// Headers: c10/cuda only (not ATen/cuda/CUDAContext.h, which pulls cuSPARSE/cuBLAS headers that a
// minimal CUDA toolkit does not ship).
//
// Ids outside [0, E) are dropped exactly as on CPU (not counted, scatter_idx = capacity), with
// no device assert, because checking them on the host would need a synchronization.
#include "routing_layout.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

namespace forge {
namespace {

constexpr int kHistogramThreads = 256;
constexpr int kOffsetsThreads = 1024;
constexpr int kWarp = 32;
constexpr int64_t kMinChunk = 2048;
constexpr int64_t kMaxChunks = 1024;
constexpr int64_t kSharedHistogramBytes = 48 * 1024;

template <typename index_t>
__global__ void chunk_histogram_kernel(
    const index_t* __restrict__ ids, int64_t n, int64_t chunk, int num_experts,
    bool shared_histogram, int* __restrict__ chunk_rows) {
  extern __shared__ int shared_hist[];
  int* global_hist = chunk_rows + static_cast<int64_t>(blockIdx.x) * num_experts;
  int* hist = shared_histogram ? shared_hist : global_hist;
  if (shared_histogram) {
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
      shared_hist[e] = 0;
    }
    __syncthreads();
  }
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t end = min(n, begin + chunk);
  for (int64_t s = begin + threadIdx.x; s < end; s += blockDim.x) {
    const int64_t e = static_cast<int64_t>(ids[s]);
    if (e >= 0 && e < num_experts) {
      atomicAdd(hist + e, 1);
    }
  }
  if (shared_histogram) {
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
      global_hist[e] = shared_hist[e];
    }
  }
}

// One block of kOffsetsThreads; thread t owns a contiguous range of experts so that the scan
// over experts is a per-thread serial sum plus one block-wide scan of the thread totals.
__global__ void expert_offsets_kernel(
    int* __restrict__ chunk_rows, int num_chunks, int num_experts, int align,
    int* __restrict__ counts, int* __restrict__ offs) {
  __shared__ int thread_totals[kOffsetsThreads];
  const int t = threadIdx.x;
  const int per_thread = (num_experts + kOffsetsThreads - 1) / kOffsetsThreads;
  const int e_begin = min(num_experts, t * per_thread);
  const int e_end = min(num_experts, e_begin + per_thread);

  int padded_total = 0;
  for (int e = e_begin; e < e_end; ++e) {
    int count = 0;
    for (int c = 0; c < num_chunks; ++c) {
      count += chunk_rows[static_cast<int64_t>(c) * num_experts + e];
    }
    counts[e] = count;
    padded_total += (count + align - 1) / align * align;
  }
  thread_totals[t] = padded_total;
  __syncthreads();
  // Inclusive Hillis-Steele scan of the thread totals.
  for (int stride = 1; stride < kOffsetsThreads; stride <<= 1) {
    const int add = t >= stride ? thread_totals[t - stride] : 0;
    __syncthreads();
    thread_totals[t] += add;
    __syncthreads();
  }
  int group_start = thread_totals[t] - padded_total;
  for (int e = e_begin; e < e_end; ++e) {
    int row = group_start;
    for (int c = 0; c < num_chunks; ++c) {
      int* cell = chunk_rows + static_cast<int64_t>(c) * num_experts + e;
      const int h = *cell;
      *cell = row;
      row += h;
    }
    group_start += (counts[e] + align - 1) / align * align;
    offs[e] = group_start;
  }
}

// One warp per chunk; chunk_rows[chunk] holds the next free row of each expert for this chunk
// and is touched by this warp only.
template <typename index_t>
__global__ void place_kernel(
    const index_t* __restrict__ ids, int64_t n, int64_t chunk, int num_experts, int64_t capacity,
    int* __restrict__ chunk_rows, int64_t* __restrict__ gather, int64_t* __restrict__ scatter) {
  const unsigned lane = threadIdx.x;
  const unsigned lower_lanes = (1u << lane) - 1u;
  int* next_row = chunk_rows + static_cast<int64_t>(blockIdx.x) * num_experts;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t end = min(n, begin + chunk);
  for (int64_t tile = begin; tile < end; tile += kWarp) {
    const int64_t s = tile + lane;
    const bool in_range = s < end;
    int64_t e = in_range ? static_cast<int64_t>(ids[s]) : -1;
    const bool valid = in_range && e >= 0 && e < num_experts;
    const int key = valid ? static_cast<int>(e) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    int row = 0;
    if (valid) {
      row = next_row[key] + __popc(peers & lower_lanes);
    }
    __syncwarp();  // every lane has read next_row before the group leaders advance it
    if (valid) {
      if (lane == 31u - static_cast<unsigned>(__clz(peers))) {
        next_row[key] = row + 1;
      }
      scatter[s] = row;
      gather[row] = s;
    } else if (in_range) {
      scatter[s] = capacity;
    }
    __syncwarp();  // the advanced rows are visible to the whole warp for the next tile
  }
}

RoutingLayout routing_layout_cuda(const at::Tensor& expert_ids, int64_t num_experts, int64_t align) {
  check_routing_args(expert_ids, num_experts, align);
  const c10::cuda::CUDAGuard device_guard(expert_ids.device());
  const at::Tensor ids = expert_ids.contiguous();
  const int64_t n = ids.numel();
  const int64_t capacity = routing_capacity(n, num_experts, align);
  const int E = static_cast<int>(num_experts);
  const auto int_opts = ids.options().dtype(at::kInt);
  const auto long_opts = ids.options().dtype(at::kLong);

  const int64_t chunk = std::max(kMinChunk, (n + kMaxChunks - 1) / kMaxChunks);
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  const bool shared_histogram = num_experts * static_cast<int64_t>(sizeof(int)) <= kSharedHistogramBytes;

  // The global-atomics histogram accumulates into its rows, so only that path needs zeros.
  at::Tensor chunk_rows = shared_histogram
      ? at::empty({std::max<int64_t>(num_chunks, 1) * num_experts}, int_opts)
      : at::zeros({std::max<int64_t>(num_chunks, 1) * num_experts}, int_opts);
  at::Tensor counts = at::empty({num_experts}, int_opts);
  at::Tensor offs = at::empty({num_experts}, int_opts);
  at::Tensor gather_idx = at::full({capacity}, n, long_opts);  // sentinel T*K
  at::Tensor scatter_idx = at::empty({n}, long_opts);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "forge::routing_layout (CUDA)", [&] {
    const index_t* ids_ptr = ids.const_data_ptr<index_t>();
    int* rows_ptr = chunk_rows.mutable_data_ptr<int>();
    if (num_chunks > 0) {
      const size_t shared_bytes = shared_histogram ? num_experts * sizeof(int) : 0;
      chunk_histogram_kernel<index_t>
          <<<static_cast<unsigned>(num_chunks), kHistogramThreads, shared_bytes, stream>>>(
              ids_ptr, n, chunk, E, shared_histogram, rows_ptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    expert_offsets_kernel<<<1, kOffsetsThreads, 0, stream>>>(
        rows_ptr, static_cast<int>(num_chunks), E, static_cast<int>(align),
        counts.mutable_data_ptr<int>(), offs.mutable_data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (num_chunks > 0) {
      place_kernel<index_t><<<static_cast<unsigned>(num_chunks), kWarp, 0, stream>>>(
          ids_ptr, n, chunk, E, capacity, rows_ptr, gather_idx.mutable_data_ptr<int64_t>(),
          scatter_idx.mutable_data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {counts, offs, gather_idx, scatter_idx};
}

}  // namespace

TORCH_LIBRARY_IMPL(forge, CUDA, m) {
  m.impl("routing_layout", &routing_layout_cuda);
}

}  // namespace forge

// Gather the experts a load plan names from the host store into their device slots (the miss
// path of the expert cache: vllm/model_executor/layers/fused_moe/expert_cache/copy.py), all of
// a layer's tensors in one launch (expert_gather: one tensor, the same kernel). The store is
// pinned host memory read in place over the link (UVA), so no staging copy and no host sync:
// the plan (experts, slots, valid) never leaves the device.
//
// Grid: x = the chunks (kChunkBytes each) of every tensor's row laid end to end, y =
// min(n, kEntryRows); block (c, y) copies chunk c of entries y, y + kEntryRows, ... that are
// valid. A decode step that hits everywhere still launches the copy (its grid is fixed for
// graph capture), so what its blocks cost matters: with one block row per entry, 63 slots of
// 9.4 MB experts made 9,072 blocks that each read one flag and exit; 8 rows make 1,152, which
// still fill an H100 when they copy (8 blocks of 256 threads per SM); each block first reads
// its entries' flags together (a 63-entry plan gives it 8), so with none valid it leaves after
// one round trip instead of eight dependent loads. A block copies with the
// widest access (16, 8, 4, 2 or 1 bytes) that divides its tensor's row and both bases: 16 for
// every weight the engine makes (rows are whole expert matrices); a row of a few per-tensor
// scales copies at its own width. Each thread has kUnroll loads in flight before it stores
// (the link's latency is microseconds; one load at a time per thread leaves it idle).
// Chunk starts (64 KiB) keep the alignment. Offsets are 64-bit: row_bytes * rows passes 2^31
// for real experts.
#include "expert_gather.h"

#include <cstdio>
#include <cuda_runtime.h>

namespace vllm {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkBytes = 64 * 1024;
constexpr int64_t kEntryRows = 8;
constexpr int kUnroll = 4;

// Plan entry i: false where it is not valid (its ids unread); else its expert e and slot s.
// Out-of-range ids (the residency code never makes one) trap.
__device__ bool plan_entry(int64_t i, const int64_t* __restrict__ experts,
                           const int64_t* __restrict__ slots, const bool* __restrict__ valid,
                           int64_t num_experts, int64_t num_slots, int64_t& e, int64_t& s) {
  if (!valid[i]) return false;
  e = experts[i];
  s = slots[i];
  if (e < 0 || e >= num_experts || s < 0 || s >= num_slots) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
      printf("expert_gather: entry %lld has expert %lld (of %lld), slot %lld (of %lld)\n",
             (long long)i, (long long)e, (long long)num_experts, (long long)s,
             (long long)num_slots);
    __trap();
  }
  return true;
}

// The tensors of one expert_gather_many launch, by value (kernel parameters: no device table,
// so a captured graph replays with the same pointers). Chunks of tensor t's row are the grid's
// x in [first_chunk[t], first_chunk[t + 1]).
struct GatherBatch {
  const char* src[kMaxGatherTensors];
  char* dst[kMaxGatherTensors];
  int64_t row_bytes[kMaxGatherTensors];
  int64_t first_chunk[kMaxGatherTensors + 1];
  int width[kMaxGatherTensors];  // bytes per access: 16, 8, 4, 2 or 1
  int count;
};

// A chunk's words: kUnroll loads per thread, then their stores (src and dst never overlap:
// the store is host memory or another expert's rows).
template <typename T>
__device__ void copy_span(const char* __restrict__ from, char* __restrict__ to, int64_t bytes) {
  const T* __restrict__ f = reinterpret_cast<const T*>(from);
  T* __restrict__ d = reinterpret_cast<T*>(to);
  const int64_t count = bytes / static_cast<int64_t>(sizeof(T));
  const int64_t step = blockDim.x;
  int64_t j = threadIdx.x;
  for (; j + (kUnroll - 1) * step < count; j += kUnroll * step) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = f[j + u * step];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[j + u * step] = v[u];
  }
  for (; j < count; j += step) d[j] = f[j];
}

__global__ void expert_gather_many_kernel(const GatherBatch batch,
                                          const int64_t* __restrict__ experts,
                                          const int64_t* __restrict__ slots,
                                          const bool* __restrict__ valid, int64_t n,
                                          int64_t num_experts, int64_t num_slots) {
  // This block's entries' flags all at once, one load per thread: a step that hits everywhere
  // (no valid entry) leaves after one round trip, not after walking its entries one dependent
  // load at a time (8 of them per block for a 63-entry plan).
  bool mine = false;
  for (int64_t i = blockIdx.y + static_cast<int64_t>(threadIdx.x) * gridDim.y; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.y)
    mine |= valid[i];
  if (!__syncthreads_or(mine)) return;
  const int64_t c = blockIdx.x;
  int t = 0;  // the tensor whose row holds chunk c (block-uniform)
  while (t + 1 < batch.count && c >= batch.first_chunk[t + 1]) ++t;
  const int64_t row_bytes = batch.row_bytes[t];
  const int64_t begin = (c - batch.first_chunk[t]) * kChunkBytes;
  const int64_t end = begin + kChunkBytes < row_bytes ? begin + kChunkBytes : row_bytes;
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    int64_t e, s;
    if (!plan_entry(i, experts, slots, valid, num_experts, num_slots, e, s)) continue;
    const char* from = batch.src[t] + e * row_bytes + begin;
    char* to = batch.dst[t] + s * row_bytes + begin;
    switch (batch.width[t]) {
      case 16: copy_span<int4>(from, to, end - begin); break;
      case 8: copy_span<int2>(from, to, end - begin); break;
      case 4: copy_span<int>(from, to, end - begin); break;
      case 2: copy_span<short>(from, to, end - begin); break;
      default: copy_span<char>(from, to, end - begin); break;
    }
  }
}

// The widest access (16, 8, 4, 2 or 1 bytes) dividing the row and both bases.
int access_width(int64_t row_bytes, const void* from, const void* to) {
  const uint64_t bits = static_cast<uint64_t>(row_bytes) | reinterpret_cast<uintptr_t>(from) |
                        reinterpret_cast<uintptr_t>(to);
  for (int w = 16; w > 1; w /= 2)
    if (bits % w == 0) return w;
  return 1;
}

}  // namespace

int expert_gather_many(const GatherTensor* tensors, int num_tensors, const int64_t* experts,
                       const int64_t* slots, const bool* valid, int64_t n, int64_t num_experts,
                       int64_t num_slots, void* stream) {
  if (n == 0) return 0;
  // n <= 65535: the ops' contract (vllm/kernels/gather_checks.py MAX_ENTRIES), no longer the
  // grid's limit (its y is min(n, kEntryRows)).
  if (num_tensors < 0 || num_tensors > kMaxGatherTensors || n > 65535)
    return static_cast<int>(cudaErrorInvalidValue);
  GatherBatch batch{};
  int64_t chunks = 0;
  for (int t = 0; t < num_tensors; ++t) {
    const GatherTensor& g = tensors[t];
    if (g.row_bytes == 0) continue;
    const void* src = g.src;
    if (g.src_on_host) {
      void* mapped = nullptr;
      const cudaError_t err = cudaHostGetDevicePointer(&mapped, const_cast<void*>(g.src), 0);
      if (err != cudaSuccess) return static_cast<int>(err);
      src = mapped;
    }
    const int k = batch.count++;
    batch.src[k] = static_cast<const char*>(src);
    batch.dst[k] = static_cast<char*>(g.dst);
    batch.row_bytes[k] = g.row_bytes;
    batch.width[k] = access_width(g.row_bytes, src, g.dst);
    batch.first_chunk[k] = chunks;
    chunks += (g.row_bytes + kChunkBytes - 1) / kChunkBytes;
  }
  batch.first_chunk[batch.count] = chunks;
  if (batch.count == 0) return 0;
  if (chunks > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(chunks),
                  static_cast<unsigned>(n < kEntryRows ? n : kEntryRows));
  expert_gather_many_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      batch, experts, slots, valid, n, num_experts, num_slots);
  return static_cast<int>(cudaGetLastError());
}

int expert_gather(const void* src, bool src_on_host, void* dst, const int64_t* experts,
                  const int64_t* slots, const bool* valid, int64_t n, int64_t num_experts,
                  int64_t num_slots, int64_t row_bytes, void* stream) {
  const GatherTensor tensor{src, src_on_host, dst, row_bytes};
  return expert_gather_many(&tensor, 1, experts, slots, valid, n, num_experts, num_slots, stream);
}

const char* cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace vllm

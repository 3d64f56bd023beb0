// Gather the experts a load plan names from the host store into their device slots, in one
// launch per tensor (the miss path of the expert cache: vllm/model_executor/layers/fused_moe/
// expert_cache/copy.py). The store is pinned host memory read in place over the link (UVA), so
// no staging copy and no host sync: the plan (experts, slots, valid) never leaves the device.
//
// Grid: x = chunks of a row (kChunkBytes each), y = plan entries. A block copies one chunk of
// one entry, with the widest access (16, 8, 4, 2 or 1 bytes) that divides the row and both
// bases: 16 for every weight the engine makes (rows are whole expert matrices); a row of a
// few per-tensor scales copies at its own width. Chunk starts (64 KiB) keep the alignment.
// Offsets are 64-bit: row_bytes * rows passes 2^31 for real experts.
#include "expert_gather.h"

#include <cstdio>
#include <cuda_runtime.h>

namespace vllm {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkBytes = 64 * 1024;

template <typename T>
__global__ void expert_gather_kernel(const char* __restrict__ src, char* __restrict__ dst,
                                     const int64_t* __restrict__ experts,
                                     const int64_t* __restrict__ slots,
                                     const bool* __restrict__ valid, int64_t num_experts,
                                     int64_t num_slots, int64_t row_bytes) {
  const int64_t i = blockIdx.y;
  if (!valid[i]) return;
  const int64_t e = experts[i], s = slots[i];
  if (e < 0 || e >= num_experts || s < 0 || s >= num_slots) {
    if (threadIdx.x == 0 && blockIdx.x == 0)
      printf("expert_gather: entry %lld has expert %lld (of %lld), slot %lld (of %lld)\n",
             (long long)i, (long long)e, (long long)num_experts, (long long)s,
             (long long)num_slots);
    __trap();
  }
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunkBytes;
  const int64_t end = begin + kChunkBytes < row_bytes ? begin + kChunkBytes : row_bytes;
  const T* from = reinterpret_cast<const T*>(src + e * row_bytes + begin);
  T* to = reinterpret_cast<T*>(dst + s * row_bytes + begin);
  const int64_t count = (end - begin) / static_cast<int64_t>(sizeof(T));
  for (int64_t j = threadIdx.x; j < count; j += kThreads) to[j] = from[j];
}

}  // namespace

int expert_gather(const void* src, bool src_on_host, void* dst, const int64_t* experts,
                  const int64_t* slots, const bool* valid, int64_t n, int64_t num_experts,
                  int64_t num_slots, int64_t row_bytes, void* stream) {
  if (n == 0 || row_bytes == 0) return 0;
  const void* device_src = src;
  if (src_on_host) {
    void* mapped = nullptr;
    cudaError_t err = cudaHostGetDevicePointer(&mapped, const_cast<void*>(src), 0);
    if (err != cudaSuccess) return static_cast<int>(err);
    device_src = mapped;
  }
  const int64_t chunks = (row_bytes + kChunkBytes - 1) / kChunkBytes;
  if (n > 65535 || chunks > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(n));
  auto s = static_cast<cudaStream_t>(stream);
  const char* from = static_cast<const char*>(device_src);
  char* to = static_cast<char*>(dst);
  const uint64_t bits = static_cast<uint64_t>(row_bytes) | reinterpret_cast<uintptr_t>(from) |
                        reinterpret_cast<uintptr_t>(to);
  const auto launch = [&](auto word) {
    expert_gather_kernel<decltype(word)><<<grid, kThreads, 0, s>>>(
        from, to, experts, slots, valid, num_experts, num_slots, row_bytes);
  };
  if (bits % 16 == 0)
    launch(int4{});
  else if (bits % 8 == 0)
    launch(int2{});
  else if (bits % 4 == 0)
    launch(int{});
  else if (bits % 2 == 0)
    launch(short{});
  else
    launch(char{});
  return static_cast<int>(cudaGetLastError());
}

const char* cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace vllm

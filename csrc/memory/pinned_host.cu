// Exact-size page-locked host memory for the expert cache's host store
// (vllm/model_executor/layers/fused_moe/expert_cache/store.py).
//
// torch's pinned allocator (Tensor.pin_memory, torch.empty(pin_memory=True)) is a caching
// allocator that rounds every block up to a power of two: a 738 MB expert tensor locks 1 GiB.
// The store is allocated once and lives as long as the engine, so caching buys nothing, and the
// rounding is 33% (Qwen3-30B-A3B) to 45% (DeepSeek-V2-Lite) more locked host memory per MoE
// layer: memory that the models this engine exists for (experts larger than the GPU) do not
// have to spare.
#include "pinned_host.h"

#include <cuda_runtime.h>
#include <unistd.h>

namespace vllm {

// Bytes of physical memory (0 where the system does not say). No more than this can be locked.
static size_t physical_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
}

PinnedHostStatus pinned_host_alloc(size_t bytes, void** ptr, int* device, int* cuda_error) {
  *ptr = nullptr;
  *device = -1;
  *cuda_error = 0;
  if (bytes == 0) return PinnedHostStatus::kOk;
  // More than the machine has is out of memory without asking the driver (whose answer to an
  // absurd size is its own: an error, a long wait, or worse).
  const size_t physical = physical_bytes();
  if (physical != 0 && bytes > physical) {
    *cuda_error = static_cast<int>(cudaErrorMemoryAllocation);
    return PinnedHostStatus::kOutOfMemory;
  }
  // The runtime keeps one unread "last error" per thread. Only if none is pending now is the one
  // a failure leaves behind ours to clear; an earlier call's must stay for torch to report.
  const cudaError_t pending = cudaPeekAtLastError();
  const cudaError_t err = cudaHostAlloc(ptr, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (err == cudaSuccess) {
    if (cudaGetDevice(device) != cudaSuccess) *device = -1;  // cannot fail once allocated
    return PinnedHostStatus::kOk;
  }
  *ptr = nullptr;
  *cuda_error = static_cast<int>(err);
  // Not out of memory: a fault (sticky, or the driver's) that torch must see too; left as is.
  if (err != cudaErrorMemoryAllocation) return PinnedHostStatus::kError;
  // Out of lockable memory is not sticky, but it stays the thread's last error until read: read
  // it, or torch's next launch check would raise it as its own.
  if (pending == cudaSuccess) (void)cudaGetLastError();
  return PinnedHostStatus::kOutOfMemory;
}

void pinned_host_free(void* ptr) {
  if (ptr == nullptr) return;
  // As above: clear only an error of our own, not one an earlier call left for torch to report.
  const cudaError_t pending = cudaPeekAtLastError();
  if (cudaFreeHost(ptr) != cudaSuccess && pending == cudaSuccess) (void)cudaGetLastError();
}

}  // namespace vllm

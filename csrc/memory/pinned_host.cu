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

namespace vllm {

int pinned_host_alloc(size_t bytes, void** ptr) {
  *ptr = nullptr;
  if (bytes == 0) return 0;
  const cudaError_t err = cudaHostAlloc(ptr, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (err != cudaSuccess) {
    *ptr = nullptr;
    // An allocation failure is not sticky, but it stays the runtime's "last error" until read:
    // read it here, or the next kernel launch check in torch would raise it.
    (void)cudaGetLastError();
  }
  return static_cast<int>(err);
}

void pinned_host_free(void* ptr) {
  if (ptr == nullptr) return;
  if (cudaFreeHost(ptr) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace vllm

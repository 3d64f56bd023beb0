// Plain C++ entry points for page-locked host memory of an exact size (pinned_host.cu): no torch,
// no CUDA types, so the binding (torch_bindings.cpp) compiles against any torch build.
#pragma once

#include <cstddef>

namespace vllm {

// How pinned_host_alloc ended. Only kOutOfMemory means "no page-locked memory to be had": the
// caller may then fall back to pageable memory. The others are CUDA faults to report as such.
// The values are try_empty_pinned's status, which vllm/kernels/cuda/ops.py reads.
enum class PinnedHostStatus {
  kOk = 0,
  // cudaHostAlloc's cudaErrorMemoryAllocation, or more bytes than the machine has
  kOutOfMemory = 1,
  // cudaHostAlloc failed otherwise (no device or driver, an earlier kernel's fault)
  kError = 2,
};

// Page-locked host memory of `bytes` (the driver rounds to whole pages, nothing more), portable
// to every context and mapped into the device address space (the expert gather kernel reads it
// in place), made in the current device's context. *ptr = the memory (nullptr when bytes == 0
// or on failure); *device = the current device, to free it under (-1 when nothing was made);
// *cuda_error = 0 or the cudaError_t behind a failure (cuda_error_string names it). The CUDA
// "last error" is cleared only when it is this call's own out-of-memory (nothing was pending
// before it), so torch's next launch check neither reports it as its own nor loses an earlier
// call's unread error; any other error is left for torch to see as well.
PinnedHostStatus pinned_host_alloc(size_t bytes, void** ptr, int* device, int* cuda_error);

// Frees memory from pinned_host_alloc (nullptr: nothing) in the current device's context: the
// caller selects the allocating device first, or a thread that never selected one would create
// a context on GPU 0. Never throws; errors (e.g. at process exit, after the runtime unloaded)
// are dropped.
void pinned_host_free(void* ptr);

}  // namespace vllm

// Plain C++ entry points for page-locked host memory of an exact size (pinned_host.cu): no torch,
// no CUDA types, so the binding (torch_bindings.cpp) compiles against any torch build.
#pragma once

#include <cstddef>

namespace vllm {

// Page-locked host memory of `bytes` (the driver rounds to whole pages, nothing more), portable
// to every context and mapped into the device address space (the expert gather kernel reads it
// in place). *ptr = the memory, or nullptr when bytes == 0 or on failure. Returns 0 or the
// cudaError_t of the failed call; a failure leaves no CUDA "last error" behind, so torch's
// next launch check does not report it as its own.
int pinned_host_alloc(size_t bytes, void** ptr);

// Frees memory from pinned_host_alloc (nullptr: nothing). Never throws; errors (e.g. at process
// exit, after the runtime unloaded) are dropped.
void pinned_host_free(void* ptr);

}  // namespace vllm

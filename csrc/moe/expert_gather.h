// Plain C++ entry point of the expert gather kernel (expert_gather.cu): no torch, no CUDA types,
// so the binding (torch_bindings.cpp) and the kernel compile separately.
#pragma once

#include <cstdint>

namespace vllm {

// Enqueue on `stream` (a cudaStream_t): for each i < n with valid[i],
//   dst[slots[i]] = src[experts[i]]   (row_bytes bytes per row)
// src: [num_experts rows] pinned host memory (read in place through its device-mapped address)
//      when src_on_host, else device memory; dst: [num_slots rows] device memory;
// experts, slots: int64 [n], valid: bool [n], all on the device.
// Entries with valid[i] == false are skipped without reading their ids. A valid entry whose ids
// are out of range stops the kernel with a device-side trap (the residency code never makes one).
// No host synchronisation; one launch. Returns 0 or the cudaError_t of the failed call.
int expert_gather(const void* src, bool src_on_host, void* dst, const int64_t* experts,
                  const int64_t* slots, const bool* valid, int64_t n, int64_t num_experts,
                  int64_t num_slots, int64_t row_bytes, void* stream);

// One expert-indexed tensor of a layer for expert_gather_many: src [num_experts rows] (pinned
// host memory when src_on_host, else device), dst [num_slots rows] on the device.
struct GatherTensor {
  const void* src;
  bool src_on_host;
  void* dst;
  int64_t row_bytes;
};

// At most this many tensors per expert_gather_many call (they travel as kernel parameters).
constexpr int kMaxGatherTensors = 16;

// expert_gather for every tensor of a layer (weights, scales, zeros, ...) in ONE launch: for
// each i < n with valid[i] and each t < num_tensors, tensors[t].dst[slots[i]] =
// tensors[t].src[experts[i]]. Every src has num_experts rows and every dst num_slots rows (one
// plan indexes them all). Same contract otherwise: invalid entries unread, out-of-range ids
// trap, no host synchronisation. num_tensors <= kMaxGatherTensors; rows of 0 bytes are
// skipped. Returns 0 or the cudaError_t of the failed call.
int expert_gather_many(const GatherTensor* tensors, int num_tensors, const int64_t* experts,
                       const int64_t* slots, const bool* valid, int64_t n, int64_t num_experts,
                       int64_t num_slots, void* stream);

// The CUDA runtime's message for an error code returned above.
const char* cuda_error_string(int code);

}  // namespace vllm

// Plain C++ entry points of the W4A16 grouped GEMM (w4a16_moe_mm.cu): no torch, no CUDA types,
// so the binding (torch_bindings.cpp) and the kernel compile separately.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vllm {

// Enqueue on `stream` (a cudaStream_t) CUTLASS's SM90 mixed-input grouped GEMM over G groups:
// for each g < G and row r in [offsets[g], offsets[g + 1]),
//   d[r, n] = sum_k a[r, k] * W_g[n, k],
//   W_g[n, k] = q_g[n, k] * scales[g, k / group_size, n]
// q_g[n, k]: the signed int4 (-8..7) in byte w[g, n, k / 2], k even in the low nibble.
// a: bf16 [P, K]; w: [G, N, K / 2] bytes; scales: bf16 [G, K / group_size, N];
// d: bf16 [P, N]; offsets: int64 [G + 1] on the device, nondecreasing, offsets[G] <= P.
// Rows of d outside [offsets[0], offsets[G]) are not written. One setup kernel (one block:
// group shapes and pointers from `offsets`) and the GEMM; no host synchronisation, so the
// pair is capturable in a CUDA graph. `workspace`: at least w4a16_moe_mm_workspace_size(G)
// bytes of device memory, 256-byte aligned.
// Returns 0, or a negative code (see w4a16_moe_mm_error) when the shapes are not supported or
// the device is not SM 9.0, or the cudaError_t of a failed CUDA call.
int w4a16_moe_mm(const void* a, const void* w, const void* scales, void* d,
                 const int64_t* offsets, int64_t num_groups, int64_t n, int64_t k,
                 int64_t group_size, void* workspace, size_t workspace_bytes, int device,
                 void* stream);

// Workspace bytes for `num_groups` groups on `device` (per-group arrays and CUTLASS's per-SM
// tensormaps); -1 when the device cannot be queried.
int64_t w4a16_moe_mm_workspace_size(int64_t num_groups, int device);

// The message for a code returned by w4a16_moe_mm (its own negative codes or a cudaError_t).
const char* w4a16_moe_mm_error(int code);

}  // namespace vllm

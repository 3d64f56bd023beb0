// The torch binding of the compiled ops: schemas under torch.ops._C, argument checks, the
// current stream. Only device-generic torch headers (c10/core, ATen's from_blob), so it also
// compiles against a CPU build of torch (tests/build/test_cmake_build.py). Kernels live in their
// own .cu files behind plain C++ entry points, so nvcc compiles them without torch headers
// (tests/build/test_compile_cuda.py).
#include <Python.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "memory/pinned_host.h"
#include "moe/expert_gather.h"
#ifdef VLLM_HAS_W4A16_MOE_MM
#include "moe/w4a16_moe_mm.h"
#endif

namespace {

// The checks of expert_gather and expert_gather_many (`who`) on one (src, dst) pair and the plan:
// src [E, ...] (pinned host or on dst's device), dst [N, ...] on the device, same dtype and row
// shape, both contiguous; experts, slots int64 [n], valid bool [n] on dst's device.
void check_gather(const char* who, const at::Tensor& src, const at::Tensor& dst,
                  const at::Tensor& experts, const at::Tensor& slots, const at::Tensor& valid) {
  TORCH_CHECK(dst.is_cuda() && dst.is_contiguous(), who, ": dst must be a contiguous "
              "CUDA tensor, got ", dst.device(), dst.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK(src.is_contiguous(), who, ": src must be contiguous");
  const bool on_host = !src.is_cuda();
  // A zero-byte src (no experts, or empty rows) has nothing to read: torch may not report its
  // null storage as pinned, and there is no copy to make (no launch reads it).
  TORCH_CHECK(!on_host || src.nbytes() == 0 || src.is_pinned(), who, ": a host src "
              "must be pinned (page-locked), got an unpinned ", src.device(), " tensor");
  TORCH_CHECK(on_host || src.device() == dst.device(), who, ": src on ", src.device(),
              " but dst on ", dst.device());
  TORCH_CHECK(src.dtype() == dst.dtype(), who, ": src dtype ", src.dtype(),
              " != dst dtype ", dst.dtype());
  TORCH_CHECK(src.dim() >= 1 && src.dim() == dst.dim() &&
              src.sizes().slice(1) == dst.sizes().slice(1),
              who, ": src ", src.sizes(), " and dst ", dst.sizes(),
              " must have the same row shape");
  const int64_t n = experts.numel();
  TORCH_CHECK(slots.numel() == n && valid.numel() == n, who, ": experts, slots and "
              "valid must have one entry each per plan entry, got ", n, ", ", slots.numel(),
              ", ", valid.numel());
  TORCH_CHECK(n <= 65535, who, ": at most 65535 plan entries per call, got ", n);
  for (const at::Tensor* t : {&experts, &slots}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device() == dst.device() &&
                t->is_contiguous(), who, ": experts and slots must be contiguous int64 "
                "tensors on ", dst.device());
  }
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.device() == dst.device() &&
              valid.is_contiguous(), who, ": valid must be a contiguous bool tensor "
              "on ", dst.device());
}

// The current stream of `device`, as a cudaStream_t (stream capture records on it).
void* current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(device).native_handle();
}

vllm::GatherTensor gather_tensor(const at::Tensor& src, at::Tensor& dst) {
  return {src.const_data_ptr(), !src.is_cuda(), dst.data_ptr(),
          dst.size(0) == 0 ? 0 : dst.nbytes() / dst.size(0)};
}

// See moe/expert_gather.h.
void expert_gather(const at::Tensor& src, at::Tensor& dst, const at::Tensor& experts,
                   const at::Tensor& slots, const at::Tensor& valid) {
  check_gather("expert_gather", src, dst, experts, slots, valid);
  // No row to read (E == 0 or empty rows): nothing to copy, as the Triton twin; the kernel
  // would only trap on a valid entry's expert id, none of which can be in range.
  if (src.nbytes() == 0) return;
  const c10::DeviceGuard guard(dst.device());
  const vllm::GatherTensor g = gather_tensor(src, dst);
  const int rc = vllm::expert_gather(
      g.src, g.src_on_host, g.dst, experts.const_data_ptr<int64_t>(),
      slots.const_data_ptr<int64_t>(), valid.const_data_ptr<bool>(), experts.numel(),
      src.size(0), dst.size(0), g.row_bytes, current_stream(dst.device()));
  TORCH_CHECK(rc == 0, "expert_gather: ", vllm::cuda_error_string(rc));
}

// See moe/expert_gather.h: srcs[t] -> dsts[t] for every t, one launch per kMaxGatherTensors
// tensors (one for every layer the engine makes). Every src has the same rows E, every dst the
// same rows N, all dsts on one device.
void expert_gather_many(at::TensorList srcs, at::TensorList dsts, const at::Tensor& experts,
                        const at::Tensor& slots, const at::Tensor& valid) {
  TORCH_CHECK(srcs.size() == dsts.size(), "expert_gather_many: ", srcs.size(), " srcs but ",
              dsts.size(), " dsts");
  if (srcs.empty()) return;
  const int64_t E = srcs[0].size(0), N = dsts[0].size(0);
  std::vector<vllm::GatherTensor> tensors;
  for (size_t t = 0; t < srcs.size(); ++t) {
    at::Tensor dst = dsts[t];
    check_gather("expert_gather_many", srcs[t], dst, experts, slots, valid);
    TORCH_CHECK(srcs[t].size(0) == E && dst.size(0) == N && dst.device() == dsts[0].device(),
                "expert_gather_many: tensor ", t, " has ", srcs[t].size(0), " experts and ",
                dst.size(0), " slots on ", dst.device(), "; tensor 0 has ", E, " and ", N,
                " on ", dsts[0].device());
    if (srcs[t].nbytes() != 0) tensors.push_back(gather_tensor(srcs[t], dst));
  }
  const c10::DeviceGuard guard(dsts[0].device());
  void* stream = current_stream(dsts[0].device());
  for (size_t first = 0; first < tensors.size(); first += vllm::kMaxGatherTensors) {
    const int count = static_cast<int>(
        std::min<size_t>(vllm::kMaxGatherTensors, tensors.size() - first));
    const int rc = vllm::expert_gather_many(
        tensors.data() + first, count, experts.const_data_ptr<int64_t>(),
        slots.const_data_ptr<int64_t>(), valid.const_data_ptr<bool>(), experts.numel(), E, N,
        stream);
    TORCH_CHECK(rc == 0, "expert_gather_many: ", vllm::cuda_error_string(rc));
  }
}

// One block of pinned_host_alloc and the device whose context made it: the tensor's deleter
// context, so the block is freed under that device (see free_pinned_block).
struct PinnedBlock {
  void* ptr = nullptr;
  int device = -1;
};

// The deleter of empty_pinned's tensors (and of a block not yet handed to one). Freeing selects
// the allocating device: on a thread that never selected one, cudaFreeHost would otherwise
// create a context on GPU 0. DeviceGuard restores the thread's device without creating a
// context for it (torch's CUDA guard sets a device back only where its context exists).
void free_pinned_block(void* ctx) noexcept {
  const std::unique_ptr<PinnedBlock> block(static_cast<PinnedBlock*>(ctx));
  if (block == nullptr || block->ptr == nullptr) return;
  try {
    const c10::DeviceGuard guard(
        c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(block->device)));
    vllm::pinned_host_free(block->ptr);
    return;
  } catch (...) {
    // No guard (e.g. at process exit, torch's CUDA state gone): free without one, not leak.
  }
  vllm::pinned_host_free(block->ptr);
}

using PinnedBlockPtr = std::unique_ptr<PinnedBlock, void (*)(void*) noexcept>;

// The bytes of `size` elements of `dtype`. The Python wrapper (vllm/kernels/cuda/ops.py) checks
// first: these are a last resort.
uint64_t pinned_bytes(c10::IntArrayRef size, c10::ScalarType dtype) {
  uint64_t numel = 1, bytes = 0;
  for (const int64_t d : size) {
    TORCH_CHECK(d >= 0, "empty_pinned: sizes must be non-negative, got ", size);
    TORCH_CHECK(!c10::mul_overflows(numel, static_cast<uint64_t>(d), &numel),
                "empty_pinned: ", size, " overflows");
  }
  TORCH_CHECK(!c10::mul_overflows(numel, static_cast<uint64_t>(c10::elementSize(dtype)), &bytes),
              "empty_pinned: ", size, " of ", dtype, " overflows");
  return bytes;
}

// See memory/pinned_host.h. An uninitialised CPU tensor of exactly `size` in page-locked memory
// (torch's pinned allocator would round it up to a power of two), freed with its last reference;
// with (status, cuda_error) = (0, 0). A failed allocation returns an empty tensor, the
// PinnedHostStatus and the CUDA error instead of throwing: the Python wrapper raises
// torch.OutOfMemoryError or RuntimeError. (On the H100 image a C++ exception thrown here
// crashed the process; an allocation failure is an expected outcome, the store's cue to fall
// back to pageable memory.)
std::tuple<at::Tensor, int64_t, int64_t> try_empty_pinned(c10::IntArrayRef size,
                                                          c10::ScalarType dtype) {
  const uint64_t bytes = pinned_bytes(size, dtype);
  // Owned by this unique_ptr from allocation until the tensor maker takes it, so an exception
  // in between frees the block instead of leaking locked memory.
  PinnedBlockPtr block(new PinnedBlock(), &free_pinned_block);
  int cuda_error = 0;
  const vllm::PinnedHostStatus status = vllm::pinned_host_alloc(
      static_cast<size_t>(bytes), &block->ptr, &block->device, &cuda_error);
  if (status != vllm::PinnedHostStatus::kOk) {
    return {at::empty({0}, at::TensorOptions().dtype(dtype).device(at::kCPU)),
            static_cast<int64_t>(status), cuda_error};
  }
  void* const data = block->ptr;
  // for_blob and context() do not throw; from context() on, the maker (then the tensor's
  // DataPtr) owns the block and frees it if make_tensor throws.
  at::Tensor t = at::for_blob(data, size)
                     .context(block.release(), &free_pinned_block)
                     .options(at::TensorOptions().dtype(dtype).device(at::kCPU))
                     .make_tensor();
  return {t, 0, 0};
}

// A cudaError_t's text, for the Python wrapper's messages.
std::string cuda_error_message(int64_t code) {
  return vllm::cuda_error_string(static_cast<int>(code));
}

#ifdef VLLM_HAS_W4A16_MOE_MM
void check_cuda_tensor(const at::Tensor& t, const char* name, c10::ScalarType dtype,
                       int64_t dim, const at::Device& device) {
  TORCH_CHECK(t.device() == device && t.is_contiguous(), "w4a16_moe_mm: ", name,
              " must be a contiguous tensor on ", device, ", got ", t.device(),
              t.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == dim, "w4a16_moe_mm: ", name, " must be ",
              dtype, " with ", dim, " dims, got ", t.scalar_type(), " ", t.sizes());
  // TMA reads and writes 16-byte aligned rows from 16-byte aligned bases (a view with a
  // storage offset may not be).
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0, "w4a16_moe_mm: ", name,
              " must start at a 16-byte aligned address");
}

// See moe/w4a16_moe_mm.h. a bf16 [P, K]; w uint8 [G, N, K / 2]; scales bf16
// [G, K / group_size, N]; d bf16 [P, N]; expert_offsets int64 [G + 1]; workspace uint8.
void w4a16_moe_mm(const at::Tensor& a, const at::Tensor& w, const at::Tensor& scales,
                  at::Tensor& d, const at::Tensor& expert_offsets, int64_t group_size,
                  at::Tensor& workspace) {
  TORCH_CHECK(d.is_cuda(), "w4a16_moe_mm: d must be a CUDA tensor, got ", d.device());
  const at::Device dev = d.device();
  check_cuda_tensor(a, "a", at::kBFloat16, 2, dev);
  check_cuda_tensor(w, "w", at::kByte, 3, dev);
  check_cuda_tensor(scales, "scales", at::kBFloat16, 3, dev);
  check_cuda_tensor(d, "d", at::kBFloat16, 2, dev);
  check_cuda_tensor(expert_offsets, "expert_offsets", at::kLong, 1, dev);
  check_cuda_tensor(workspace, "workspace", at::kByte, 1, dev);
  const int64_t P = a.size(0), K = a.size(1), G = w.size(0), N = w.size(1);
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "w4a16_moe_mm: group_size ", group_size,
              " must divide K = ", K);
  TORCH_CHECK(w.size(2) * 2 == K, "w4a16_moe_mm: w ", w.sizes(), " must be [G, N, K / 2] for "
              "K = ", K);
  TORCH_CHECK(d.size(0) == P && d.size(1) == N, "w4a16_moe_mm: d ", d.sizes(), " must be [",
              P, ", ", N, "]");
  TORCH_CHECK(scales.size(0) == G && scales.size(1) == K / group_size && scales.size(2) == N,
              "w4a16_moe_mm: scales must be [", G, ", ", K / group_size, ", ", N, "], got ",
              scales.sizes());
  TORCH_CHECK(expert_offsets.numel() == G + 1, "w4a16_moe_mm: expert_offsets must have G + 1 "
              "= ", G + 1, " entries, got ", expert_offsets.numel());
  const c10::DeviceGuard guard(dev);
  void* stream = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(dev)
                     .native_handle();
  const int rc = vllm::w4a16_moe_mm(
      a.const_data_ptr(), w.const_data_ptr(), scales.const_data_ptr(), d.data_ptr(),
      expert_offsets.const_data_ptr<int64_t>(), G, N, K, group_size, workspace.data_ptr(),
      static_cast<size_t>(workspace.nbytes()), dev.index(), stream);
  TORCH_CHECK(rc == 0, "w4a16_moe_mm: ", vllm::w4a16_moe_mm_error(rc));
}

int64_t w4a16_moe_mm_workspace_size(int64_t num_groups, int64_t device) {
  const int64_t bytes = vllm::w4a16_moe_mm_workspace_size(num_groups, static_cast<int>(device));
  TORCH_CHECK(bytes >= 0, "w4a16_moe_mm_workspace_size: num_groups ", num_groups, " on device ",
              device, ": needs num_groups > 0 and a CUDA device");
  return bytes;
}
#endif  // VLLM_HAS_W4A16_MOE_MM

}  // namespace

TORCH_LIBRARY(_C, m) {
  m.def("expert_gather(Tensor src, Tensor(a!) dst, Tensor experts, Tensor slots, Tensor valid)"
        " -> ()");
  m.def("expert_gather_many(Tensor[] srcs, Tensor(a!)[] dsts, Tensor experts, Tensor slots, "
        "Tensor valid) -> ()");
  // No tensor argument: plain functions, as w4a16_moe_mm_workspace_size below.
  m.def("try_empty_pinned(int[] size, ScalarType dtype) -> (Tensor, int, int)",
        &try_empty_pinned);
  m.def("cuda_error_string(int code) -> str", &cuda_error_message);
#ifdef VLLM_HAS_W4A16_MOE_MM
  m.def("w4a16_moe_mm(Tensor a, Tensor w, Tensor scales, Tensor(a!) d, Tensor expert_offsets, "
        "int group_size, Tensor(b!) workspace) -> ()");
  // No tensor argument: a plain function (CompositeExplicitAutograd would need one).
  m.def("w4a16_moe_mm_workspace_size(int num_groups, int device) -> int",
        &w4a16_moe_mm_workspace_size);
#endif
}

TORCH_LIBRARY_IMPL(_C, CUDA, m) {
  m.impl("expert_gather", &expert_gather);
  m.impl("expert_gather_many", &expert_gather_many);
#ifdef VLLM_HAS_W4A16_MOE_MM
  m.impl("w4a16_moe_mm", &w4a16_moe_mm);
#endif
}

// `import vllm._C` runs the registrations above; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, nullptr};
  return PyModule_Create(&module);
}

// The torch binding of the compiled ops: schemas under torch.ops._C, argument checks, the
// current stream. Only device-generic torch headers (c10/core), so it also compiles against a
// CPU build of torch (tests/build/test_cmake_build.py). Kernels live in their own .cu files behind plain C++ entry points, so nvcc
// compiles them without torch headers (tests/build/test_compile_cuda.py).
#include <Python.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>

#include "moe/expert_gather.h"

namespace {

// See moe/expert_gather.h. src [E, ...] (pinned host or on dst's device), dst [N, ...] on the
// device, same dtype and row shape, both contiguous; experts, slots int64 [n], valid bool [n] on
// dst's device.
void expert_gather(const at::Tensor& src, at::Tensor& dst, const at::Tensor& experts,
                   const at::Tensor& slots, const at::Tensor& valid) {
  TORCH_CHECK(dst.is_cuda() && dst.is_contiguous(), "expert_gather: dst must be a contiguous "
              "CUDA tensor, got ", dst.device(), dst.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK(src.is_contiguous(), "expert_gather: src must be contiguous");
  const bool on_host = !src.is_cuda();
  TORCH_CHECK(!on_host || src.is_pinned(), "expert_gather: a host src must be pinned "
              "(page-locked), got an unpinned ", src.device(), " tensor");
  TORCH_CHECK(on_host || src.device() == dst.device(), "expert_gather: src on ", src.device(),
              " but dst on ", dst.device());
  TORCH_CHECK(src.dtype() == dst.dtype(), "expert_gather: src dtype ", src.dtype(),
              " != dst dtype ", dst.dtype());
  TORCH_CHECK(src.dim() >= 1 && src.dim() == dst.dim() &&
              src.sizes().slice(1) == dst.sizes().slice(1),
              "expert_gather: src ", src.sizes(), " and dst ", dst.sizes(),
              " must have the same row shape");
  const int64_t n = experts.numel();
  TORCH_CHECK(slots.numel() == n && valid.numel() == n, "expert_gather: experts, slots and "
              "valid must have one entry each per plan entry, got ", n, ", ", slots.numel(),
              ", ", valid.numel());
  TORCH_CHECK(n <= 65535, "expert_gather: at most 65535 plan entries per call, got ", n);
  for (const at::Tensor* t : {&experts, &slots}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device() == dst.device() &&
                t->is_contiguous(), "expert_gather: experts and slots must be contiguous int64 "
                "tensors on ", dst.device());
  }
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.device() == dst.device() &&
              valid.is_contiguous(), "expert_gather: valid must be a contiguous bool tensor "
              "on ", dst.device());
  const c10::DeviceGuard guard(dst.device());
  // The current stream of dst's device, as a cudaStream_t (stream capture records on it).
  void* stream = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA)
                     .getStream(dst.device()).native_handle();
  const int64_t row_bytes = dst.size(0) == 0 ? 0 : dst.nbytes() / dst.size(0);
  const int rc = vllm::expert_gather(
      src.const_data_ptr(), on_host, dst.data_ptr(), experts.const_data_ptr<int64_t>(),
      slots.const_data_ptr<int64_t>(), valid.const_data_ptr<bool>(), n, src.size(0),
      dst.size(0), row_bytes, stream);
  TORCH_CHECK(rc == 0, "expert_gather: ", vllm::cuda_error_string(rc));
}

}  // namespace

TORCH_LIBRARY(_C, m) {
  m.def("expert_gather(Tensor src, Tensor(a!) dst, Tensor experts, Tensor slots, Tensor valid)"
        " -> ()");
}

TORCH_LIBRARY_IMPL(_C, CUDA, m) { m.impl("expert_gather", &expert_gather); }

// `import vllm._C` runs the registrations above; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, nullptr};
  return PyModule_Create(&module);
}

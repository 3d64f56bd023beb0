// The W4A16 grouped GEMM of the cutlass_w4a16 MoE backend: CUTLASS's SM90 mixed-input
// ptr-array GEMM (collective sm90_mma_array_tma_gmma_rs_warpspecialized_mixed_input: int4
// weights converted in registers, scaled per group, bf16 GMMA), one group per expert slot. The
// contract is in w4a16_moe_mm.h. NOT YET RUN ON A GPU.
//
// Scale only, no zero points: in CUTLASS 4.2 this grouped collective's ConvertAndScaleWithZero
// mode sets up only the zero tensormap per group (tensormaps_init, _replace_global_address,
// _replace_global_tensor_properties, _cp_fence_release and _fence_acquire each handle scale OR
// zero), so the scale loads would read an uninitialised descriptor; CUTLASS's example 69 says
// "Zero-points ... not supported" and runs ConvertOnly and ScaleOnly. Symmetric GPTQ (zero 8
// everywhere) is q * scale with q = u - 8, which this mode computes.
//
// Swap AB, as CUTLASS's grouped mixed-input examples do: the narrow operand must be the
// register-sourced one, so the GEMM computed is D^T [N, M] = W [N, K] x A^T, with the weights
// as CUTLASS's A (K-major) and the activations as its B (K-major [M, K] rows), and D^T written
// column-major, which is d [M, N] row-major. Each output element is one K loop over its row and
// column (no split K), so a row's result does not depend on which other rows share its group:
// the expert cache's waves give the same bits as one uncached call.
//
// Group shapes live only on the device (the setup kernel writes them from the offsets), so
// CUTLASS's tile scheduler reads them there: no host read of token counts.
#include "moe/w4a16_moe_mm.h"

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

// A named namespace: CuTe has anonymous namespaces of its own, and nvcc's kernel stubs cannot
// tell two anonymous namespaces of one file apart under `using namespace cute`.
namespace vllm::w4a16_detail {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (N, M, K)
using ElementAct = cutlass::bfloat16_t;
using ElementW = cutlass::int4b_t;
using ElementScale = cutlass::bfloat16_t;  // the MMA type: the collective scales in it
using ElementD = cutlass::bfloat16_t;
using Accum = float;
static_assert(sizeof(ElementW) == 1, "setup_groups offsets the int4 weights in bytes");

// The user-facing layouts (d = a @ W^T), transposed for swap AB below.
using LayoutAct = cutlass::layout::RowMajor;   // a [M, K]
using LayoutW = cutlass::layout::ColumnMajor;  // W^T [K, N] column-major = W [N, K] rows
using LayoutD = cutlass::layout::RowMajor;     // d [M, N]
using LayoutActT = typename cutlass::layout::LayoutTranspose<LayoutAct>::type;
using LayoutWT = typename cutlass::layout::LayoutTranspose<LayoutW>::type;
using LayoutDT = typename cutlass::layout::LayoutTranspose<LayoutD>::type;
constexpr int kAlignAct = 128 / cutlass::sizeof_bits<ElementAct>::value;  // 16-byte TMA rows
constexpr int kAlignW = 128 / cutlass::sizeof_bits<ElementW>::value;
constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
constexpr int kTileK = 128 * 8 / cutlass::sizeof_bits<ElementAct>::value;  // 64: 128 B of bf16

// 128 weight rows x 16 tokens per tile: decode puts few tokens on each expert.
using TileShape = Shape<_128, _16, Int<kTileK>>;
using ClusterShape = Shape<_1, _1, _1>;
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, Accum, Accum,
    void, LayoutDT*, kAlignD,           // no C: d = alpha * acc, alpha = 1
    ElementD, LayoutDT*, kAlignD, EpilogueSchedule>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    cute::tuple<ElementW, ElementScale>, LayoutWT*, kAlignW,  // q * s (ConvertAndScale)
    ElementAct, LayoutActT*, kAlignAct, Accum, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

using GemmKernel =
    cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

using StrideW = typename GemmKernel::InternalStrideA;    // the mainloop's A: the weights
using StrideAct = typename GemmKernel::InternalStrideB;  // its B: the activations
using StrideD = typename GemmKernel::InternalStrideD;
using StrideS = typename CollectiveMainloop::StrideScale;
using Shape3 = typename ProblemShape::UnderlyingProblemShape;

constexpr int kErrShape = -1;   // shapes outside the contract
constexpr int kErrDevice = -2;  // not an SM 9.0 device
constexpr int kErrCutlass = -3; // CUTLASS refused (can_implement / initialize / run)
constexpr int kErrWorkspace = -4;
constexpr int kErrSmCount = -5;

// The per-group arrays CUTLASS reads, carved from the caller's workspace in this order, then
// CUTLASS's own workspace.
struct GroupArrays {
  Shape3* shapes;
  const ElementW** w;
  const ElementAct** act;
  const ElementScale** s;
  ElementD** d;
  StrideW* stride_w;
  StrideAct* stride_act;
  StrideS* stride_s;
  StrideD* stride_d;
  char* cutlass_workspace;
};

constexpr size_t round_up(size_t x) { return (x + 255) / 256 * 256; }

size_t group_arrays_bytes(int64_t g) {
  const size_t n = static_cast<size_t>(g);
  return round_up(n * sizeof(Shape3)) + 4 * round_up(n * sizeof(void*)) +
         round_up(n * sizeof(StrideW)) + round_up(n * sizeof(StrideAct)) +
         round_up(n * sizeof(StrideS)) + round_up(n * sizeof(StrideD));
}

GroupArrays carve(void* workspace, int64_t g) {
  char* p = static_cast<char*>(workspace);
  const size_t n = static_cast<size_t>(g);
  auto take = [&p](size_t bytes) { char* q = p; p += round_up(bytes); return q; };
  GroupArrays a;
  a.shapes = reinterpret_cast<Shape3*>(take(n * sizeof(Shape3)));
  a.w = reinterpret_cast<const ElementW**>(take(n * sizeof(void*)));
  a.act = reinterpret_cast<const ElementAct**>(take(n * sizeof(void*)));
  a.s = reinterpret_cast<const ElementScale**>(take(n * sizeof(void*)));
  a.d = reinterpret_cast<ElementD**>(take(n * sizeof(void*)));
  a.stride_w = reinterpret_cast<StrideW*>(take(n * sizeof(StrideW)));
  a.stride_act = reinterpret_cast<StrideAct*>(take(n * sizeof(StrideAct)));
  a.stride_s = reinterpret_cast<StrideS*>(take(n * sizeof(StrideS)));
  a.stride_d = reinterpret_cast<StrideD*>(take(n * sizeof(StrideD)));
  a.cutlass_workspace = p;
  return a;
}

// One block: group g's shape (N, rows of g, K), its operand pointers and strides.
__global__ void setup_groups(GroupArrays arr, const int64_t* __restrict__ offsets, int64_t G,
                             int n, int k, int scale_k, const ElementAct* a, const ElementW* w,
                             const ElementScale* s, ElementD* d) {
  for (int64_t g = threadIdx.x; g < G; g += blockDim.x) {
    const int64_t first = offsets[g];
    // Nondecreasing offsets by contract; a broken one gives an empty group, not a negative M.
    const int m = static_cast<int>(max(offsets[g + 1] - first, int64_t{0}));
    arr.shapes[g] = Shape3(n, m, k);
    // sizeof(int4b_t) is 1 (a byte of storage), so int4b_t* arithmetic steps in bytes, not
    // elements: an expert's n * k values are n * k / 2 bytes (CUTLASS's own examples offset
    // int4 operands in bytes too). CuTe reads the elements through a subbyte iterator.
    arr.w[g] = w + g * static_cast<int64_t>(n) * k / 2;
    arr.act[g] = a + first * k;
    arr.s[g] = s + g * static_cast<int64_t>(scale_k) * n;
    arr.d[g] = d + first * n;
    arr.stride_w[g] = cutlass::make_cute_packed_stride(StrideW{}, cute::make_shape(n, k, 1));
    arr.stride_act[g] =
        cutlass::make_cute_packed_stride(StrideAct{}, cute::make_shape(m, k, 1));
    arr.stride_s[g] =
        cutlass::make_cute_packed_stride(StrideS{}, cute::make_shape(n, scale_k, 1));
    arr.stride_d[g] = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(n, m, 1));
  }
}

// SM count per device, queried once (also outside any stream capture: the first call is the
// eager warm-up that sizes the workspace).
int sm_count(int device) {
  static int counts[64] = {0};
  if (device < 0 || device >= 64) return 0;
  if (counts[device] == 0) {
    int c = 0;
    if (cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      return 0;
    }
    counts[device] = c;
  }
  return counts[device];
}

typename Gemm::Arguments make_arguments(const GroupArrays& arr, int64_t G, int group_size,
                                        int device) {
  typename Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {cute::_0{}, cute::_0{}, 0};
  fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count(device);
  args = typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(G), arr.shapes, nullptr},  // shapes on the device only
      {arr.w, arr.stride_w, arr.act, arr.stride_act, arr.s, arr.stride_s, group_size},
      {fusion, nullptr, nullptr, arr.d, arr.stride_d},
      hw};
  return args;
}

int check_device(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return kErrDevice;
  }
  return (major == 9 && minor == 0) ? 0 : kErrDevice;
}

}  // namespace vllm::w4a16_detail

namespace vllm {

using namespace w4a16_detail;

int64_t w4a16_moe_mm_workspace_size(int64_t num_groups, int device) {
  if (num_groups <= 0 || sm_count(device) == 0) return -1;
  GroupArrays arr = carve(nullptr, num_groups);
  typename Gemm::Arguments args = make_arguments(arr, num_groups, kTileK, device);
  return static_cast<int64_t>(group_arrays_bytes(num_groups) + Gemm::get_workspace_size(args));
}

int w4a16_moe_mm(const void* a, const void* w, const void* scales, void* d,
                 const int64_t* offsets, int64_t num_groups, int64_t n, int64_t k,
                 int64_t group_size, void* workspace, size_t workspace_bytes, int device,
                 void* stream) {
  if (num_groups <= 0 || num_groups > (1 << 20) || n <= 0 || k <= 0 || n % 8 || k % kTileK ||
      n > (1 << 30) || k > (1 << 30) ||
      !(group_size == k || (group_size > 0 && group_size % kTileK == 0 && k % group_size == 0))) {
    return kErrShape;
  }
  if (const int rc = check_device(device)) return rc;
  const int64_t need = w4a16_moe_mm_workspace_size(num_groups, device);
  if (need < 0) return kErrSmCount;
  if (workspace_bytes < static_cast<size_t>(need) ||
      reinterpret_cast<uintptr_t>(workspace) % 256) {
    return kErrWorkspace;
  }
  auto st = static_cast<cudaStream_t>(stream);
  GroupArrays arr = carve(workspace, num_groups);
  const int scale_k = static_cast<int>(k / group_size);
  setup_groups<<<1, 256, 0, st>>>(
      arr, offsets, num_groups, static_cast<int>(n), static_cast<int>(k), scale_k,
      static_cast<const ElementAct*>(a), static_cast<const ElementW*>(w),
      static_cast<const ElementScale*>(scales), static_cast<ElementD*>(d));
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return static_cast<int>(e);
  typename Gemm::Arguments args =
      make_arguments(arr, num_groups, static_cast<int>(group_size), device);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return kErrCutlass;
  if (gemm.initialize(args, arr.cutlass_workspace, st) != cutlass::Status::kSuccess) {
    return kErrCutlass;
  }
  if (gemm.run(st) != cutlass::Status::kSuccess) {
    const cudaError_t e = cudaGetLastError();
    return e != cudaSuccess ? static_cast<int>(e) : kErrCutlass;
  }
  return 0;
}

const char* w4a16_moe_mm_error(int code) {
  switch (code) {
    case kErrShape:
      return "shapes outside the kernel's contract (N a multiple of 8, K of 64, group_size K "
             "or a multiple of 64 dividing K)";
    case kErrDevice:
      return "the device is not SM 9.0 (the kernel is CUTLASS's SM90 GMMA collective)";
    case kErrCutlass:
      return "CUTLASS refused the arguments (can_implement, initialize or run)";
    case kErrWorkspace:
      return "the workspace is smaller than w4a16_moe_mm_workspace_size or not 256-byte "
             "aligned";
    case kErrSmCount:
      return "the device's SM count could not be queried (cudaDeviceGetAttribute failed)";
    default:
      return cudaGetErrorString(static_cast<cudaError_t>(code));
  }
}

}  // namespace vllm

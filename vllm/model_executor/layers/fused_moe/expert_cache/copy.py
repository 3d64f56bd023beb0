"""Copy the experts a LoadPlan asks for from the host store into their device slots.

Only misses move: entry i of the plan copies expert ``experts[i]`` into slot ``slots[i]`` when
``valid[i]``, for every expert-indexed tensor of the store (weights and their scales, zeros,
g_idx... together, so a slot never holds one expert's weights with another's scales).

Paths, chosen once per provider from the slots' device (``select_copy``):
  * CPU slots with the C kernels: ``expert_copy`` (``vllm/kernels/cpu/moe_cache.c``), one
    memcpy per miss and tensor from one call per tensor; CPU graphs record it. Under
    ``torch.compile`` (which cannot trace a C call) the torch path below runs instead.
  * same device as the store otherwise: masked ``index_copy_`` over ``nonzero(valid)``; no host
    sync, traceable with ``torch.compile(fullgraph=True)`` given
    ``torch._dynamo.config.capture_dynamic_output_shape_ops = True`` (nonzero's length is data
    dependent).
  * CUDA slots with a pinned store (``CudaKernelCopy``): kernels reading the pinned store in
    place, no host sync: one launch for all the layer's tensors with
    ``Platform.expert_copy_many_kernel`` (``vllm._C``'s ``expert_gather_many``, else its Triton
    twin ``vllm/kernels/triton/expert_gather_many.py``), else one per tensor with a kernel
    installed with ``register_cuda_copy_kernel`` (it takes precedence), or
    ``Platform.expert_copy_kernel``: ``vllm._C``'s ``expert_gather`` (an older build without
    the many op), else the Triton gather (``vllm/kernels/triton/expert_gather.py``). A decode
    step that hits everywhere still launches the copy (its blocks read the flags of their
    entries and exit; the grid has min(n, 8) rows of blocks, each walking every 8th entry):
    with GPTQ's eight tensors per layer that is one launch instead of eight. Their ``gpu`` tests
    on an H100 (2026-11-26): tests/kernels/triton/test_triton_expert_gather.py passed; 14 of
    tests/kernels/cuda/test_expert_gather.py passed, then its bad-argument test crashed the
    process, and the Triton many twin's graph test failed (both fixed since, not re-run); the
    decode benchmark ran the copy.
  * otherwise (CUDA without a kernel, i.e. neither vllm._C nor triton; an unpinned store; other
    accelerators): a plain torch fallback that reads the plan on the host (ONE sync per wave)
    and issues one copy per (miss, tensor), asynchronous when the store is pinned.
Each engine says whether it is ``sync_free`` (no host read of the plan: the C kernel, and the
CUDA path when a kernel is found), which decode graphs need (``CachedWeightProvider.
cuda_graph_refusal``): with the Triton residency step and either gather, a cached layer can be
captured.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from vllm.model_executor.layers.fused_moe.expert_cache.residency import LoadPlan
from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore
from vllm.platforms import platform_for


# ==== SEAM: device kernel reading pinned host memory =============================================
class UvaCopyKernel(Protocol):
    def __call__(self, src: torch.Tensor, dst: torch.Tensor, experts: torch.Tensor,
                 slots: torch.Tensor, valid: torch.Tensor) -> None:
        """Enqueue on the current stream: for each i with valid[i], dst[slots[i]] = src[experts[i]].

        src [E, ...] contiguous pinned host tensor (read through its device-mapped/UVA address);
        dst [N, ...] contiguous device tensor; experts, slots [N] int64 and valid [N] bool on the
        device. Must not synchronise with the host, must skip invalid entries without reading
        their (garbage, possibly -1) ids, and must bounds-check ids (0 <= experts[i] < E,
        0 <= slots[i] < N). One launch per tensor, a grid fixed by the shapes (bytes-per-expert
        chunks x rows of entries).
        """


_cuda_copy_kernel: UvaCopyKernel | None = None


def register_cuda_copy_kernel(kernel: UvaCopyKernel | None) -> None:
    """Install (or remove, with None) the device copy kernel used for CUDA slots."""
    global _cuda_copy_kernel
    _cuda_copy_kernel = kernel
# ==== END SEAM ==================================================================================


CopyMisses = Callable[[dict[str, torch.Tensor], LoadPlan], None]
"""(slots name -> [N, ...], plan) -> None: copy every valid plan entry's expert into its slot."""


class CpuKernelCopy:
    """The C copy kernel per tensor (the torch path while torch.compile traces)."""
    cpu_graph_node = True
    """CPU graphs record it (``graph.launch``)."""
    sync_free = True
    """No host read of the plan: a decode graph may capture it (``CopyEngine.sync_free``)."""

    def __init__(self, store: HostStore, kernel: UvaCopyKernel):
        self.store, self.kernel = store, kernel

    def __call__(self, slots: dict[str, torch.Tensor], plan: LoadPlan) -> None:
        if torch.compiler.is_compiling():
            _copy_same_device(self.store, slots, plan)
            return
        for name, src in self.store.tensors.items():
            self.kernel(src, slots[name], plan.experts, plan.slots, plan.valid)


class CopyEngine:
    """One of the torch paths above, as an object that says what it needs of the host."""
    cpu_graph_node = False
    sync_free = False
    """Whether a call never reads device data on the host (nor sizes work from it), so a CUDA
    graph can capture it. False for ``nonzero`` (a data-dependent shape) and the fallback."""

    def __init__(self, store: HostStore, fn: Callable[..., None], *args):
        self.store, self.fn, self.args = store, fn, args

    def __call__(self, slots: dict[str, torch.Tensor], plan: LoadPlan) -> None:
        self.fn(self.store, slots, plan, *self.args)


class CudaKernelCopy(CopyEngine):
    """``_copy_cuda``: the registered or platform kernel, looked up per call (a kernel may be
    registered after the provider is built); the torch fallback where there is none."""

    def __init__(self, store: HostStore):
        super().__init__(store, _copy_cuda)

    @property
    def sync_free(self) -> bool:
        return _cuda_copy_kernel is not None or \
            platform_for("cuda").expert_copy_kernel() is not None


def select_copy(store: HostStore, device: torch.device) -> CopyMisses:
    """The copy engine for slots on ``device``, chosen once per provider (paths above)."""
    if device == next(iter(store.tensors.values())).device:
        kernel = platform_for(device).expert_copy_kernel() if device.type == "cpu" else None
        if kernel is not None:
            return CpuKernelCopy(store, kernel)
        return CopyEngine(store, _copy_same_device)
    if device.type == "cuda" and store.pinned:
        return CudaKernelCopy(store)
    return CopyEngine(store, _copy_torch_fallback, store.pinned)


def _copy_cuda(store: HostStore, slots: dict[str, torch.Tensor], plan: LoadPlan) -> None:
    platform = platform_for("cuda")
    many = None if _cuda_copy_kernel is not None else platform.expert_copy_many_kernel()
    if many is not None:         # one launch for all the layer's tensors, hit or miss
        many(list(store.tensors.values()), [slots[name] for name in store.tensors],
             plan.experts, plan.slots, plan.valid)
        return
    kernel = _cuda_copy_kernel or platform.expert_copy_kernel()
    if kernel is None:
        _copy_torch_fallback(store, slots, plan, non_blocking=True)
        return
    for name, src in store.tensors.items():
        kernel(src, slots[name], plan.experts, plan.slots, plan.valid)


def _copy_same_device(store: HostStore, slots: dict[str, torch.Tensor], plan: LoadPlan) -> None:
    idx = plan.valid.nonzero().squeeze(1)                # [M] plan entries that load, M <= N
    experts = plan.experts.index_select(0, idx)          # [M] expert ids (all >= 0)
    dst = plan.slots.index_select(0, idx)                # [M] distinct slot ids
    for name, src in store.tensors.items():
        _bytes(slots[name]).index_copy_(0, dst, _bytes(src).index_select(0, experts))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # index_select / index_copy_ have no CPU kernels for float8 dtypes: move their raw bytes.
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def _copy_torch_fallback(store: HostStore, slots: dict[str, torch.Tensor], plan: LoadPlan,
                         non_blocking: bool) -> None:
    # The only host sync of the cached forward on an accelerator without a copy kernel.
    idx = plan.valid.nonzero().squeeze(1)
    pairs = torch.stack([plan.experts[idx], plan.slots[idx]], dim=1).tolist()
    for expert, slot in pairs:
        for name, src in store.tensors.items():
            # Store rows are never written after loading, so an in-flight async read is safe;
            # the slot write is stream-ordered after earlier kernels that read the slot.
            slots[name][slot].copy_(src[expert], non_blocking=non_blocking)

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
  * CUDA with a copy kernel: one launch per tensor reading the pinned store in place, no host
    sync (``vllm._C``'s ``expert_gather`` where a CUDA build made it, from
    ``Platform.expert_copy_kernel``; or one installed with ``register_cuda_copy_kernel``).
    NOT YET RUN ON A GPU: tests/kernels/cuda/test_expert_gather.py (marked gpu) checks it.
  * otherwise (CUDA without a kernel, other accelerators): a plain torch fallback that reads the
    plan on the host (ONE sync per wave) and issues one copy per (miss, tensor), asynchronous
    when the store is pinned.
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
        0 <= slots[i] < N). One launch per tensor, grid over (N, bytes-per-expert chunks).
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

    def __init__(self, store: HostStore, kernel: UvaCopyKernel):
        self.store, self.kernel = store, kernel

    def __call__(self, slots: dict[str, torch.Tensor], plan: LoadPlan) -> None:
        if torch.compiler.is_compiling():
            _copy_same_device(self.store, slots, plan)
            return
        for name, src in self.store.tensors.items():
            self.kernel(src, slots[name], plan.experts, plan.slots, plan.valid)


def select_copy(store: HostStore, device: torch.device) -> CopyMisses:
    """The copy engine for slots on ``device``, chosen once per provider (paths above)."""
    if device == next(iter(store.tensors.values())).device:
        kernel = platform_for(device).expert_copy_kernel() if device.type == "cpu" else None
        if kernel is not None:
            return CpuKernelCopy(store, kernel)
        return lambda slots, plan: _copy_same_device(store, slots, plan)
    if device.type == "cuda" and store.pinned:
        # Looked up per call: a kernel may be registered after the provider is built.
        return lambda slots, plan: _copy_cuda(store, slots, plan)
    return lambda slots, plan: _copy_torch_fallback(store, slots, plan, store.pinned)


def _copy_cuda(store: HostStore, slots: dict[str, torch.Tensor], plan: LoadPlan) -> None:
    kernel = _cuda_copy_kernel or platform_for("cuda").expert_copy_kernel()
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

"""MoE expert backends: what each supports, and the one function that picks one.

A backend declares the quantization schemes, activations, platforms, compute capabilities and
dtypes it handles (``MoEBackend``); ``select_moe_backend`` matches a layer's ``MoEKernelQuery``
against them. "auto" tries the platform's preference order (``Platform.moe_backends``), then
any other registered backend, skipping those registered ``auto=False``; a forced name that
cannot run the layer is an error that names the reason and the backends that would. The choice
is logged once per distinct decision.

Built in: ``cpu_kernel`` (the C kernel, CPU f32/bf16: unquantized, FP8 tensor/channel/block,
GPTQ INT4, NVFP4 and MXFP4 weights dequantized tile by tile inside its GEMM), ``grouped_mm``
(``torch._grouped_mm``, unquantized; CUDA needs SM 9.0 and bf16) and ``torch`` (the per-expert
loop reference: every scheme, every platform; quantized experts are dequantized per expert).
All three take expert biases and every activation (``MOE_ACTIVATIONS``: the gated ones, and the
non-gated ``relu2_no_mul`` whose w13 holds the up projection only). ``triton`` (the Triton
fused-MoE kernels, ``triton_experts.py``; fp16/bf16/fp32, biases; unquantized with every
activation, and FP8 tensor/channel/block, GPTQ INT4, NVFP4 and MXFP4 weights, gated
activations, dequantized tile by tile right before each ``tl.dot``; FP8 with the checkpoint's
FP8 activations as e4m3 x e4m3 dots where the platform ``has_fp8_matmul``) runs on CUDA, or on
CPU only under ``TRITON_INTERPRET=1``; run on an H100 (2026-11-26): bf16, fp8-block
(weight-only), w4a16-gptq experts.

``flashinfer_cutlass`` (FlashInfer's CUTLASS fused MoE, ``flashinfer_cutlass.py``: unquantized
fp16/bf16, FP8 128x128 blocks on SM90, NVFP4 on SM10x-12x, MXFP4 W4A16 on SM90; CUDA with
flashinfer-python; GPTQ INT4 refused with the reason) has never run on a GPU: it is registered
with ``auto=False``, so only a forced name selects it.

``cutlass_w4a16`` (``cutlass_w4a16.py``: symmetric GPTQ INT4 experts, ``w4a16-gptq`` (act order
too), group size the whole input or a multiple of 64, on CUTLASS's SM90 mixed-input grouped GEMM from
``vllm._C``; bf16, gated activations, SM 9.0, hidden and intermediate sizes multiples of 64) has
not passed on a GPU yet: on an H100 (2026-11-26) its op equalled the torch stand-in, but the
backend's gpu test failed (a test-helper device bug, fixed since, not re-run). ``auto=False``,
forced only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vllm.kernels.cpu.ops import prepack
from vllm.model_executor.layers.backend_registry import BackendRegistry
from vllm.model_executor.layers.fused_moe.cpu_kernel import (QuantLayout, expert_pairs_cpu,
                                                            expert_pairs_cpu_quant,
                                                            pack_quantized)
from vllm.model_executor.layers.fused_moe.cutlass_w4a16 import (CutlassW4A16Experts,
                                                                cutlass_w4a16_refusal)
from vllm.model_executor.layers.fused_moe.flashinfer_cutlass import (FLASHINFER_DTYPES,
                                                                     FLASHINFER_SCHEMES,
                                                                     FlashInferCutlassExperts,
                                                                     UNMAPPED_SCHEMES,
                                                                     flashinfer_cutlass_refusal)
from vllm.model_executor.layers.fused_moe.grouped_mm import (expert_pairs_grouped,
                                                             grouped_mm_refusal)
from vllm.model_executor.layers.fused_moe.modular_kernel import (BIAS_NAMES, GATED_ACTIVATIONS,
                                                                 MOE_ACTIVATIONS,
                                                                 MoEActivation, MoEExperts,
                                                                 MoEKernelQuery)
from vllm.model_executor.layers.fused_moe.torch_ref import expert_pairs_loop
from vllm.model_executor.layers.fused_moe.triton_experts import (TRITON_DTYPES, TRITON_SCHEMES,
                                                                 TritonExperts,
                                                                 triton_moe_refusal)

CPU_KERNEL_SCHEMES = ("unquantized", "fp8-tensor", "fp8-channel", "fp8-block", "w4a16-gptq",
                      "nvfp4", "mxfp4")
"""Schemes the C expert kernel runs: unquantized, and weight-only FP8 / INT4 / FP4 dequantized
inside its GEMM (vllm/kernels/cpu/qgemm.h, qgemm_fp4.h)."""

Dequantize = Callable[[dict[str, torch.Tensor], torch.dtype], tuple[torch.Tensor, torch.Tensor]]
"""One expert's tensors (row e of each), dtype -> (w13 [2N, K], w2 [K, N]) in that dtype."""


@dataclass(frozen=True)
class MoEBackend:
    name: str
    make: Callable[[MoEActivation, Dequantize | None], MoEExperts]
    """(activation, dequantize or None for unquantized) -> the layer's experts computation."""
    schemes: tuple[str, ...] | None = None
    """Schemes handled; None = every scheme."""
    platforms: tuple[str, ...] | None = None
    """Platform names; None = every platform."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """Activation dtypes; None = any."""
    activations: tuple[str, ...] = ("silu", "gelu")
    bias: bool = False
    """Adds expert biases (w13_bias, w2_bias) when the layer has them."""
    min_capability: int | None = None
    """Lowest compute capability as an SM number (90 = 9.0), where the platform has one."""
    max_capability: int | None = None
    needs_native_kernels: bool = False
    """The platform's compiled kernels must be loaded and take the dtype."""
    check: Callable[[MoEKernelQuery], str | None] | None = None
    """Further requirement (shapes, alignment): the reason it fails, or None."""
    auto: bool = True
    """False: "auto" never picks it (not yet run where it matters); only a forced name does."""

    def refusal(self, q: MoEKernelQuery) -> str | None:
        """Why this backend cannot run the query (the first requirement that fails), or None."""
        if self.schemes is not None and q.scheme not in self.schemes:
            return f"it handles schemes {list(self.schemes)}, not {q.scheme!r}"
        if self.platforms is not None and q.platform.name not in self.platforms:
            return f"it runs on {list(self.platforms)}, not {q.platform.name!r}"
        if self.dtypes is not None and q.dtype not in self.dtypes:
            return f"it takes dtypes {[str(d) for d in self.dtypes]}, not {q.dtype}"
        if q.activation not in self.activations:
            return f"it implements activations {list(self.activations)}, not {q.activation!r}"
        if q.has_bias and not self.bias:
            return "it does not add expert biases (w13_bias/w2_bias)"
        reason = self._capability_refusal(q)
        if reason is None and self.needs_native_kernels and \
                not q.platform.has_native_kernels(q.dtype):
            reason = (f"the {q.platform.name} kernels are not built or do not take {q.dtype} "
                      "(no C compiler, or VLLM_CPU_KERNELS=0)")
        if reason is None and self.check is not None:
            reason = self.check(q)
        return reason

    def _capability_refusal(self, q: MoEKernelQuery) -> str | None:
        cap = q.platform.get_device_capability()
        if cap is None:
            return None
        sm = cap.to_int()
        if self.min_capability is not None and sm < self.min_capability:
            return f"it needs SM >= {self.min_capability}, the device is SM {sm}"
        if self.max_capability is not None and sm > self.max_capability:
            return f"it needs SM <= {self.max_capability}, the device is SM {sm}"
        return None


_REGISTRY: BackendRegistry[MoEBackend] = BackendRegistry("MoE", "moe_backend")


def register_moe_backend(backend: MoEBackend) -> MoEBackend:
    return _REGISTRY.register(backend)


def moe_backend_names() -> tuple[str, ...]:
    return _REGISTRY.names()


def get_moe_backend(name: str) -> MoEBackend:
    return _REGISTRY.get(name)


def select_moe_backend(q: MoEKernelQuery, requested: str = "auto") -> MoEBackend:
    """The backend for ``q``: ``requested`` if it can run it (else ValueError with the reason and
    the backends that would), or for "auto" the first in the platform's order that can, among
    the backends with ``auto`` set."""
    return _REGISTRY.select(q, requested, q.platform.moe_backends)


# ---- built-in backends ---------------------------------------------------------------------
class CpuKernelExperts(MoEExperts):
    """The C kernel (``cpu_kernel.py``) over weights prepacked for its register tiles; for a
    quantized scheme (``bind_scheme``), over codes and scale tables packed by the method's
    ``cpu_kernel_layout()``, dequantized tile by tile inside the GEMM."""
    name = "cpu_kernel"
    cuda_graph_safe = True    # one C call over the ids (CPU graphs record it); never on CUDA

    def __init__(self, activation: MoEActivation):
        self.activation = activation
        self.qlayout: QuantLayout | None = None
        self._groups: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def bind_scheme(self, method) -> None:
        """Called once by the quant method after selection: a quantized scheme gives its layout."""
        if method.scheme != "unquantized":
            self.qlayout = method.cpu_kernel_layout()

    def pack(self, tensors):
        if self.qlayout is None:
            # Biases are read as loaded; only the weights take the GEMM's layout.
            return {n: t if n in BIAS_NAMES else prepack(t) for n, t in tensors.items()}
        w13 = tensors[self.qlayout.names["w13"]]
        one = w13.dim() == self.qlayout.expert_dims                 # one expert, or [E, ...]
        if self.qlayout.shared_groups:          # made here, never while a CPU graph captures
            self._shared_groups(w13.shape[-1], w13.shape[-2] // 2)
        if one:
            return pack_quantized(self.qlayout, tensors)
        per = [pack_quantized(self.qlayout, {n: t[e] for n, t in tensors.items()})
               for e in range(w13.shape[0])]
        return {n: torch.stack([p[n] for p in per]) for n in tensors}

    def _shared_groups(self, H: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8's group tables (row i in group i // block_in), the same for every expert."""
        if (H, N) not in self._groups:
            b = self.qlayout.block_in
            self._groups[H, N] = ((torch.arange(H, dtype=torch.int32) // (b or H)).repeat(2, 1),
                                  (torch.arange(N, dtype=torch.int32) // (b or N))[None])
        return self._groups[H, N]

    def apply_pairs(self, weights, x, topk_weights, ids, out, max_ids=None):
        biases = weights.get("w13_bias"), weights.get("w2_bias")
        if self.qlayout is None:
            expert_pairs_cpu(x, weights["w13_weight"], weights["w2_weight"], topk_weights, ids,
                             out, self.activation, *biases)
            return
        lay = self.qlayout
        w = {r: weights[n] for r, n in lay.names.items()}
        shared = None
        if lay.shared_groups:
            H = x.shape[-1]
            shared = self._shared_groups(H, w["w2"].shape[-1] // H)   # fp8: a byte a weight
        expert_pairs_cpu_quant(x, lay, w, shared, topk_weights, ids, out, self.activation,
                               *biases)


class GroupedMMExperts(MoEExperts):
    """``torch._grouped_mm`` over the loaded layout (``grouped_mm.py``)."""
    name = "grouped_mm"
    cuda_graph_safe = True    # sync-free: group offsets stay on the device

    def __init__(self, activation: MoEActivation):
        self.activation = activation

    def apply_pairs(self, weights, x, topk_weights, ids, out, max_ids=None):
        expert_pairs_grouped(x, weights["w13_weight"], weights["w2_weight"], topk_weights, ids,
                             out, self.activation, weights.get("w13_bias"),
                             weights.get("w2_bias"))


class TorchExperts(MoEExperts):
    """The per-expert loop reference (``torch_ref.py``); quantized rows are dequantized to the
    activation dtype first, reading only the rows ``ids`` name (slot rows when cached)."""
    name = "torch"
    mlp = None
    """What computes one expert (``expert_pairs_loop``'s ``mlp``); None: ``expert_mlp``."""

    def __init__(self, activation: MoEActivation, dequantize: Dequantize | None = None):
        self.activation, self.dequantize = activation, dequantize

    def apply_pairs(self, weights, x, topk_weights, ids, out, max_ids=None):
        biases = weights.get("w13_bias"), weights.get("w2_bias")
        rows = next(iter(weights.values())).shape[0]                  # E experts or N slots

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            if self.dequantize is None:
                return weights["w13_weight"][e], weights["w2_weight"][e]
            return self.dequantize({n: t[e] for n, t in weights.items()}, x.dtype)
        expert_pairs_loop(x, rows, expert, topk_weights, ids, out, self.activation, *biases,
                          mlp=self.mlp)


def _grouped_mm_check(q: MoEKernelQuery) -> str | None:
    return grouped_mm_refusal(q.hidden_size, q.intermediate_size, q.dtype, q.platform)


def _cpu_kernel_check(q: MoEKernelQuery) -> str | None:
    if q.scheme != "unquantized" and q.activation not in GATED_ACTIVATIONS:
        return (f"its quantized path runs gated activations only, not {q.activation!r} "
                "(the quantized layouts fuse gate and up)")
    return None


register_moe_backend(MoEBackend(
    "cpu_kernel", lambda act, deq: CpuKernelExperts(act), schemes=CPU_KERNEL_SCHEMES,
    platforms=("cpu",), dtypes=(torch.float32, torch.bfloat16), activations=MOE_ACTIVATIONS,
    bias=True, needs_native_kernels=True, check=_cpu_kernel_check))
register_moe_backend(MoEBackend(
    "grouped_mm", lambda act, deq: GroupedMMExperts(act), schemes=("unquantized",),
    platforms=("cpu", "cuda"), activations=MOE_ACTIVATIONS, bias=True, min_capability=90,
    check=_grouped_mm_check))
register_moe_backend(MoEBackend("torch", TorchExperts, activations=MOE_ACTIVATIONS, bias=True))
# Every platform by name: the check refuses all but CUDA, and CPU under TRITON_INTERPRET=1.
# A quantized scheme's layout reaches the kernels through ``TritonExperts.bind_scheme``.
register_moe_backend(MoEBackend(
    "triton", lambda act, deq: TritonExperts(act), schemes=TRITON_SCHEMES,
    dtypes=TRITON_DTYPES, activations=MOE_ACTIVATIONS, bias=True, check=triton_moe_refusal))
# Forced only (auto=False): never run on a GPU yet. ``make`` imports flashinfer; the registry
# reaches it only after selecting the backend on CUDA.
register_moe_backend(MoEBackend(
    "flashinfer_cutlass", lambda act, deq: FlashInferCutlassExperts(act),
    schemes=FLASHINFER_SCHEMES + tuple(UNMAPPED_SCHEMES), platforms=("cuda",),
    dtypes=FLASHINFER_DTYPES,
    activations=MOE_ACTIVATIONS, bias=True, check=flashinfer_cutlass_refusal, auto=False))
# Forced only (auto=False): the CUTLASS W4A16 backend has not passed on a GPU yet (its op has,
# on an H100). The quant method hands it the GPTQ layout through ``bind_scheme``; its
# ``pack`` repacks per expert.
register_moe_backend(MoEBackend(
    "cutlass_w4a16", lambda act, deq: CutlassW4A16Experts(act), schemes=("w4a16-gptq",),
    platforms=("cuda",), dtypes=(torch.bfloat16,), activations=GATED_ACTIVATIONS, bias=False,
    min_capability=90, max_capability=90, check=cutlass_w4a16_refusal, auto=False))

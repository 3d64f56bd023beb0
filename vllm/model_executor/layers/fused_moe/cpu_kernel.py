"""Expert computation with the C kernel in ``vllm/kernels/cpu/moe_experts.c`` (CPU only).

The kernel reads each expert's weights packed for its register tiles: input dim first, in
column blocks that are each one contiguous stream (``vllm/kernels/cpu/gemm.h``).
``vllm/kernels/cpu/ops.prepack`` makes that layout once per expert at load (the quant method's
``process_expert``), so the host store and the slots hold it too: w13 [E, 2N, K] -> [E, 2N*K],
w2 [E, K, N] -> [E, K*N]; expert biases (w13_bias [E, 2N], w2_bias [E, K]) stay as loaded.
Non-gated experts (``relu2_no_mul``) have N rows in w13 and w13_bias instead of 2N.
One call per layer (or per expert-cache wave): pairs are grouped by expert inside the kernel,
each expert's weights are read once per call, and each pair's value is independent of the other
pairs in the call (see the invariant in the C file), so cached and uncached runs agree bitwise.
Results differ from ``torch_ref`` by f32 summation order and, in bf16, by where values are
rounded to bf16 (the hidden activation once, the output once; tested within tolerance).
"""
from __future__ import annotations

import torch

from vllm.kernels.cpu.graph import launch
from vllm.kernels.cpu.ops import KERNEL_DTYPES as _DTYPES
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation

_ACTIVATIONS = {"silu": 0, "gelu": 1, "swigluoai": 2, "relu2_no_mul": 3}


def expert_pairs_cpu(x: torch.Tensor, w13p: torch.Tensor, w2p: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
                     activation: str | MoEActivation = "silu", b13: torch.Tensor | None = None,
                     b2: torch.Tensor | None = None) -> None:
    """The contract of ``torch_ref.expert_pairs_ref`` on packed weights: out[t, k] =
    w[t, k] * expert(x[t]) for pairs with 0 <= topk_ids < w13p.shape[0]; others untouched.
    x [T, K]; w13p [G, 2N*K] = prepack(w13); w2p [G, K*N] = prepack(w2); out [T, top_k, K];
    optional biases b13 [G, 2N], b2 [G, K] in x's dtype (w13p [G, N*K], b13 [G, N] for a
    non-gated activation)."""
    if torch.compiler.is_compiling():
        raise RuntimeError("the cpu_kernel MoE backend cannot be traced by torch.compile: "
                           "use moe_backend='grouped_mm' for compiled graphs")
    dtype = x.dtype
    if w13p.dtype != dtype or w2p.dtype != dtype or out.dtype != dtype or dtype not in _DTYPES:
        raise TypeError(f"expert_pairs_cpu: x, w13, w2 and out must share one dtype in "
                        f"{sorted(map(str, _DTYPES))}; got {x.dtype}, {w13p.dtype}, {w2p.dtype}, "
                        f"{out.dtype}")
    if not out.is_contiguous():
        raise ValueError("expert_pairs_cpu: out must be contiguous")
    act = MoEActivation.of(activation)
    H = x.shape[-1]
    G, rows = w13p.shape[0], w13p.shape[-1] // max(H, 1)        # rows: 2N gated, N not
    N = rows // 2 if act.gated else rows
    if w13p.dim() != 2 or rows * H != w13p.shape[1] or (act.gated and rows % 2) or \
            tuple(w2p.shape) != (G, H * N):
        want = "2N*K" if act.gated else "N*K"
        raise ValueError(f"expert_pairs_cpu: shapes x {tuple(x.shape)}, w13p {tuple(w13p.shape)}, "
                         f"w2p {tuple(w2p.shape)} do not match [T, K], [G, {want}], [G, K*N]")
    T, top_k = topk_ids.shape
    if x.shape[0] != T or topk_weights.shape != topk_ids.shape or tuple(out.shape) != (T, top_k, H):
        raise ValueError(f"expert_pairs_cpu: x {tuple(x.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}, out "
                         f"{tuple(out.shape)} do not match [T, K], [T, top_k], [T, top_k, K]")
    b13, b2 = (_bias(b, (G, n), dtype, name) for b, n, name in
               ((b13, rows, "b13"), (b2, H, "b2")))
    x, w13p, w2p = x.contiguous(), w13p.contiguous(), w2p.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    wts = topk_weights.to(torch.float32).contiguous()
    rc = launch(
        "moe_expert_pairs", x.data_ptr(), w13p.data_ptr(), w2p.data_ptr(), wts.data_ptr(),
        ids.data_ptr(),
        out.data_ptr(), T, top_k, G, H, N, _DTYPES[dtype], _ACTIVATIONS[act.name],
        None if b13 is None else b13.data_ptr(), None if b2 is None else b2.data_ptr(),
        act.alpha, act.limit)
    if rc:
        raise MemoryError("expert_pairs_cpu: the kernel could not allocate its scratch")


def _bias(b: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype,
          name: str) -> torch.Tensor | None:
    """A bias the kernel can read in place: contiguous [G, n] in the kernel's dtype."""
    if b is None:
        return None
    if tuple(b.shape) != shape or b.dtype != dtype:
        raise ValueError(f"expert_pairs_cpu: {name} is {tuple(b.shape)} {b.dtype}, must be "
                         f"{list(shape)} {dtype}")
    return b.contiguous()

"""What computes a cached layer's pairs on the CPU from the host store off a CPU device
(``moe_expert_cpu_compute``, ``host_compute.py``): the torch loop over the experts a step needs,
bf16 / f16 experts of a few tokens through ``kernels/cpu/gemv16.py`` (the store's rows read in
place at memory speed), and quantized experts (FP8, GPTQ INT4, NVFP4, MXFP4)
through the CPU's quantized matrix product on the scheme's own layout (``kernels/cpu/qgemv.py``),
which decodes each weight in registers instead of dequantizing the expert into a new tensor
first: 21-134x faster for one token (docs/benchmarks.md, "Quantized misses on the CPU")."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from vllm.kernels.cpu.exp12 import Exp12Rows, exp12_decode
from vllm.kernels.cpu.gemv16 import WEIGHT_TYPES, gemv16, gemv16_exp12
from vllm.kernels.cpu.qgemv import QuantRows, qgemv
from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import Exp12, decode
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEActivation, MoEExperts
from vllm.model_executor.layers.fused_moe.registry import TorchExperts
from vllm.model_executor.layers.fused_moe.torch_ref import expert_mlp, expert_pairs_loop
from vllm.platforms import native_kernels

QGEMV_MAX_TOKENS = 64
"""Experts with more tokens in a call (prefill misses) are dequantized once and run as one
matrix product: ``qgemv`` decodes the weights again for every 4 tokens (0.1-0.8 ms a token at
the probe and DeepSeek-V2-Lite shapes: 6-50 ms at 64 tokens, against the 13-152 ms of
dequantizing the expert, docs/benchmarks.md, "Quantized misses on the CPU"); past that,
dequantizing once is cheaper, and a prefill's misses are copied anyway."""

HostRows = Callable[[dict[str, torch.Tensor]], "tuple[QuantRows, QuantRows] | None"]


GEMV16_MAX_TOKENS = 4
"""bf16 / f16 experts with at most this many tokens in a call (one of ``gemv16.c``'s token
chunks) run ``gemv16``, which reads a probe-shaped expert 1.4-3.0x faster than two
``torch.mv`` at one token, and gate-up rows 1.3-1.5x faster than ``F.linear`` at one token and
about as fast at 4; from 8 tokens on ``F.linear`` is faster (docs/benchmarks.md, "Misses on
the CPU")."""


def _projections(x: torch.Tensor, w13, w2, activation: MoEActivation, b13, b2,
                 matmul: Callable) -> torch.Tensor:
    """The expert MLP through ``matmul(x, w) -> f32 [P, R]``, each projection's output rounded
    to x's dtype as a matrix product in that dtype would be."""
    gate_up = matmul(x, w13).to(x.dtype)
    if b13 is not None:
        gate_up = gate_up + b13
    y = matmul(activation(gate_up), w2).to(x.dtype)
    return y if b2 is None else y + b2


def _gemv16_any(x: torch.Tensor, w: torch.Tensor | Exp12Rows) -> torch.Tensor:
    return gemv16_exp12(x, w) if isinstance(w, Exp12Rows) else gemv16(x, w)


def _decoded(w: torch.Tensor | Exp12Rows, native: bool) -> torch.Tensor:
    """A projection as a bf16 tensor: exp12 planes decoded (in C where built, else the torch
    reference), any tensor as it is."""
    if not isinstance(w, Exp12Rows):
        return w
    if native:
        return exp12_decode(w)
    return decode(Exp12(*(p[None] for p in (w.lo, w.codes, w.base, w.esc_index, w.esc_bits)),
                        (1, *w.shape)))[0]


def host_expert_mlp(x: torch.Tensor, w13: torch.Tensor | QuantRows | Exp12Rows,
                    w2: torch.Tensor | QuantRows | Exp12Rows, activation: MoEActivation,
                    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    gemv: bool = False) -> torch.Tensor:
    """``expert_mlp`` for the CPU's pairs, x [P, K] -> [P, K]. Quantized projections
    (``QuantRows``) run ``qgemv``; with ``gemv`` (the CPU kernels are built) bf16 / f16
    experts with at most ``GEMV16_MAX_TOKENS`` tokens run ``gemv16`` (both: f32 sums, each
    projection rounded once to x's dtype), exp12 planes (``Exp12Rows``, link compression)
    ``gemv16_exp12`` with gemv16's bits; else planes are decoded first, and one token runs as
    two matrix-vector products and more tokens as ``expert_mlp``."""
    if isinstance(w13, QuantRows):
        return _projections(x, w13, w2, activation, b13, b2, qgemv)
    if gemv and x.shape[0] <= GEMV16_MAX_TOKENS and w13.dtype in WEIGHT_TYPES and \
            w2.dtype in WEIGHT_TYPES:                  # Exp12Rows are bf16
        return _projections(x, w13, w2, activation, b13, b2, _gemv16_any)
    w13, w2 = _decoded(w13, gemv), _decoded(w2, gemv)
    if x.shape[0] != 1:
        return expert_mlp(x, w13, w2, activation, b13, b2)
    gate_up = torch.mv(w13, x[0])
    if b13 is not None:
        gate_up = gate_up + b13
    y = torch.mv(w2, activation(gate_up[None])[0])
    return (y if b2 is None else y + b2)[None]


class HostExperts(TorchExperts):
    """The torch loop (``TorchExperts``) with ``host_expert_mlp``: what computes misses on the
    CPU off a CPU device. ``rows``: the quant method's ``host_rows`` where the CPU kernels are
    built (else None): an expert it gives a view of runs ``qgemv`` on its codes while it has at
    most ``QGEMV_MAX_TOKENS`` tokens in the call; any other is dequantized first."""
    name = "torch_host"

    def __init__(self, activation: MoEActivation, dequantize=None,
                 rows: HostRows | None = None, gemv: bool = False):
        super().__init__(activation, dequantize)
        self.rows = rows
        self.mlp = partial(host_expert_mlp, gemv=gemv)

    def apply_pairs(self, weights, x, topk_weights, ids, out, max_ids=None):
        if self.rows is None or self.dequantize is None:
            return super().apply_pairs(weights, x, topk_weights, ids, out, max_ids)
        num_rows = next(iter(weights.values())).shape[0]
        flat = ids.reshape(-1)
        tokens = torch.bincount(flat[(flat >= 0) & (flat < num_rows)], minlength=num_rows)

        def expert(e: int):
            t = {n: w[e] for n, w in weights.items()}
            view = self.rows(t) if int(tokens[e]) <= QGEMV_MAX_TOKENS else None
            return view if view is not None else self.dequantize(t, x.dtype)
        expert_pairs_loop(x, num_rows, expert, topk_weights, ids, out, self.activation,
                          weights.get("w13_bias"), weights.get("w2_bias"), mlp=self.mlp)


def host_experts(quant_method, device: torch.device, planes: bool = False) -> MoEExperts:
    """What computes a layer's pairs on the CPU, from the host store (the layout of the layer's
    device backend): on a CPU device the layer's own backend; elsewhere, or where the store is
    exp12 ``planes`` (which only ``HostExperts`` reads), ``HostExperts``, which reads the
    scheme's layout, so only behind a backend that keeps it (no ``pack`` of its own).
    ValueError with the reason."""
    kernel = quant_method.kernel
    if device.type == "cpu" and not planes:
        return kernel
    if type(kernel).pack is not MoEExperts.pack:
        raise ValueError(f"moe_expert_cpu_compute: the {kernel.name!r} MoE backend keeps the "
                         "experts in a layout of its own, which the CPU cannot compute from; "
                         "use a backend that reads the scheme's layout (triton, grouped_mm, "
                         "torch) or moe_expert_cpu_compute='off'")
    built = native_kernels(torch.float32, torch.device("cpu"))
    return HostExperts(quant_method.activation, quant_method.dequantizer(),
                       quant_method.host_rows if built else None, gemv=built)

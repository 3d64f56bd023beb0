"""The "triton" MoE expert backend: the Triton fused-MoE kernels behind the ``MoEExperts`` pair
contract, over unquantized experts (``vllm/kernels/triton/fused_moe.py``) and weight-only
quantized ones (``fused_moe_quant.py``: FP8 e4m3 with tensor / channel / block scales, GPTQ
INT4 with g_idx, act order included; ``fused_moe_fp4.py``: NVFP4 with e4m3 block scales and
per-expert global scales, MXFP4 with e8m0 block scales), dequantized in registers right before
each ``tl.dot``. FP8 experts whose checkpoint declares FP8 activations (``input_quant``) run
W8A8 (``fused_moe_w8a8.py``: inputs quantized per row, e4m3 x e4m3 dots) where
``Platform.has_fp8_matmul`` (CUDA SM 8.9+), weight-only elsewhere; decided once per device at
the first call, a refusal (unaligned scale widths, no positive static scale) logged once.

It reads the loaded layout as is (no ``pack``): unquantized w13 [G, 2N, H] or [G, N, H]
non-gated, w2 [G, H, N]; a quantized scheme's expert tensors under the method's names (fp8.py,
gptq.py, nvfp4.py, mxfp4.py), which ``bind_scheme`` maps onto ``QuantProjection``s or
``Fp4Projection``s (views: MXFP4's [G, R, C/32, 16] blocks as the [G, R, C/2] bytes they are);
the optional biases. It writes the pairs of each wave straight into the layer's ``out``
[T, K, H]; the ids are expert ids, or the expert cache's slot ids, and every scale, global
scale, zero point and g_idx is read at the same id as its codes (the kernels never know which).
Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check it).
Run on an H100 (2026-11-26): bf16, fp8-block and w4a16-gptq experts in the benchmarks (its
kernels' gpu tests: tests/kernels/triton). Also interpreted, and compiled (SM90/SM120) by
tests/build; block sizes untuned. FP8 needs SM 8.9 or newer (refused below it).
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from vllm.kernels.triton import triton_refusal
from vllm.logger import init_logger, log_once
from vllm.model_executor.layers.fused_moe.modular_kernel import (GATED_ACTIVATIONS,
                                                                 MoEActivation, MoEExperts,
                                                                 MoEKernelQuery)
from vllm.platforms import platform_for

logger = init_logger(__name__)

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_SCHEMES = ("unquantized", "fp8-tensor", "fp8-channel", "fp8-block", "w4a16-gptq",
                  "nvfp4", "mxfp4")
"""Schemes the Triton kernels run: unquantized, and weight-only FP8 / GPTQ INT4 / FP4 (FP8 also
W8A8 where the checkpoint declares FP8 activations and the platform multiplies e4m3)."""
FP4_KINDS = ("nvfp4", "mxfp4")
"""TritonExperts.kind values run by ``fused_moe_fp4`` (the others by ``fused_moe_quant``)."""
Projections = Callable[[dict[str, torch.Tensor]], tuple[dict, dict]]
"""Expert tensors by name ([G, ...]) -> (w13, w2) keyword arguments of ``QuantProjection``
(or ``Fp4Projection`` for the FP4 kinds)."""


def triton_moe_refusal(q: MoEKernelQuery) -> str | None:
    """The registry's extra check: a Triton kernel must be able to run on the platform's
    tensors (CUDA, or CPU under the interpreter), bf16 products need SM 8.0, FP8 codes SM 8.9,
    and the quantized layouts fuse gate and up (gated activations only)."""
    reason = triton_refusal(q.platform.device_type)
    if reason is not None:
        return reason
    cap = q.platform.get_device_capability()
    if cap is not None and q.dtype == torch.bfloat16 and cap.to_int() < 80:
        return f"bfloat16 tl.dot needs SM >= 80, the device is SM {cap.to_int()}"
    if cap is not None and q.scheme.startswith("fp8") and cap.to_int() < 89:
        # Triton's e4m3 (fp8e4nv) conversions lower to cvt.*.e4m3x2, which SM 8.9 introduced.
        return f"FP8 e4m3 weights need SM >= 89, the device is SM {cap.to_int()}"
    if q.scheme != "unquantized" and q.activation not in GATED_ACTIVATIONS:
        return (f"its quantized path runs gated activations only, not {q.activation!r} "
                "(the quantized layouts fuse gate and up)")
    return None


def fp8_projections(method) -> Projections:
    """fp8.py's layout: w13_weight e4m3 [G, 2N, H], w2_weight [G, H, N]; scales (float32,
    ``method.scale_name``) tensor w13 [G, 2] (gate, up) / w2 [G, 1], channel [G, 2N, 1] /
    [G, H, 1], block [G, 2 * ceil(N/bo), ceil(H/bi)] (gate block rows, then up) /
    [G, ceil(H/bo), ceil(N/bi)]."""
    s, strategy = method.scale_name, method.strategy

    def projections(t):
        w13, w2, s13, s2 = t["w13_weight"], t["w2_weight"], t[f"w13_{s}"], t[f"w2_{s}"]
        N, H = w13.shape[1] // 2, w13.shape[2]
        if strategy == "tensor":          # one scale per half: block_out spans the half
            return (dict(codes=w13, scales=s13.unsqueeze(-1), half_rows=N, block_out=N,
                         block_in=H),
                    dict(codes=w2, scales=s2.unsqueeze(-1), half_rows=H, block_out=H,
                         block_in=N))
        if strategy == "channel":         # one scale per output row
            return (dict(codes=w13, scales=s13, half_rows=2 * N, block_in=H),
                    dict(codes=w2, scales=s2, half_rows=H, block_in=N))
        bo, bi = method.block
        return (dict(codes=w13, scales=s13, half_rows=N, rows_per_half=s13.shape[1] // 2,
                     block_out=bo, block_in=bi),
                dict(codes=w2, scales=s2, half_rows=H, block_out=bo, block_in=bi))
    return projections


def gptq_projections(method) -> Projections:
    """gptq.py's layout: w13_qweight int32 [G, 2N, H/8], w13_qzeros [G, 2N/8, G13], w13_scales
    [G, 2N, G13], w13_g_idx [G, 2, H] (gate, up); w2_* likewise with g_idx [G, 1, N]; zero
    points plus the format's offset (``method.zero_offset``)."""
    # By name: quantization/ imports this package's registry, so importing gptq here would
    # close an import cycle.
    if type(method).unpacked_weight.__qualname__ != "GptqMoEMethod.unpacked_weight":
        raise ValueError(f"{type(method).__name__} repacks its int4 codes "
                         "(unpacked_weight): the triton backend reads GPTQ's packing only; "
                         "use moe_backend='torch'")

    def projections(t):
        out = []
        for p in ("w13", "w2"):
            codes, g_idx = t[f"{p}_qweight"], t[f"{p}_g_idx"]
            # Every loaded expert's g_idx is contiguous groups (checked at load, so for every
            # slot too): one group per K tile, no g_idx read.
            contiguous = method.contiguous_groups.get(p, False)
            out.append(dict(codes=codes, scales=t[f"{p}_scales"], zeros=t[f"{p}_qzeros"],
                            g_idx=g_idx, zero_offset=method.zero_offset,
                            half_rows=codes.shape[1] // g_idx.shape[1],
                            group_size=method.group_width(g_idx.shape[2]) if contiguous else 0))
        return out[0], out[1]
    return projections


def nvfp4_projections(method) -> Projections:
    """nvfp4.py's layout (ModelOpt; compressed-tensors nvfp4-pack-quantized maps onto it):
    w13_weight uint8 [G, 2N, H/2], w13_weight_scale e4m3 [G, 2N, H/16], w13_weight_scale_2
    float32 [G, 2] (gate, up); w2_* [G, H, N/2], [G, H, N/16], [G, 1]."""
    def projections(t):
        return tuple(dict(codes=t[f"{p}_weight"], scales=t[f"{p}_weight_scale"],
                          global_scales=t[f"{p}_weight_scale_2"]) for p in ("w13", "w2"))
    return projections


def mxfp4_projections(method) -> Projections:
    """mxfp4.py's layout (GPT-OSS): w13_blocks uint8 [G, 2N, H/32, 16] (input 32 b + 2 j in the
    low nibble of byte j of block b: byte (32 b + 2 j) // 2 of the row), w13_scales e8m0
    [G, 2N, H/32]; w2_* [G, H, N/32, 16], [G, H, N/32]."""
    def projections(t):
        out = []
        for p in ("w13", "w2"):
            blocks = t[f"{p}_blocks"]
            # A view (raises rather than copies if the blocks were ever non-contiguous).
            out.append(dict(codes=blocks.view(*blocks.shape[:2], -1), scales=t[f"{p}_scales"]))
        return out[0], out[1]
    return projections


class TritonExperts(MoEExperts):
    """``fused_moe_pairs`` (unquantized) or ``fused_moe_quant_pairs`` / ``fused_moe_fp4_pairs``
    (after ``bind_scheme``) over the layer's tensors (no repacking)."""
    name = "triton"
    cuda_graph_safe = True    # grids fixed by [T, top_k], G and max_ids; no host read

    def __init__(self, activation: MoEActivation):
        self.activation = activation
        self._device_names: dict[torch.device, str] = {}
        self.kind: str | None = None
        """None (unquantized), "fp8", "int4", "nvfp4" or "mxfp4"."""
        self._projections: Projections | None = None
        self.quantize_inputs: bool | None = None
        """FP8 experts of a checkpoint that declares FP8 activations: W8A8 (True), weight-only
        (False), or None: W8A8 where ``Platform.has_fp8_matmul`` (tests force it on CPU)."""
        self._inputs: tuple[str, int] | None = None
        """(input_quant, input_group) an FP8 method declares (vllm/config/quantization.py)."""
        self._static: tuple[torch.Tensor, torch.Tensor] | None = None
        """Static input scales [1] of w13 and w2 on the device (input_quant "tensor")."""
        self._w8a8: dict[torch.device, tuple | None] = {}
        """Per device: the two ``InputQuant``s of a W8A8 call, or None (weight-only)."""

    def bind_scheme(self, method) -> None:
        """Called once by the quant method after selection: a quantized scheme's layout."""
        if method.scheme.startswith("fp8-"):
            self.kind, self._projections = "fp8", fp8_projections(method)
            if getattr(method, "input_quant", None) is not None:
                self._inputs = (method.input_quant, method.input_group)
        elif method.scheme == "w4a16-gptq":
            self.kind, self._projections = "int4", gptq_projections(method)
        elif method.scheme == "nvfp4":
            self.kind, self._projections = "nvfp4", nvfp4_projections(method)
        elif method.scheme == "mxfp4":
            self.kind, self._projections = "mxfp4", mxfp4_projections(method)

    def bind_shared(self, shared: dict[str, torch.Tensor]) -> None:
        """The layer's shared tensors after loading: the static input scales (0-d, max over
        experts) a checkpoint declares; one host read per layer, at load time."""
        if self._inputs is None or self._inputs[0] != "tensor":
            return
        scales = [shared.get(n) for n in ("w13_input_scale", "w2_input_scale")]
        if all(t is not None and float(t) > 0 for t in scales):
            self._static = tuple(t.detach().float().reshape(1) for t in scales)

    def _input_quants(self, w13, w2, device: torch.device) -> tuple | None:
        """This device's ``InputQuant``s of w13 and w2 for a W8A8 call, or None: weight-only
        (decided at the first call on the device)."""
        if self._inputs is None:
            return None
        if device not in self._w8a8:
            self._w8a8[device] = self._decide_w8a8(w13, w2, device)
        return self._w8a8[device]

    def _decide_w8a8(self, w13, w2, device: torch.device) -> tuple | None:
        want = self.quantize_inputs
        if want is None:
            want = platform_for(device).has_fp8_matmul(device)
        if not want:
            return None
        from vllm.kernels.triton.fused_moe_w8a8 import InputQuant, w8a8_refusal
        kind, group = self._inputs
        if kind == "tensor" and self._static is None:
            quants, reason = None, "the checkpoint's static input_scale is missing or not positive"
        else:
            s13, s2 = self._static or (None, None)
            quants = (InputQuant(kind, group, s13), InputQuant(kind, group, s2))
            reason = w8a8_refusal(w13, w2, *quants)
        if reason is None:
            what = {"token": "per token", "group": f"per token and {group} columns",
                    "tensor": "static per tensor"}[kind]
            log_once(logger, logging.INFO, f"triton MoE: FP8 experts run W8A8 on {device}, "
                     f"activations quantized to e4m3 {what} as the checkpoint declares")
            return quants
        log_once(logger, logging.WARNING, "triton MoE: FP8 experts run weight-only (W8A16), not "
                 f"with the checkpoint's FP8 activations: {reason}")
        return None

    def quantizes_inputs(self, device: torch.device) -> bool | None:
        """Whether calls on ``device`` run W8A8; None before the first call decides. A device
        without an index (the runner's ``cuda``) matches the calls' (``cuda:0``): asked with
        ``cuda``, the H100 run's W8A8 rows were labelled weight-only."""
        if self._inputs is None:
            return False
        device = torch.device(device)
        decided = [q for d, q in self._w8a8.items()
                   if d == device or (device.index is None and d.type == device.type)]
        return None if not decided else decided[0] is not None

    def _device_name(self, device: torch.device) -> str:
        """The name the block-size tables are keyed by (asked of the platform once)."""
        if device not in self._device_names:
            self._device_names[device] = platform_for(device).device_name(device)
        return self._device_names[device]

    def apply_pairs(self, weights, x, topk_weights, ids, out, max_ids=None):
        # Imported here: triton is optional, and the registry module imports this one.
        act = self.activation
        biases = weights.get("w13_bias"), weights.get("w2_bias")
        name = self._device_name(x.device)
        if self._projections is None:
            from vllm.kernels.triton.fused_moe import fused_moe_pairs
            fused_moe_pairs(x, weights["w13_weight"], weights["w2_weight"], topk_weights, ids,
                            out, act.name, act.alpha, act.limit, *biases, device_name=name,
                            max_ids=max_ids)
            return
        if self.kind in FP4_KINDS:
            from vllm.kernels.triton.fused_moe_fp4 import Fp4Projection, fused_moe_fp4_pairs
            w13, w2 = (Fp4Projection(self.kind, **p) for p in self._projections(weights))
            fused_moe_fp4_pairs(x, w13, w2, topk_weights, ids, out, act.name, act.alpha,
                                act.limit, *biases, device_name=name, max_ids=max_ids)
            return
        from vllm.kernels.triton.fused_moe_quant import QuantProjection, fused_moe_quant_pairs
        w13, w2 = (QuantProjection(self.kind, **p) for p in self._projections(weights))
        quants = self._input_quants(w13, w2, x.device)
        if quants is not None:
            from vllm.kernels.triton.fused_moe_w8a8 import W8A8Projection, fused_moe_w8a8_pairs
            fused_moe_w8a8_pairs(x, W8A8Projection(w13, quants[0]), W8A8Projection(w2, quants[1]),
                                 topk_weights, ids, out, act.name, act.alpha, act.limit,
                                 *biases, device_name=name, max_ids=max_ids)
            return
        fused_moe_quant_pairs(x, w13, w2, topk_weights, ids, out, act.name, act.alpha,
                              act.limit, *biases, device_name=name, max_ids=max_ids)

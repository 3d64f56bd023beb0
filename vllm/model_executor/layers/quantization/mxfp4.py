"""MXFP4 experts (OCP microscaling FP4, as OpenAI publishes GPT-OSS), computed weight-only here.

Published checkpoint tensors per MoE layer (``quantization_config`` {"quant_method": "mxfp4"}),
all experts fused, rows = output features:
  gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]  e2m1 pairs: input 2j of a 32-block in the low
                                                nibble of byte j, 2j + 1 in the high nibble
  gate_up_proj_scales  uint8 [E, 2I, H/32]      e8m0: the block's scale is 2^(s - 127)
  down_proj_blocks     uint8 [E, H, I/32, 16], down_proj_scales uint8 [E, H, I/32]
  (biases stay in bf16: ``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, H])
weight[o, 32 b + i] = e2m1(blocks[o, b])[i] * 2^(scales[o, b] - 127). This is what transformers'
reader (``integrations/mxfp4.py``, ``convert_moe_packed_tensors``) computes; the tests compare
with it. GPT-OSS's gate_up rows interleave gate and up (row 2j gate j, 2j + 1 up j): the model
file de-interleaves them into per-expert gate/up shards before they reach this method.

Layer layout (rows kept packed as published, one expert per leading index): w13_blocks
[E, 2N, K/32, 16] and w13_scales [E, 2N, K/32] (gate rows, then up rows), w2_blocks
[E, K, N/32, 16] and w2_scales [E, K, N/32]. All four are expert-indexed, so the expert cache's
slots hold them packed; the ``torch`` backend dequantizes the rows it needs per expert. The C
kernel (``cpu_kernel``, the CPU default) packs each expert once at load into its own layout
(still 4-bit codes and e8m0 bytes) and dequantizes inside its GEMM.
"""
from __future__ import annotations

import torch

from vllm.kernels.cpu.qgemv import QuantRows
from vllm.model_executor.layers.quantization.base import MoEShape
from vllm.model_executor.layers.quantization.moe_ref import (CheckpointTensor,
                                                             QuantizedFusedMoEMethod, TensorSpec,
                                                             check_dtype, require_multiple)
from vllm.model_executor.layers.quantization.utils import e2m1_to_float, unpack_e2m1

MXFP4_BLOCK = 32
"""Inputs per shared scale (16 bytes of packed codes)."""


# e8m0 code -> 2^(s - 127) in float32, exactly (2^-127 is subnormal, 254 gives 2^127; the
# format's 255 is NaN). Made once: dequantization runs per expert row on every use.
_E8M0 = torch.tensor([2.0 ** (s - 127) for s in range(255)] + [float("nan")],
                     dtype=torch.float32)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 exponents -> float32 powers of two, same shape."""
    table = _E8M0 if scales.device == _E8M0.device else _E8M0.to(scales.device)
    return table[scales.long()]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [R, C/32, 16], scales uint8 [R, C/32] -> float32 [R, C]."""
    rows = blocks.shape[0]
    vals = e2m1_to_float(unpack_e2m1(blocks.reshape(rows, -1)))           # [R, C]
    return vals * e8m0_to_float(scales).repeat_interleave(MXFP4_BLOCK, dim=1)


class Mxfp4MoEMethod(QuantizedFusedMoEMethod):
    scheme = "mxfp4"
    checkpoint_tensors = (CheckpointTensor("blocks"), CheckpointTensor("scales"))

    def layout(self, shape: MoEShape) -> dict[str, TensorSpec]:
        K, N = shape.hidden_size, shape.intermediate_size
        for what, v in (("hidden_size", K), ("moe intermediate_size", N)):
            require_multiple(what, v, MXFP4_BLOCK, "mxfp4")
        u8, b = torch.uint8, MXFP4_BLOCK
        return {"w13_blocks": TensorSpec((2 * N, K // b, b // 2), u8),
                "w13_scales": TensorSpec((2 * N, K // b), u8),
                "w2_blocks": TensorSpec((K, N // b, b // 2), u8),
                "w2_scales": TensorSpec((K, N // b), u8)}

    def load_transform(self, suffix: str, proj: str, tensor: torch.Tensor) -> torch.Tensor:
        check_dtype(suffix, tensor, torch.uint8)
        return tensor

    def dequantize(self, t, dtype):
        w13 = dequantize_mxfp4(t["w13_blocks"], t["w13_scales"])
        w2 = dequantize_mxfp4(t["w2_blocks"], t["w2_scales"])
        return w13.to(dtype), w2.to(dtype)

    def host_rows(self, t):
        """The blocks as [rows, C / 2] code bytes and the e8m0 scale bytes, as they are."""
        return tuple(QuantRows("fp4", t[f"{p}_blocks"].reshape(t[f"{p}_blocks"].shape[0], -1),
                               t[f"{p}_scales"], 1, MXFP4_BLOCK) for p in ("w13", "w2"))

    def cpu_kernel_layout(self):
        """The C expert kernel's view of these tensors (fused_moe/cpu_kernel.py, qgemm_fp4.h):
        e2m1 codes and the e8m0 scales as [groups, columns] bytes (global scale 1)."""
        from vllm.model_executor.layers.fused_moe.cpu_kernel import QuantLayout
        return QuantLayout("mxfp4", {"w13": "w13_blocks", "w2": "w2_blocks", "s13": "w13_scales",
                                     "s2": "w2_scales"}, self._kernel_tensors, expert_dims=3)

    @staticmethod
    def _kernel_tensors(t):
        out = {}
        for p in ("w13", "w2"):
            blocks = t[f"{p}_blocks"]
            out[p] = unpack_e2m1(blocks.reshape(blocks.shape[0], -1))       # [rows, C]
            out[f"s{p[1:]}"] = t[f"{p}_scales"].t()                         # [C/32, rows]
        return out

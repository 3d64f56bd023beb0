"""NVFP4 experts (NVIDIA ModelOpt unified checkpoint layout), computed weight-only here.

Checkpoint tensors per expert projection (out x in, in a multiple of 16):
  weight          uint8 [out, in/2]           e2m1 pairs, element 2i in the low nibble
  weight_scale    float8_e4m3fn [out, in/16]  one scale per 16 consecutive inputs
  weight_scale_2  float32 [] or [1]           per-tensor global scale
  input_scale     float32 []                  activation global scale (shared; kept, unused by
                                              this weight-only reference: activations stay in
                                              the model dtype)
weight[o, i] = e2m1(weight)[o, i] * float(weight_scale[o, i // 16]) * weight_scale_2.

Layer layout: w13_weight [E, 2N, K/2], w13_weight_scale [E, 2N, K/16], w13_weight_scale_2 [E, 2]
(gate, up: one global scale per expert and projection, so it is expert-indexed and moves with
the expert), w2_weight [E, K, N/2], w2_weight_scale [E, K, N/16], w2_weight_scale_2 [E, 1].
The C kernel (``cpu_kernel``, the CPU default) packs each expert once at load into its own
layout (still 4-bit codes, e4m3 scale bytes, these global scales) and dequantizes inside its GEMM.
"""
from __future__ import annotations

import torch

from vllm.kernels.cpu.qgemv import QuantRows
from vllm.model_executor.layers.quantization.base import MoEShape
from vllm.model_executor.layers.quantization.moe_ref import (CheckpointTensor,
                                                             QuantizedFusedMoEMethod, TensorSpec,
                                                             check_dtype, require_multiple,
                                                             scalar_to)
from vllm.model_executor.layers.quantization.utils import (FP4_E2M1_MAX, FP8_E4M3_MAX,
                                                           e2m1_to_float, float_to_e2m1,
                                                           pack_e2m1, to_e4m3, unpack_e2m1)

NVFP4_GROUP = 16


class Nvfp4MoEMethod(QuantizedFusedMoEMethod):
    scheme = "nvfp4"
    checkpoint_tensors = (CheckpointTensor("weight"), CheckpointTensor("weight_scale"),
                          CheckpointTensor("weight_scale_2"),
                          CheckpointTensor("input_scale", required=False, shared=True))

    def layout(self, shape: MoEShape) -> dict[str, TensorSpec]:
        K, N = shape.hidden_size, shape.intermediate_size
        for what, v in (("hidden_size", K), ("moe intermediate_size", N)):
            require_multiple(what, v, NVFP4_GROUP, "nvfp4")
        u8, f8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
        return {"w13_weight": TensorSpec((2 * N, K // 2), u8),
                "w13_weight_scale": TensorSpec((2 * N, K // NVFP4_GROUP), f8),
                "w13_weight_scale_2": TensorSpec((2,), f32),
                "w2_weight": TensorSpec((K, N // 2), u8),
                "w2_weight_scale": TensorSpec((K, N // NVFP4_GROUP), f8),
                "w2_weight_scale_2": TensorSpec((1,), f32)}

    def load_transform(self, suffix: str, proj: str, tensor: torch.Tensor) -> torch.Tensor:
        allowed = {"weight": (torch.uint8,), "weight_scale": (torch.float8_e4m3fn,),
                   "weight_scale_2": (torch.float32, torch.bfloat16, torch.float16)}[suffix]
        check_dtype(suffix, tensor, *allowed)
        return scalar_to(tensor, (1,)) if suffix == "weight_scale_2" else tensor

    @staticmethod
    def _dequant(packed, scale, global_scales) -> torch.Tensor:
        """packed [R, C/2], scale [R, C/16], global_scales [H] for H equal row halves -> [R, C]."""
        vals = e2m1_to_float(unpack_e2m1(packed))                        # [R, C]
        s = scale.float().repeat_interleave(NVFP4_GROUP, dim=1)          # [R, C]
        rows_per = vals.shape[0] // global_scales.shape[0]
        g = global_scales.float().repeat_interleave(rows_per).unsqueeze(1)   # [R, 1]
        return vals * (s * g)

    def dequantize(self, t, dtype):
        w13 = self._dequant(t["w13_weight"], t["w13_weight_scale"], t["w13_weight_scale_2"])
        w2 = self._dequant(t["w2_weight"], t["w2_weight_scale"], t["w2_weight_scale_2"])
        return w13.to(dtype), w2.to(dtype)

    def cpu_kernel_layout(self):
        """The C expert kernel's view of these tensors (fused_moe/cpu_kernel.py, qgemm_fp4.h):
        e2m1 codes, the e4m3 scales as [groups, columns] bytes, the global scales as loaded
        (the kernel computes ``_dequant``'s vals * (scale * global) in f32)."""
        from vllm.model_executor.layers.fused_moe.cpu_kernel import QuantLayout
        return QuantLayout("nvfp4", {"w13": "w13_weight", "w2": "w2_weight",
                                     "s13": "w13_weight_scale", "s2": "w2_weight_scale",
                                     "gs13": "w13_weight_scale_2", "gs2": "w2_weight_scale_2"},
                           self._kernel_tensors)

    def host_rows(self, t):
        """The codes, e4m3 block scales and per-half global scales as they are."""
        w13, w2 = t["w13_weight"], t["w2_weight"]
        return (QuantRows("fp4", w13, t["w13_weight_scale"], 1, NVFP4_GROUP,
                          global_scales=t["w13_weight_scale_2"].float().contiguous()),
                QuantRows("fp4", w2, t["w2_weight_scale"], 1, NVFP4_GROUP,
                          global_scales=t["w2_weight_scale_2"].float().contiguous()))

    @staticmethod
    def _kernel_tensors(t):
        return {"w13": unpack_e2m1(t["w13_weight"]), "w2": unpack_e2m1(t["w2_weight"]),
                "s13": t["w13_weight_scale"].t(), "s2": t["w2_weight_scale"].t(),
                "gs13": t["w13_weight_scale_2"], "gs2": t["w2_weight_scale_2"]}


# ---- offline quantizer ------------------------------------------------------------------------
def quantize_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Round-to-nearest NVFP4 of one weight [out, in] -> {weight, weight_scale, weight_scale_2}.
    The global scale maps the largest block scale to e4m3's top (amax / (6 * 448))."""
    w = w.float()
    out, inp = w.shape
    require_multiple("in_features", inp, NVFP4_GROUP, "nvfp4")
    global_scale = (w.abs().amax() / (FP4_E2M1_MAX * FP8_E4M3_MAX)).clamp(min=1e-12)
    blocks = w.reshape(out, inp // NVFP4_GROUP, NVFP4_GROUP)
    block_scale = to_e4m3(blocks.abs().amax(-1) / FP4_E2M1_MAX / global_scale)   # [out, in/16]
    denom = (block_scale.float() * global_scale).clamp(min=1e-30).unsqueeze(-1)
    codes = float_to_e2m1((blocks / denom).reshape(out, inp))
    return {"weight": pack_e2m1(codes), "weight_scale": block_scale,
            "weight_scale_2": global_scale.reshape(()).clone()}

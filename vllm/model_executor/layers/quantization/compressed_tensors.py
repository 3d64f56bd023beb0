"""compressed-tensors (llm-compressor) packed formats, mapped at load time onto the layer layouts
of existing schemes, so every backend of that scheme (and the expert cache) reads them unchanged.
FP8 ("float-quantized") needs no mapping: ``Fp8MoEMethod`` reads it with ``weight_scale``.

``pack-quantized`` INT4 (W4A16, strategy group or channel) -> ``w4a16-gptq``'s layout. Per expert
projection (out x in, G = in / group_size, or 1 for channel):
  weight_packed      int32 [out, in/8]  value u = q + 8 (q in [-8, 7]), element 8i + k at bits
                                        [4k, 4k + 4) of word i: already the layer's output-major
                                        ``qweight``, so no transpose (GPTQ stores [in/8, out])
  weight_scale       [out, G] in the model dtype -> ``scales`` (cast to float16, the gptq layout:
                                        exact for bf16/fp16 scales >= 2^-17; fp32 scales round)
  weight_zero_point  int32 [out/8, G]   (asymmetric only) zero z + 8 packed along out, the same
                                        packing as the layer's ``qzeros``
  weight_g_idx       int32 [in]         (optional; actorder "group" checkpoints of
                                        compressed-tensors < 0.12)
  weight_shape       int [2]            (out, in): checked, not stored
weight = (u - 8 - (zu - 8)) * scale = (u - zu) * scale: the gptq formula with zero offset 0 (as
gptq_v2) and, for symmetric checkpoints (no zero point stored), every zero 8 (0x88888888 words).

``nvfp4-pack-quantized`` -> ``nvfp4``'s layout:
  weight_packed        uint8 [out, in/2]        -> ``weight`` (same e2m1 packing, low nibble first)
  weight_scale         float8_e4m3fn [out, in/16]
  weight_global_scale  float32 [1]              -> ``weight_scale_2`` = 1 / weight_global_scale:
                       compressed-tensors divides (weight = fp4 * weight_scale / global_scale,
                       global_scale = 448 * 6 / amax), ModelOpt multiplies (weight_scale_2 =
                       amax / (6 * 448)). The float32 reciprocal is within 1 ulp.
  input_global_scale   float32 [1] (W4A4 only)  -> the shared ``input_scale`` (reciprocal, max)
"""
from __future__ import annotations

import torch

from vllm.model_executor.layers.quantization.gptq import GptqMoEMethod
from vllm.model_executor.layers.quantization.moe_ref import CheckpointTensor, TensorSpec
from vllm.model_executor.layers.quantization.nvfp4 import Nvfp4MoEMethod

# Eight zero points of 8 in one int32 word (0x88888888 as two's complement).
_ZEROS_OF_8 = 0x88888888 - 2 ** 32


def _layer_suffix(method, suffix: str) -> str:
    """Checkpoint suffix -> the mapped scheme's suffix, as ``checkpoint_tensors`` declares."""
    return next(c.name for c in method.checkpoint_tensors if c.suffix == suffix)


class CompressedTensorsW4A16MoEMethod(GptqMoEMethod):
    """pack-quantized INT4 experts in the ``w4a16-gptq`` layer layout (scheme w4a16-gptq)."""

    def __init__(self, group_size: int, sym: bool, desc_act: bool = False,
                 activation: str = "silu"):
        super().__init__(group_size, sym, desc_act, "gptq_v2", activation)   # zero offset 0
        self.checkpoint_tensors = (
            CheckpointTensor("weight_packed", param="qweight"),
            CheckpointTensor("weight_scale", param="scales"),
            CheckpointTensor("weight_zero_point", required=not sym, param="qzeros"),
            CheckpointTensor("weight_g_idx", required=desc_act, param="g_idx"),
            CheckpointTensor("weight_shape", required=False, check_only=True))
        self._dims: dict[str, tuple[int, int]] = {}

    def layout(self, shape):
        specs = super().layout(shape)
        K, N = shape.hidden_size, shape.intermediate_size
        self._dims = {"w13": (N, K), "w2": (K, N)}          # (out, in) of one projection
        if self.sym:                 # no zero point in the checkpoint: u - 8 is the value
            for name in ("w13_qzeros", "w2_qzeros"):
                specs[name] = TensorSpec(specs[name].shape, specs[name].dtype, _ZEROS_OF_8)
        return specs

    def load_transform(self, suffix: str, proj: str, tensor: torch.Tensor) -> torch.Tensor:
        name = _layer_suffix(self, suffix)
        if name == "g_idx":
            return super().load_transform(name, proj, tensor)
        # qweight [out, in/8], scales [out, G] and qzeros [out/8, G] are already in the layer's
        # orientation; the gptq transform transposes GPTQ's [in-major] tensors, so undo it here.
        return super().load_transform(name, proj, tensor.t())

    def check_tensor(self, suffix: str, proj: str, tensor: torch.Tensor) -> None:
        want = self._dims[proj]
        if tuple(int(v) for v in tensor.reshape(-1).tolist()) != want:
            raise ValueError(f"weight_shape says {tensor.tolist()}, but the layer's {proj} "
                             f"projection is (out, in) = {want}")


class CompressedTensorsNvfp4MoEMethod(Nvfp4MoEMethod):
    """nvfp4-pack-quantized experts in the ``nvfp4`` layer layout (scheme nvfp4)."""

    checkpoint_tensors = (
        CheckpointTensor("weight_packed", param="weight"), CheckpointTensor("weight_scale"),
        CheckpointTensor("weight_global_scale", param="weight_scale_2"),
        CheckpointTensor("input_global_scale", required=False, shared=True, param="input_scale"))

    def load_transform(self, suffix: str, proj: str, tensor: torch.Tensor) -> torch.Tensor:
        t = super().load_transform(_layer_suffix(self, suffix), proj, tensor)
        # compressed-tensors' global scale divides, the nvfp4 layout's weight_scale_2 multiplies.
        return 1.0 / t.float() if suffix == "weight_global_scale" else t

    def load_shared(self, layer, param: str, tensor: torch.Tensor) -> None:
        super().load_shared(layer, param, 1.0 / tensor.float())

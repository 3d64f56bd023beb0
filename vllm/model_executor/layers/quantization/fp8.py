"""FP8 (e4m3) experts: per-tensor, per-channel, or 2-D block weight scales.

Checkpoint tensors per expert projection (out x in):
  weight            float8_e4m3fn [out, in]
  weight_scale      float32 [] or [1]  (per tensor, compressed-tensors / vLLM fp8)
                    float32 [out, 1]   (per channel, compressed-tensors "channel")
  weight_scale_inv  float32 [ceil(out/bo), ceil(in/bi)]  (block, HF/DeepSeek "fp8" with
                    weight_block_size [bo, bi]; despite the name, weight = fp8 * weight_scale_inv;
                    float8_e8m0fnu powers of two with scale_fmt "ue8m0")
  input_scale       float32 [] (static activation scale, shared by all experts; required when
                    input_quant is "tensor", else optional)
Dequantized weight = float(weight) * scale broadcast to [out, in].

Activations: the method records what the checkpoint declares (``input_quant``: None, "token",
"group" with ``input_group`` columns, or static "tensor"; see vllm/config/quantization.py).
Backends with a W8A8 kernel quantize activations accordingly; the others, and this method's own
numerics (``dequantize``), run weight-only (W8A16) with activations in the model dtype.

Layer layout (N = intermediate, K = hidden): w13_weight [E, 2N, K], w2_weight [E, K, N];
scales: tensor w13 [E, 2] (gate, up), w2 [E, 1]; channel w13 [E, 2N, 1], w2 [E, K, 1];
block w13 [E, 2*ceil(N/bo), ceil(K/bi)] (gate block rows, then up block rows), w2 [E, ceil(K/bo),
ceil(N/bi)]. Gate and up keep separate scales, so N need not be a multiple of the block.
"""
from __future__ import annotations

import torch

from vllm.config.quantization import check_input_quant
from vllm.kernels.cpu.qgemv import QuantRows
from vllm.model_executor.layers.quantization.base import MoEShape
from vllm.model_executor.layers.quantization.moe_ref import (CheckpointTensor,
                                                             QuantizedFusedMoEMethod, TensorSpec,
                                                             check_dtype, scalar_to)
from vllm.model_executor.layers.quantization.utils import (FP8_E4M3_MAX, ceil_div,
                                                           expand_block_scale, to_e4m3)

FP8_STRATEGIES = ("tensor", "channel", "block")
_E8M0 = tuple(getattr(torch, n) for n in ("float8_e8m0fnu",) if hasattr(torch, n))


class Fp8MoEMethod(QuantizedFusedMoEMethod):
    def __init__(self, strategy: str, block: tuple[int, int] | None = None,
                 activation: str = "silu", scale_name: str | None = None, *,
                 input_quant: str | None = None, input_group: int = 0):
        super().__init__(activation)
        check_input_quant(input_quant, input_group)      # built without a QuantConfig too
        if strategy not in FP8_STRATEGIES:
            raise ValueError(f"fp8 strategy={strategy!r} is invalid: must be one of "
                             f"{list(FP8_STRATEGIES)}")
        if (strategy == "block") != (block is not None):
            raise ValueError(f"fp8: block={block!r} must be given exactly for strategy 'block'")
        self.strategy, self.block = strategy, block
        self.input_quant, self.input_group = input_quant, input_group
        self.scheme = f"fp8-{strategy}"
        # compressed-tensors block checkpoints say weight_scale; HF/DeepSeek say weight_scale_inv.
        self.scale_name = scale_name or ("weight_scale_inv" if strategy == "block"
                                         else "weight_scale")
        self.checkpoint_tensors = (CheckpointTensor("weight"), CheckpointTensor(self.scale_name),
                                   CheckpointTensor("input_scale", shared=True,
                                                    required=input_quant == "tensor"))

    def layout(self, shape: MoEShape) -> dict[str, TensorSpec]:
        K, N = shape.hidden_size, shape.intermediate_size
        f8, f32 = torch.float8_e4m3fn, torch.float32
        if self.strategy == "tensor":
            s13, s2 = (2,), (1,)
        elif self.strategy == "channel":
            s13, s2 = (2 * N, 1), (K, 1)
        else:
            bo, bi = self.block
            s13, s2 = (2 * ceil_div(N, bo), ceil_div(K, bi)), (ceil_div(K, bo), ceil_div(N, bi))
        s = self.scale_name
        return {"w13_weight": TensorSpec((2 * N, K), f8), f"w13_{s}": TensorSpec(s13, f32),
                "w2_weight": TensorSpec((K, N), f8), f"w2_{s}": TensorSpec(s2, f32)}

    def load_transform(self, suffix: str, proj: str, tensor: torch.Tensor) -> torch.Tensor:
        if suffix == "weight":
            check_dtype("weight", tensor, torch.float8_e4m3fn)
            return tensor
        # transformers' fp8 writer with scale_fmt "ue8m0" stores powers of two as e8m0; they
        # widen exactly into the layer's float32 scales.
        check_dtype(suffix, tensor, torch.float32, torch.bfloat16, torch.float16,
                    *_E8M0)
        if self.strategy == "tensor":
            return scalar_to(tensor, (1,))
        if self.strategy == "channel" and tensor.dim() == 1:
            return tensor.unsqueeze(1)        # some writers drop the trailing 1
        return tensor

    def dequantize(self, t, dtype):
        s = self.scale_name
        w13, w2 = t["w13_weight"].float(), t["w2_weight"].float()
        s13, s2 = t[f"w13_{s}"], t[f"w2_{s}"]
        N = w13.shape[0] // 2
        if self.strategy == "tensor":
            w13 = torch.cat([w13[:N] * s13[0], w13[N:] * s13[1]])
            return w13.to(dtype), (w2 * s2[0]).to(dtype)
        if self.strategy == "channel":
            return (w13 * s13).to(dtype), (w2 * s2).to(dtype)
        bo, bi = self.block
        nb = s13.shape[0] // 2                        # block rows per half
        halves = [w13[h * N:(h + 1) * N] * expand_block_scale(s13[h * nb:(h + 1) * nb], N,
                                                              w13.shape[1], bo, bi)
                  for h in (0, 1)]
        w2 = w2 * expand_block_scale(s2, *w2.shape, bo, bi)
        return torch.cat(halves).to(dtype), w2.to(dtype)

    def cpu_kernel_layout(self):
        """The C expert kernel's view of these tensors (fused_moe/cpu_kernel.py, qgemm.h): e4m3
        codes, and each scale expanded to a [groups, columns] f32 table (one group for tensor
        and channel scales; input blocks of block[1] rows for block scales)."""
        from vllm.model_executor.layers.fused_moe.cpu_kernel import QuantLayout
        s = self.scale_name
        return QuantLayout("fp8", {"w13": "w13_weight", "w2": "w2_weight", "s13": f"w13_{s}",
                                   "s2": f"w2_{s}"}, self._kernel_tensors,
                           self.block[1] if self.block else None)

    def _kernel_tensors(self, t):
        s = self.scale_name
        w13, w2 = t["w13_weight"], t["w2_weight"]
        N, K = w13.shape[0] // 2, w13.shape[1]
        s13, s2 = t[f"w13_{s}"].float(), t[f"w2_{s}"].float()
        if self.strategy == "tensor":
            s13, s2 = s13.repeat_interleave(N)[None], s2.expand(K)[None]
        elif self.strategy == "channel":
            s13, s2 = s13.reshape(1, 2 * N), s2.reshape(1, K)
        else:
            bo = self.block[0]
            nb = s13.shape[0] // 2                   # block rows per half
            s13 = torch.cat([s13[h * nb:(h + 1) * nb].repeat_interleave(bo, 0)[:N]
                             for h in (0, 1)]).t()               # [ceil(K/bi), 2N]
            s2 = s2.repeat_interleave(bo, 0)[:K].t()            # [ceil(N/bi), K]
        return {"w13": w13.view(torch.uint8), "w2": w2.view(torch.uint8), "s13": s13, "s2": s2}

    def host_rows(self, t):
        """Codes as they are; the scales as ``QuantRows`` tables: a tensor scale per half (w13)
        or matrix (w2), one per output row, or 128 x 128 blocks (None when a w13 half is not a
        whole number of blocks, whose second half would then start inside a block row)."""
        s = self.scale_name
        w13, w2 = t["w13_weight"], t["w2_weight"]
        K, N = w13.shape[1], w2.shape[1]
        s13, s2 = t[f"w13_{s}"].float().contiguous(), t[f"w2_{s}"].float().contiguous()
        if self.strategy == "tensor":
            return (QuantRows("fp8", w13, s13.reshape(2, 1), N, K),
                    QuantRows("fp8", w2, s2.reshape(1, 1), K, N))
        if self.strategy == "channel":
            return QuantRows("fp8", w13, s13, 1, K), QuantRows("fp8", w2, s2, 1, N)
        bo, bi = self.block
        if N % bo:
            return None
        return QuantRows("fp8", w13, s13, bo, bi), QuantRows("fp8", w2, s2, bo, bi)


# ---- offline quantizer (tools/quantize_checkpoint.py, tests) ----------------------------------
def quantize_fp8(w: torch.Tensor, strategy: str, block: tuple[int, int] = (128, 128)
                 ) -> dict[str, torch.Tensor]:
    """Round-to-nearest FP8 of one weight [out, in] -> checkpoint tensors {suffix: tensor}."""
    w = w.float()
    if strategy == "tensor":
        scale = (w.abs().amax() / FP8_E4M3_MAX).clamp(min=1e-12).reshape(1)
        return {"weight": to_e4m3(w / scale), "weight_scale": scale}
    if strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp(min=1e-12)   # [out, 1]
        return {"weight": to_e4m3(w / scale), "weight_scale": scale}
    if strategy != "block":
        raise ValueError(f"fp8 strategy={strategy!r} is invalid: must be one of "
                         f"{list(FP8_STRATEGIES)}")
    bo, bi = block
    out, inp = w.shape
    pad = torch.zeros(ceil_div(out, bo) * bo, ceil_div(inp, bi) * bi, device=w.device)
    pad[:out, :inp] = w.abs()
    amax = pad.reshape(pad.shape[0] // bo, bo, pad.shape[1] // bi, bi).amax(dim=(1, 3))
    scale = (amax / FP8_E4M3_MAX).clamp(min=1e-12)                       # [out/bo, in/bi]
    q = to_e4m3(w / expand_block_scale(scale, out, inp, bo, bi))
    return {"weight": q, "weight_scale_inv": scale}

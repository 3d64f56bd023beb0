"""FP8 dense linears dequantized at load, for checkpoints that quantize more than the experts.

Published FP8 checkpoints quantize every linear: DeepSeek-V3's and Qwen3's FP8 releases
(``weight`` float8_e4m3fn + ``weight_scale_inv`` per 128x128 block), compressed-tensors FP8
(``weight_scale`` per tensor or channel). Only routed experts have an FP8 scheme here
(``fp8.py``, through the expert cache); in a checkpoint of an fp8 scheme the other linears
become float32 weights while the checkpoint streams in (``dense_fp8_weights``, called by every
model's loader), and load as unquantized ones.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

from vllm.model_executor.layers.quantization.utils import expand_block_scale

_EXPERT = re.compile(r"\.experts\.\d+\.")
_FP8_SCALES = ("weight_scale_inv", "weight_scale")


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None) -> torch.Tensor:
    """e4m3 weight [out, in] and its scale (one value, [out, 1], or per block) -> float32."""
    out, inp = w.shape
    if scale.numel() == 1:
        return w.float() * scale.float().reshape(())
    if tuple(scale.shape) == (out, 1):
        return w.float() * scale.float()
    bo, bi = block or (128, 128)
    if tuple(scale.shape) != (-(-out // bo), -(-inp // bi)):
        raise ValueError(f"scale {tuple(scale.shape)} does not fit weight {(out, inp)} with "
                         f"weight_block_size {[bo, bi]}")
    return w.float() * expand_block_scale(scale, out, inp, bo, bi)


def dequantize_dense_fp8(weights: Iterable[tuple[str, torch.Tensor]],
                         block: tuple[int, int] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass checkpoint tensors through, replacing each non-expert FP8 ``X.weight`` + its
    ``X.weight_scale_inv`` (or ``weight_scale``) by a float32 ``X.weight``; a dense
    ``input_scale`` is dropped (activations are not quantized). Expert tensors pass unchanged
    (``FusedMoE``'s FP8 scheme loads them). Either half of a pair may come first."""
    held: dict[tuple[str, bool], torch.Tensor] = {}          # (module, is_scale) -> tensor
    for name, t in weights:
        module, _, suffix = name.rpartition(".")
        fp8_weight = suffix == "weight" and t.dtype == torch.float8_e4m3fn
        is_scale = suffix in _FP8_SCALES
        if _EXPERT.search(name) or not (fp8_weight or is_scale or suffix == "input_scale"):
            yield name, t
            continue
        if suffix == "input_scale":
            continue
        other = held.pop((module, not is_scale), None)
        if other is None:
            held[(module, is_scale)] = t
            continue
        w, s = (t, other) if fp8_weight else (other, t)
        try:
            yield f"{module}.weight", dequantize_fp8(w, s, block)
        except ValueError as err:
            raise ValueError(f"checkpoint tensor {module}.weight: {err}") from None
    if held:
        (module, is_scale), _ = next(iter(held.items()))
        missing = "weight (float8_e4m3fn)" if is_scale else "weight_scale_inv"
        raise ValueError(f"checkpoint tensor {module}.{missing} is missing: an FP8 linear needs "
                         "its weight and its scale")


def dense_fp8_weights(weights: Iterable[tuple[str, torch.Tensor]], qc
                      ) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights`` with the dense FP8 linears dequantized when the checkpoint's ``QuantConfig``
    ``qc`` is an fp8 scheme (its block for block scales); unchanged otherwise (None or another
    scheme: their dense tensors, if quantized, fail to load by name)."""
    if qc is None or not qc.scheme.startswith("fp8"):
        return weights
    return dequantize_dense_fp8(weights, qc.block)

"""MoE quant methods per scheme (``base.py`` is the contract; ``vllm/config/quantization.py``
parses checkpoints into the ``QuantConfig`` this maps to a method)."""
from __future__ import annotations

from typing import Any

from vllm.config.quantization import QuantConfig
from vllm.model_executor.layers.quantization.base import FusedMoEMethodBase


def get_moe_quant_method(qc: QuantConfig, layer: Any) -> FusedMoEMethodBase | None:
    """The method for one FusedMoE (by its ``prefix`` and ``activation``); None = unquantized
    experts (the layer is in the checkpoint's ignore list)."""
    if qc.ignores_layer(getattr(layer, "prefix", "")):
        return None
    activation = getattr(layer, "activation", "silu")
    if qc.scheme.startswith("fp8"):
        from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
        return Fp8MoEMethod(qc.scheme[4:], qc.block, activation, qc.scale_name,
                            input_quant=qc.input_quant, input_group=qc.input_group)
    if qc.quant_method == "compressed-tensors" and qc.scheme in ("w4a16-gptq", "nvfp4"):
        from vllm.model_executor.layers.quantization import compressed_tensors as ct
        if qc.scheme == "nvfp4":
            return ct.CompressedTensorsNvfp4MoEMethod(activation)
        return ct.CompressedTensorsW4A16MoEMethod(qc.group_size, qc.sym, qc.desc_act, activation)
    if qc.scheme == "w4a16-gptq":
        from vllm.model_executor.layers.quantization.gptq import GptqMoEMethod
        return GptqMoEMethod(qc.group_size, qc.sym, qc.desc_act, qc.checkpoint_format, activation)
    if qc.scheme == "mxfp4":
        from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod
        return Mxfp4MoEMethod(activation)
    from vllm.model_executor.layers.quantization.nvfp4 import Nvfp4MoEMethod
    return Nvfp4MoEMethod(activation)

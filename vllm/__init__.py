"""A vLLM-compatible inference engine for MoE models whose experts need not fit on the device."""
import os as _os

DEFAULT_MODEL = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "models", "default")
"""Local path of the small MoE model shipped inside the package."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy imports keep `import vllm` (and `vllm --help`) fast.
    if name == "LLM":
        from vllm.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from vllm.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from vllm import outputs
        return getattr(outputs, name)
    if name in ("TokensPrompt", "TextPrompt"):
        from vllm import inputs
        return getattr(inputs, name)
    if name == "EngineArgs":
        from vllm.engine.arg_utils import EngineArgs
        return EngineArgs
    raise AttributeError(f"module 'vllm' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "TokensPrompt", "TextPrompt",
           "EngineArgs", "DEFAULT_MODEL"]

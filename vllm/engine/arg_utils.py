"""EngineArgs: the one definition of engine arguments, shared by ``LLM(...)`` and the CLI.

Each field's docstring (the string after it) becomes its ``--help`` text; the CLI flag is
the field name with dashes (vLLM's spelling). Nothing else lists the arguments.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from dataclasses import dataclass, fields

from vllm.config import (CacheConfig, DeviceConfig, KernelConfig, ModelConfig, MoECacheConfig,
                         SchedulerConfig, VllmConfig)


@dataclass
class EngineArgs:
    model: str | None = None
    """Path to a local Hugging Face model directory (default: the shipped default model)."""
    tokenizer: str | None = None
    """Tokenizer directory (default: the model directory)."""
    dtype: str = "auto"
    """Compute dtype: auto, float32, bfloat16 or float16."""
    seed: int = 0
    """Global random seed."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens (default: the model's max_position_embeddings)."""
    max_num_seqs: int = 256
    """Most requests batched in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step; longer prompts are prefilled in chunks."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_gpu_blocks_override: int | None = None
    """Force the number of KV-cache blocks (testing preemption)."""
    kv_cache_memory_bytes: int | None = None
    """Bytes for the KV cache (default: 90% of free accelerator memory on CUDA, 1 GiB on CPU)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of accelerator memory the engine may use (CUDA only)."""
    enforce_eager: bool = False
    """Run every step eagerly. By default decode-only steps replay graphs: on CPU with the C
    kernels a CPU graph of their kernel calls (``vllm/worker/cpu_graphs.py``), on CUDA a CUDA
    graph of the forward and logits where every layer can be captured
    (``vllm/worker/cuda_graphs.py``)."""
    cuda_graph_sizes: list[int] | None = None
    """Decode batch sizes captured as CUDA graphs (a step of B sequences replays the smallest
    size >= B; larger steps run eagerly). Default: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs.
    Each must be in [1, max_num_seqs]."""
    async_scheduling: bool = False
    """Schedule and launch the next step while the current one runs, before its tokens reach
    the host: the host's work between steps overlaps the device's (vLLM's
    --async-scheduling). Requests that stop on a token are computed one step more and that
    result dropped; while a decoding row's sampling reads its output tokens (penalties,
    min_tokens, guided decoding), a prompt is prefilled in chunks or blocks run short, steps
    are scheduled as before. On CPU the model runs on the host, so it only delays each output
    by a step."""
    device: str = "auto"
    """auto, cpu or cuda."""
    trust_remote_code: bool = False
    """Accepted for vLLM compatibility; only built-in architectures load."""
    moe_expert_cache_size: int = 0
    """Expert slots per MoE layer on the device (0 = off: all experts resident)."""
    moe_expert_cache_policy: str = "auto"
    """Expert-cache eviction policy (auto = the measured best; see docs/expert-cache.md)."""
    moe_expert_prefetch: str = "off"
    """Expert-cache prefetch: off, or next-layer (each MoE layer runs the next one's router on
    its hidden state and loads the predicted experts early; outputs unchanged; CPU decode steps
    run eagerly, CUDA graphs capture it; see docs/expert-cache.md)."""
    moe_expert_overlap: bool = False
    """Expert cache: copy each wave's misses (and prefetch loads) on a side stream while the layer
    computes its hit experts (CUDA; outputs unchanged; no effect on CPU; see
    docs/expert-cache.md)."""
    moe_expert_cpu_compute: str = "off"
    """Expert cache: off; auto (compute a missing expert's tokens on the CPU from host memory
    until the CPU has spent one copy's time on it, then copy it: ski rental over a cost model
    measured at load; for slow links such as PCIe x4 or WSL; on a GPU also the least used
    misses while the CPU beside the copies shortens the step); always (every miss on the CPU).
    Decode graphs run it between their pieces; outputs may differ by rounding; see
    docs/expert-cache.md."""
    moe_expert_link_compression: str = "off"
    """Expert cache: off; exp12 (bf16 experts held in host memory in 12 bits per weight,
    losslessly, and decoded into their slots on the GPU: a quarter fewer bytes per miss, outputs
    unchanged; CUDA with triton; moe_expert_cpu_compute then reads the planes; see
    docs/expert-cache.md)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the step's token budget across steps."""
    tensor_parallel_size: int = 1
    """Accepted for vLLM compatibility; only 1 (a single device) is supported."""
    quantization: str | None = None
    """Expected quantization method (e.g. fp8, gptq, compressed-tensors, modelopt); the
    checkpoint's quantization_config decides, and a mismatch is an error."""
    moe_backend: str = "auto"
    """MoE expert kernel: auto, cpu_kernel (C, CPU f32/bf16), grouped_mm (torch._grouped_mm),
    triton (Triton fused MoE, CUDA), flashinfer_cutlass (FlashInfer CUTLASS, CUDA; never
    chosen by auto), cutlass_w4a16 (symmetric GPTQ INT4 on CUTLASS, SM 9.0; never chosen by
    auto) or torch (per-expert loop reference, every scheme); see docs/quantization.md."""
    attention_backend: str = "auto"
    """Attention kernel: auto, cpu_paged (C, CPU f32/bf16) or torch_sdpa."""
    moe_routing_trace_path: str | None = None
    """Record every MoE layer's routing to this .npz (the shared trace format) at shutdown."""
    moe_routing_trace_scores: bool = False
    """With moe_routing_trace_path: also record each router's softmax over all experts
    (the trace's optional ``scores``, float16 [T, L, E])."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; accepted engine arguments: "
                            f"{cls.field_names()}")
        return cls(**kwargs)

    # ---- CLI -------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        docs = _field_docs(cls)
        group = parser.add_argument_group("engine arguments")
        for f in fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_text = f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%")
            if f.type in ("bool", bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                   help=help_text)
            elif str(f.type).startswith("list[int]"):
                group.add_argument(flag, type=_parser_for(f), nargs="+", default=f.default,
                                   help=help_text, metavar="N")
            else:
                group.add_argument(flag, type=_parser_for(f), default=f.default, help=help_text,
                                   metavar=f.name.upper())

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})

    # ---- config ----------------------------------------------------------------------------
    def create_engine_config(self) -> VllmConfig:
        from vllm import DEFAULT_MODEL
        model = self.model or DEFAULT_MODEL
        model_config = ModelConfig(model=model, tokenizer=self.tokenizer, dtype=self.dtype,
                                   seed=self.seed, max_model_len=self.max_model_len,
                                   trust_remote_code=self.trust_remote_code)
        cache_config = CacheConfig(block_size=self.block_size,
                                   num_gpu_blocks=self.num_gpu_blocks_override,
                                   kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                                   gpu_memory_utilization=self.gpu_memory_utilization)
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r} is invalid: only "
                             "1 is supported (experts beyond device memory go to the expert cache: "
                             "--moe-expert-cache-size)")
        scheduler_config = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                           max_num_batched_tokens=self.max_num_batched_tokens,
                                           enable_chunked_prefill=bool(self.enable_chunked_prefill),
                                           cuda_graph_sizes=self.cuda_graph_sizes,
                                           async_scheduling=bool(self.async_scheduling))
        moe = MoECacheConfig(cache_size=self.moe_expert_cache_size,
                             policy=self.moe_expert_cache_policy,
                             routing_trace_path=self.moe_routing_trace_path,
                             routing_trace_scores=bool(self.moe_routing_trace_scores),
                             prefetch=self.moe_expert_prefetch,
                             overlap=self.moe_expert_overlap,
                             cpu_compute=self.moe_expert_cpu_compute,
                             link_compression=self.moe_expert_link_compression)
        config = VllmConfig(model_config, cache_config, scheduler_config, moe,
                            DeviceConfig(self.device), enforce_eager=bool(self.enforce_eager),
                            kernel_config=KernelConfig(self.moe_backend,
                                                                      self.attention_backend))
        _check_registered_names(config)
        found = config.quant_config.quant_method if config.quant_config else None
        if self.quantization is not None and self.quantization != found:
            raise ValueError(f"quantization={self.quantization!r} is invalid for this checkpoint: "
                             f"its quantization_config says {found!r}")
        return config


def _check_registered_names(config: VllmConfig) -> None:
    """Policy and backend names against their registries, before any model is built."""
    from vllm.model_executor.layers.attention import attention_backend_names
    from vllm.model_executor.layers.fused_moe.expert_cache.policy import policy_names
    from vllm.model_executor.layers.fused_moe.registry import moe_backend_names
    k = config.kernel_config
    for what, value, names in (
            ("moe_expert_cache_policy", config.moe_cache_config.policy, policy_names()),
            ("moe_backend", k.moe_backend, moe_backend_names()),
            ("attention_backend", k.attention_backend, attention_backend_names())):
        if value != "auto" and value not in names:
            raise ValueError(f"{what}={value!r} is invalid: must be 'auto' or one of "
                             f"{list(names)}")


def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) from the class source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            docs[prev.target.id] = str(node.value.value)
    return docs


def _parser_for(f: dataclasses.Field):
    """argparse type for a field annotated as a string ("int | None", "str", "float"; the element
    type of "list[int] | None", whose flag takes one or more values)."""
    base = str(f.type).replace(" ", "").split("|")[0].removeprefix("list[").removesuffix("]")
    conv = {"int": int, "float": float, "str": str}[base]
    name = "--" + f.name.replace("_", "-")

    def parse(text: str):
        try:
            return conv(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}={text!r} is invalid: must be {base}") from None
    parse.__name__ = base
    return parse

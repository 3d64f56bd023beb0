"""Small, validated configuration dataclasses, one per subsystem.

Every field has a docstring-style comment. Each config validates itself in
``__post_init__`` and raises ``ValueError`` naming the bad field, its value and what is
allowed. ``VllmConfig`` bundles them; it is built by ``EngineArgs.create_engine_config``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.config.graph_sizes import check_graph_sizes
from vllm.config.quantization import QuantConfig, quant_config_from_model_dir
from vllm.platforms import resolve_device

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    """Raise ValueError unless ``value`` is an int (not bool) in [low, high]."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and value >= low and (high is None or value <= high):
        return
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")


@dataclass
class ModelConfig:
    model: str
    """Path to a Hugging Face model directory (config.json + *.safetensors + tokenizer)."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to ``model``."""
    dtype: str | torch.dtype = "auto"
    """Compute dtype: "auto" (config's torch_dtype; float32 on CPU for float16 models), or a name."""
    seed: int = 0
    """Seed for the global RNG (random sampling without a per-request seed)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; defaults to the config's max_position_embeddings."""
    trust_remote_code: bool = False
    """Accepted for vLLM compatibility; only built-in architectures are supported."""
    hf_config: Any = field(default=None, repr=False)
    """The parsed ``transformers`` config (filled in ``__post_init__``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model={self.model!r} is invalid: must be a model directory path")
        if not os.path.isdir(self.model):
            raise ValueError(f"model={self.model!r}: no such directory (this engine loads local "
                             "Hugging Face model directories only; there is no model hub access)")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model={self.model!r}: directory has no config.json")
        if self.tokenizer is None:
            self.tokenizer = self.model
        _check_int("seed", self.seed, 0)
        if self.hf_config is None:
            from transformers import AutoConfig
            self.hf_config = AutoConfig.from_pretrained(self.model)
        self.dtype = self._resolve_dtype(self.dtype)
        limit = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if self.max_model_len is None:
            self.max_model_len = limit
        _check_int("max_model_len", self.max_model_len, 1, limit)

    def _resolve_dtype(self, dtype: str | torch.dtype) -> torch.dtype:
        if isinstance(dtype, torch.dtype):
            if dtype in _DTYPES.values():
                return dtype
        elif dtype == "auto":
            # transformers 5 calls it "dtype" (its "torch_dtype" property warns); 4.x stores
            # "torch_dtype" as a plain attribute.
            cfg_dtype = (getattr(self.hf_config, "dtype", None)
                         or vars(self.hf_config).get("torch_dtype"))
            if isinstance(cfg_dtype, str):
                cfg_dtype = _DTYPES.get(cfg_dtype)
            return cfg_dtype if cfg_dtype in (torch.float32, torch.bfloat16) else torch.float32
        elif isinstance(dtype, str) and dtype in _DTYPES:
            return _DTYPES[dtype]
        raise ValueError(f"dtype={dtype!r} is invalid: must be 'auto' or one of {sorted(_DTYPES)}")

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else type(self.hf_config).__name__


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per paged KV-cache block."""
    num_gpu_blocks: int | None = None
    """Number of KV blocks; derived from ``kv_cache_memory_bytes`` (or a default budget) when None."""
    kv_cache_memory_bytes: int | None = None
    """Bytes to give the KV cache; overrides ``gpu_memory_utilization`` when set."""
    gpu_memory_utilization: float = 0.9
    """Fraction of accelerator memory the engine may use (CUDA only; CPU uses a fixed budget)."""
    num_state_slots: int = 0
    """Per-request recurrent-state slots (conv + SSM state of Mamba / Gated DeltaNet layers):
    set by the model runner to ``max_num_seqs`` when the model has recurrent layers, else 0."""

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1, 1024)
        _check_int("num_state_slots", self.num_state_slots, 0)
        if self.num_gpu_blocks is not None:
            _check_int("num_gpu_blocks", self.num_gpu_blocks, 1)
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        g = self.gpu_memory_utilization
        if not isinstance(g, (int, float)) or isinstance(g, bool) or not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization={g!r} is invalid: must be a number in (0, 1]")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    cuda_graph_sizes: list[int] | None = None
    """Batch sizes of the CUDA decode graphs (``worker/cuda_graphs.py``), sorted and deduplicated
    by ``__post_init__``; None -> 1, 2, 4, 8, 16, 24, ... below ``max_num_seqs``, then
    ``max_num_seqs`` (``graph_sizes.default_graph_sizes``). A size above ``max_num_seqs`` is
    refused. A decode step of B sequences replays the smallest size >= B."""
    async_scheduling: bool = False
    """Launch the next decode step before the tokens of the one in flight reach the host
    (``Scheduler.schedule_ahead``), so the host's work between steps (outputs, stop checks,
    scheduling, inputs) overlaps the device's instead of idling it."""

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling={self.async_scheduling!r} is invalid: must be "
                             "True or False")
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        self.cuda_graph_sizes = check_graph_sizes(self.cuda_graph_sizes, self.max_num_seqs)


MOE_PREFETCH_MODES = ("off", "next-layer")
MOE_CPU_COMPUTE_MODES = ("off", "auto", "always")
MOE_LINK_COMPRESSION_MODES = ("off", "exp12")


@dataclass
class MoECacheConfig:
    cache_size: int = 0
    """Expert slots per MoE layer on the compute device; 0 = off (all experts resident)."""
    policy: str = "auto"
    """Eviction policy name; "auto" picks the measured best (see docs/expert-cache.md)."""
    routing_trace_path: str | None = None
    """If set, record every MoE layer's routing (topk_ids) to this .npz in the shared trace format."""
    routing_trace_scores: bool = False
    """With routing_trace_path: also record the router's softmax over all experts (``scores``)."""
    prefetch: str = "off"
    """"off", or "next-layer": at each MoE layer, run the next MoE layer's norm + router on this
    layer's hidden state and load its predicted experts into that layer's cache early
    (``fused_moe/next_layer_prefetch.py``); outputs are unchanged."""
    overlap: bool = False
    """Copy each wave's misses on a side stream while the layer computes the wave's hits, then
    compute the misses (``expert_cache/overlap.py``); outputs are unchanged. Where the platform
    has no side stream (CPU) it has no effect."""
    cpu_compute: str = "off"
    """"off"; "auto": compute a missing expert's tokens on the CPU from the host store instead of
    copying it until the CPU has spent one copy's time on it (ski rental, over a cost model
    measured at load; for slow links), and, where the copies run beside the CPU (a GPU), the
    least used of the other misses while that shortens the step; "always": every miss on the
    CPU. Not loaded, not counted as a miss; a decode graph runs it between its pieces
    (``model_executor/graph_break.py``); outputs may differ by rounding
    (``expert_cache/host_compute.py``)."""
    link_compression: str = "off"
    """"off", or "exp12": bf16 experts are held in host memory as exp12 planes (12 bits per
    weight, lossless) and each miss is decoded exactly into its slot on the device
    (``expert_cache/link_codec.py``): a quarter fewer bytes over the link and in host memory,
    outputs unchanged. CUDA with triton. With ``cpu_compute`` the CPU computes its misses from
    the planes (``kernels/cpu/gemv16.c``'s ``gemv16_exp12``)."""

    def __post_init__(self) -> None:
        if self.cache_size is None:
            self.cache_size = 0
        _check_int("moe_expert_cache_size", self.cache_size, 0)
        if not isinstance(self.overlap, bool):
            raise ValueError(f"moe_expert_overlap={self.overlap!r} is invalid: must be True or "
                             "False")
        if self.cpu_compute not in MOE_CPU_COMPUTE_MODES:
            raise ValueError(f"moe_expert_cpu_compute={self.cpu_compute!r} is invalid: must be "
                             f"one of {list(MOE_CPU_COMPUTE_MODES)}")
        if self.link_compression not in MOE_LINK_COMPRESSION_MODES:
            raise ValueError(f"moe_expert_link_compression={self.link_compression!r} is invalid: "
                             f"must be one of {list(MOE_LINK_COMPRESSION_MODES)}")
        if self.prefetch not in MOE_PREFETCH_MODES:
            raise ValueError(f"moe_expert_prefetch={self.prefetch!r} is invalid: must be one of "
                             f"{list(MOE_PREFETCH_MODES)}")
        # The name is checked against the policy registry where it is used (config sits below
        # it): EngineArgs.create_engine_config and the cache's get_policy.
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError(f"moe_expert_cache_policy={self.policy!r} is invalid: must be 'auto' "
                             "or a policy name")

    @property
    def enabled(self) -> bool:
        return self.cache_size > 0


@dataclass
class DeviceConfig:
    device: str = "auto"
    """"auto" (cuda when available, else cpu), "cpu" or "cuda[:N]"."""

    def __post_init__(self) -> None:
        self.device = resolve_device(self.device)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


@dataclass
class KernelConfig:
    moe_backend: str = "auto"
    """MoE expert backend by registered name, or "auto": the first the platform offers that
    supports the layer (``model_executor/layers/fused_moe/registry.py`` explains refusals)."""
    attention_backend: str = "auto"
    """Attention backend by registered name, or "auto" (``model_executor/layers/attention/
    registry.py``)."""

    def __post_init__(self) -> None:
        # Names are checked against the registries where they are used (config sits below them).
        for name in ("moe_backend", "attention_backend"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}={value!r} is invalid: must be 'auto' or a backend name")


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    moe_cache_config: MoECacheConfig
    device_config: DeviceConfig
    enforce_eager: bool = False
    """No decode graphs: neither CPU graphs (``vllm/worker/cpu_graphs.py``) nor CUDA graphs
    (``vllm/worker/cuda_graphs.py``); every step runs eagerly."""
    quant_config: QuantConfig | None = None
    """A ``QuantConfig`` (quantized experts) parsed from the checkpoint's ``quantization_config``
    (or ``hf_quant_config.json``) when left None; stays None for unquantized checkpoints."""
    kernel_config: KernelConfig = field(default_factory=KernelConfig)

    def __post_init__(self) -> None:
        if self.quant_config is None and self.model_config is not None:
            self.quant_config = quant_config_from_model_dir(self.model_config.model,
                                                            self.model_config.hf_config)

    def summary(self) -> str:
        m = self.model_config
        return json.dumps({
            "model": m.model, "architecture": m.architecture, "dtype": str(m.dtype),
            "device": self.device_config.device, "max_model_len": m.max_model_len,
            "moe_expert_cache_size": self.moe_cache_config.cache_size,
            "moe_expert_cache_policy": self.moe_cache_config.policy,
            "moe_expert_prefetch": self.moe_cache_config.prefetch,
            "moe_expert_overlap": self.moe_cache_config.overlap,
            "moe_expert_cpu_compute": self.moe_cache_config.cpu_compute,
            "moe_expert_link_compression": self.moe_cache_config.link_compression,
            "quantization": self.quant_config.describe() if self.quant_config else None,
        })


_current_config: VllmConfig | None = None


class set_current_vllm_config:
    """Context manager that makes ``cfg`` visible to layers while a model is being built."""

    def __init__(self, cfg: VllmConfig | None):
        self.cfg = cfg

    def __enter__(self) -> VllmConfig | None:
        global _current_config
        self.prev, _current_config = _current_config, self.cfg
        return self.cfg

    def __exit__(self, *exc) -> None:
        global _current_config
        _current_config = self.prev


def get_current_vllm_config() -> VllmConfig | None:
    return _current_config

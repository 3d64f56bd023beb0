"""Shared test setup: makes the helper modules in tests/ importable and builds tiny models once."""
from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Tiny models: one thread is fastest, and intra-op threads spin badly when the 2-core machine is
# busy with other processes.
torch.set_num_threads(1)
# Without a GPU, Triton kernels run under Triton's interpreter. It is chosen when @triton.jit
# runs (triton's own library functions included), so it must be set before anything imports
# triton; torch and vllm do not import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
TRITON_INTERPRETER_ON = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def triton_interpreter(monkeypatch):
    """For tests that run Triton kernels on CPU tensors: they need the interpreter on from the
    start (a GPU machine has it off, and runs the compiled kernels in the gpu tests instead;
    ``TRITON_INTERPRET=1 pytest ...`` includes these there)."""
    if not TRITON_INTERPRETER_ON:
        pytest.skip("runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 before triton "
                    "is imported (set by default only without a GPU)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: elsewhere they skip with the reason."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu; run with `pytest -m gpu` on "
                                   "a machine that has one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Returns build(arch, **overrides) -> path of a tiny random model with a real tokenizer;
    identical requests share one directory."""
    from tiny_models import build_tiny_model
    cache: dict = {}

    def build(arch: str = "Qwen3MoeForCausalLM", **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(arch)
            build_tiny_model(arch, path, **overrides)
            cache[key] = str(path)
        return cache[key]
    return build


@pytest.fixture
def vllm_log(caplog, monkeypatch):
    """Capture the package logger (it does not propagate) with a fresh log_once memory."""
    import vllm.logger
    monkeypatch.setattr(vllm.logger, "_once", set())
    logger = logging.getLogger("vllm")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture
def torch_paths(monkeypatch):
    """Run with the C kernels off (VLLM_CPU_KERNELS=0): every layer takes its torch path, as on
    a machine without a C compiler (and like the CUDA paths)."""
    from vllm.kernels.cpu import build
    monkeypatch.setenv("VLLM_CPU_KERNELS", "0")
    build.load_cpu_kernels.cache_clear()
    yield
    monkeypatch.delenv("VLLM_CPU_KERNELS")
    build.load_cpu_kernels.cache_clear()


@pytest.fixture(scope="session")
def recorded_routing(tmp_path_factory):
    """The shipped default model's own routing, recorded by the engine: [steps] of [L, T, K]."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.fused_moe.expert_cache.trace import load_trace
    if not os.path.isdir(vllm.DEFAULT_MODEL):
        pytest.skip("default model not shipped")
    path = str(tmp_path_factory.mktemp("trace") / "trace.npz")
    llm = LLM(device="cpu", moe_routing_trace_path=path, max_num_seqs=4)
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "    for i in range("]
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    del llm
    return load_trace(path)

"""Build the model for a ``VllmConfig`` and fill it from the directory's safetensors files.

Tensors are read one at a time from memory-mapped files (``safetensors.safe_open``), so peak host
memory is one tensor plus the model, never a second copy of the checkpoint.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.models.registry import get_model_class

logger = init_logger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def find_safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: the shards named by the index if present, else every *.safetensors."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist")
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = [os.path.join(model_dir, s) for s in sorted(set(weight_map.values()))]
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {absent}")
        if files:
            return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model directory {model_dir!r} has no *.safetensors files "
                                "(only safetensors checkpoints are supported)")
    return files


def iterate_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of every file, one tensor at a time."""
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def get_model(vllm_config: VllmConfig) -> nn.Module:
    """Build the architecture on the target device in the model dtype, load weights, finish MoE."""
    mc = vllm_config.model_config
    device = vllm_config.device_config.torch_device
    files = find_safetensors_files(mc.model)
    cls = get_model_class(mc.architecture)
    with set_current_vllm_config(vllm_config):
        with _default_dtype(mc.dtype), torch.device(device):
            model = cls(mc.hf_config)
        model.requires_grad_(False)
        with torch.no_grad():
            model.load_weights(iterate_safetensors(files))
            # Parents before their children (pre-order): attention (q/k/v) and gated MLPs
            # (gate/up) fuse their Linears' weights before a Linear would pack its own.
            for module in list(model.modules()):
                finish = getattr(module, "finish_loading", None)
                if callable(finish):
                    finish(device)
    qc = getattr(vllm_config, "quant_config", None)
    logger.info("Loaded %s from %d safetensors file(s) (dtype %s, device %s, quantization %s)",
                mc.architecture, len(files), mc.dtype, device, qc.describe() if qc else "none")
    return model.eval()

"""The Triton attention backend (``triton_paged``, ``vllm/kernels/triton/paged_attention.py``):
one launch writes the step's keys (and values) into the paged cache, skipping PAD_SLOT_ID rows;
one launch attends every query token of the step, decodes and prefill chunks alike, reading the
cache in place through the block table (GQA, sliding window, sinks and a one-plane
``kv_shared`` cache all in the kernel). A step with prefill tokens runs the query-tiled kernel
(``paged_prefill.py``) over a work list built on the host from the metadata's ``query_lens_cpu``
once per step (``AttentionMetadata.per_step``, shared by every layer), and its decodes the
decode-only steps' split-context kernels.

CUDA, or CPU tensors under ``TRITON_INTERPRET=1`` (how it is tested without a GPU); run on an
H100 (2026-11-26) in the decode benchmark and the gpu tests. ``cuda_graph_safe``: a
decode-only step launches the same two kernels with the same grid for a given batch size and
reads every length from the metadata's device tensors
(``seq_lens``, ``block_tables``, ``slot_mapping``), never from the host lists.
"""
from __future__ import annotations

import torch

from vllm.model_executor.forward_context import AttentionMetadata
from vllm.model_executor.layers.attention.interface import AttentionImpl, AttentionOptions
from vllm.platforms import Platform, platform_for


SM120_SHARED = 99 * 1024
"""Shared memory one program may use on SM120 (RTX 50-series); SM90 and SM100 have 227 KiB."""


def fp32_tile_bytes(head_dim: int, planes: int) -> int:
    """Shared memory of the kernels' widest f32 tiles past D = 256 (paged_decode.py,
    paged_prefill.py): 16 keys of ``tile_width(D)`` columns (paged_tiles.py), the key tile
    double-buffered, plus the value tile with two planes, plus 1088 bytes of scratch. Fitted to,
    and checked against, compiles for SM120 (tests/build/test_triton_compile_paged_attention.py):
    one plane 576 -> 74,816 B, 768 -> 99,392, 1024 -> 132,160; two planes 512 -> 99,392 (the
    prefill kernel; decode needs less), 576 -> 111,680."""
    from vllm.kernels.triton.paged_tiles import tile_width    # triton is optional
    return 16 * tile_width(head_dim) * 4 * (2 if planes == 1 else 3) + 1088


def shared_memory_refusal(dtype: torch.dtype, head_dim: int, sm: int, planes: int = 2
                          ) -> str | None:
    """Why the kernels' tiles do not fit a device of compute capability ``sm`` (90, 120), or
    None. Only fp32 caches past D = 256 on SM120 can pass its 99 KiB (``fp32_tile_bytes``): a
    one-plane cache (``kv_shared``, MLA's 576) up to D = 768, two planes up to D = 512; 16-bit
    caches and SM90's (and SM100's) 227 KiB take every head dim a model has."""
    if dtype != torch.float32 or head_dim <= 256 or sm < 120:
        return None
    need = fp32_tile_bytes(head_dim, planes)
    if need <= SM120_SHARED:
        return None
    return (f"an fp32 KV cache of {planes} plane(s) at head_dim={head_dim} needs about "
            f"{need // 1000} KB of shared memory per program, over the 99 KiB of SM{sm}; use a "
            "16-bit dtype")


def triton_paged_refusal(platform: Platform, dtype: torch.dtype, head_dim: int,
                         planes: int = 2) -> str | None:
    """``triton_refusal`` (the package), then ``shared_memory_refusal`` on a CUDA device."""
    from vllm.kernels.triton import triton_refusal
    why = triton_refusal(platform.device_type)
    # The device is asked only where its size matters (selection touches no device otherwise).
    if why is None and platform.device_type == "cuda" and \
            shared_memory_refusal(dtype, head_dim, 999, planes):
        cap = platform.get_device_capability()       # None without a device: nothing to size
        why = None if cap is None else shared_memory_refusal(dtype, head_dim, cap.to_int(),
                                                             planes)
    return why


class TritonPagedAttention(AttentionImpl):
    name = "triton_paged"
    cuda_graph_safe = True

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 prefix: str = "", options: AttentionOptions = AttentionOptions()):
        super().__init__(num_heads, head_dim, num_kv_heads, scale, prefix, options)
        # Imported here: triton is optional, and the registry refuses this backend without it.
        from vllm.kernels.triton import paged_attention
        from vllm.kernels.triton import paged_prefill
        self._ops, self._prefill = paged_attention, paged_prefill

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, md: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        self._ops.write_kv_cache(k, v, md.slot_mapping, kv_cache)
        nd = md.num_decodes
        decode_only = nd == q.shape[0]
        tiles = None
        if not decode_only:  # the tiled kernel's work list (decodes run apart), once per step
            tile_m = self._prefill.prefill_tile_m(q.shape[2], q.shape[1] // kv_cache.shape[3],
                                                  kv_cache.dtype, q.device)
            dev = md.query_start_loc.device
            tiles = md.per_step(("triton_query_tiles", tile_m), lambda: self._prefill.query_tiles(
                md.query_lens_cpu, tile_m, dev, skip=nd, upload=platform_for(dev).upload))
        return self._ops.paged_attention(
            q, kv_cache, md.block_tables, md.seq_lens, md.query_start_loc, self.scale,
            decode_only=decode_only, window=self.options.sliding_window, sinks=sinks,
            tiles=tiles, num_decodes=0 if decode_only else nd)

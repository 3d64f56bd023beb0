"""Paged causal attention for mixed prefill + decode batches.

When the cache is on the CPU in f32/bf16 and the kernels are built, every query token of the
step (decodes and prompt tokens alike) runs in one call of the C kernel
``vllm/kernels/cpu/paged_attention.c``, which reads the paged cache in place. Elsewhere torch
runs it: decodes as one padded gather + SDPA (``_decode_torch``), each prompt as SDPA
(``_causal``, ``_prefill_chunk``); these are also the kernel's test references.

KV cache layout (allocated by the model runner): ``kv_cache`` [2, num_blocks, block_size,
num_kv_heads, head_dim], index 0 = keys, 1 = values, flat slot = block_id * block_size + offset.
Query head h uses kv head ``h // (num_heads // num_kv_heads)`` (HF ``repeat_kv`` order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.kernels.cpu.ops import kernels_support, paged_attention, write_kv_cache
from vllm.model_executor.forward_context import AttentionMetadata, get_attn_metadata
from vllm.model_executor.layers.scratch import scratch


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 prefix: str = ""):
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"{prefix}: num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.prefix = prefix
        self.kv_cache: torch.Tensor | None = None
        """Set by the runner: [2, num_blocks, block_size, num_kv_heads, head_dim], or None."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D]."""
        T, D = q.shape[0], self.head_dim
        q = q.view(T, self.num_heads, D)
        k = k.view(T, self.num_kv_heads, D)
        v = v.view(T, self.num_kv_heads, D)
        md = get_attn_metadata()
        if md is None:
            # No batch layout: the whole input is one sequence starting at position 0.
            return self._causal(q, k, v).reshape(T, -1)
        starts = md.query_start_loc_cpu
        if starts[-1] != T:
            raise ValueError(f"{self.prefix}: metadata covers {starts[-1]} tokens, input has {T}")
        if self.kv_cache is None:
            # Dummy/profiling run without a cache: each sequence sees only its own new tokens.
            out = torch.empty_like(q)
            for s, e in zip(starts[:-1], starts[1:]):
                out[s:e] = self._causal(q[s:e], k[s:e], v[s:e])
            return out.view(T, -1)
        on_kernels = self._cache_on_kernels()
        self._write_cache(k, v, md.slot_mapping, on_kernels)
        if on_kernels:
            rows, lens = md.token_rows_and_lens
            return paged_attention(q, self.kv_cache, md.block_tables, lens, self.scale,
                                   self.num_kv_heads, rows, self.prefix).view(T, -1)
        return self._forward_torch(q, k, v, md).view(T, -1)

    def _forward_torch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       md: AttentionMetadata) -> torch.Tensor:
        """The batch in torch, after the cache write: q [T, Hq, D], k/v [T, Hkv, D]."""
        nd, starts = md.num_decodes, md.query_start_loc_cpu
        if nd == q.shape[0] and nd:
            return self._decode_torch(q, md)             # decode-only: no copy into ``out``
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode_torch(q[:nd], md)
        for i in range(nd, md.num_seqs):
            s, e = starts[i], starts[i + 1]
            if md.seq_lens_cpu[i] == e - s:
                # Whole prompt in this step: its context is exactly the new tokens.
                out[s:e] = self._causal(q[s:e], k[s:e], v[s:e])
            else:
                out[s:e] = self._prefill_chunk(q[s:e], i, md)
        return out

    def _cache_on_kernels(self) -> bool:
        """The C kernels can read and write this layer's KV cache (CPU, f32/bf16, contiguous)."""
        cache = self.kv_cache
        return cache.is_contiguous() and kernels_support(cache.dtype, cache.device)

    def _write_cache(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                     on_kernels: bool) -> None:
        if on_kernels:
            write_kv_cache(k, v, slot_mapping, self.kv_cache, self.prefix)
            return
        # .view (not reshape) so a non-contiguous cache fails loudly instead of writing to a copy.
        shape = (-1, self.num_kv_heads, self.head_dim)
        self.kv_cache[0].view(shape).index_copy_(0, slot_mapping, k.to(self.kv_cache.dtype))
        self.kv_cache[1].view(shape).index_copy_(0, slot_mapping, v.to(self.kv_cache.dtype))

    def _gather(self, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids [..., nblk] -> (k, v) [..., length, Hkv, D] read from the paged cache.

        The copies land in a scratch buffer shared by all layers (``layers/scratch.py``).
        """
        lead, ids = block_ids.shape[:-1], block_ids.reshape(-1)
        num_blocks = self.kv_cache.shape[1]
        row = self.kv_cache[0].numel() // num_blocks                  # one block, flattened
        buf = scratch("attention.kv_gather", (2 * ids.numel() * row,), self.kv_cache.dtype,
                      self.kv_cache.device)
        out = []
        for i in (0, 1):
            dst = buf[i * ids.numel() * row:(i + 1) * ids.numel() * row].view(ids.numel(), row)
            torch.index_select(self.kv_cache[i].view(num_blocks, row), 0, ids, out=dst)
            out.append(dst.view(*lead, -1, self.num_kv_heads, self.head_dim)[..., :length, :, :])
        return out[0], out[1]

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One sequence from position 0: q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(0, 1)

    def _prefill_chunk(self, q: torch.Tensor, i: int, md: AttentionMetadata) -> torch.Tensor:
        """Sequence i's last Lq tokens attend to all earlier context plus causally to the chunk."""
        Lq, ctx = q.shape[0], md.seq_lens_cpu[i]
        nblk = -(-ctx // md.block_size)
        k, v = self._gather(md.block_tables[i, :nblk], ctx)             # [ctx, Hkv, D]
        q_pos = torch.arange(ctx - Lq, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]   # [Lq, ctx]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask[None],
            scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(0, 1)

    def _decode_torch(self, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """All decodes in one padded call: q [B, Hq, D] (one token each) -> [B, Hq, D]."""
        B = q.shape[0]
        max_len = max(md.seq_lens_cpu[:B])
        nblk = -(-max_len // md.block_size)
        k, v = self._gather(md.block_tables[:B, :nblk], max_len)      # [B, L, Hkv, D]
        lens = md.seq_lens[:B].to(q.device)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]   # [B, L]
        # GQA without repeating K/V: a kv head's query group plays the role of the query length.
        group = self.num_heads // self.num_kv_heads
        qg = q.view(B, self.num_kv_heads, group, self.head_dim)
        out = F.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
            scale=self.scale)                                          # [B, Hkv, G, D]
        return out.reshape(B, self.num_heads, self.head_dim)

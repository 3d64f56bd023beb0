"""The torch attention backend (``torch_sdpa``): any platform, any cache dtype and layout.

The KV write is an ``index_copy_`` into the cache; decodes run as one padded gather + SDPA
(``decode``), a prompt whose context is exactly its new tokens as causal SDPA (``causal``), and
a prefill chunk with history as SDPA over the gathered context with a position mask
(``prefill_chunk``). These are also the C kernel's test references, and what ``cpu_paged``
runs while torch.compile traces.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.model_executor.forward_context import AttentionMetadata
from vllm.model_executor.layers.attention.interface import AttentionImpl
from vllm.model_executor.layers.scratch import scratch


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence from position 0: q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
        scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """block_ids [..., nblk] -> (k, v) [..., length, Hkv, D] read from the paged cache.

    The copies land in a scratch buffer shared by all layers (``layers/scratch.py``): they are
    dead once the caller's attention call returns.
    """
    lead, ids = block_ids.shape[:-1], block_ids.reshape(-1)
    num_blocks, num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
    row = kv_cache[0].numel() // num_blocks                           # one block, flattened
    buf = scratch("attention.kv_gather", (2 * ids.numel() * row,), kv_cache.dtype,
                  kv_cache.device)
    out = []
    for i in (0, 1):
        dst = buf[i * ids.numel() * row:(i + 1) * ids.numel() * row].view(ids.numel(), row)
        torch.index_select(kv_cache[i].view(num_blocks, row), 0, ids, out=dst)
        out.append(dst.view(*lead, -1, num_kv_heads, head_dim)[..., :length, :, :])
    return out[0], out[1]


class TorchSdpaAttention(AttentionImpl):
    name = "torch_sdpa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        self.write_cache(k, v, md.slot_mapping, kv_cache)
        nd, starts = md.num_decodes, md.query_start_loc_cpu
        if nd == q.shape[0] and nd:
            return self.decode(q, kv_cache, md)                 # decode-only: no copy into out
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.decode(q[:nd], kv_cache, md)
        for i in range(nd, md.num_seqs):
            s, e = starts[i], starts[i + 1]
            if md.seq_lens_cpu[i] == e - s:
                # Whole prompt in this step: its context is exactly the new tokens.
                out[s:e] = causal(q[s:e], k[s:e], v[s:e], self.scale)
            else:
                out[s:e] = self.prefill_chunk(q[s:e], i, kv_cache, md)
        return out

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_cache: torch.Tensor) -> None:
        """k/v [T, Hkv, D] -> their ``slot_mapping`` [T] slots, each a real slot: PAD_SLOT_ID
        rows come only from decode graphs, which replay the C kernels."""
        # .view (not reshape) so a non-contiguous cache fails loudly instead of writing to a copy.
        shape = (-1, self.num_kv_heads, self.head_dim)
        kv_cache[0].view(shape).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].view(shape).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor,
               md: AttentionMetadata) -> torch.Tensor:
        """All decodes in one padded call: q [B, Hq, D] (one token each, sequences 0..B-1 of
        ``md``) -> [B, Hq, D]."""
        B = q.shape[0]
        max_len = max(md.seq_lens_cpu[:B])
        nblk = -(-max_len // md.block_size)
        k, v = gather_kv(kv_cache, md.block_tables[:B, :nblk], max_len)   # [B, L, Hkv, D]
        lens = md.seq_lens[:B].to(q.device)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]   # [B, L]
        # GQA without repeating K/V: a kv head's query group plays the role of the query length.
        group = self.num_heads // self.num_kv_heads
        qg = q.view(B, self.num_kv_heads, group, self.head_dim)
        out = F.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
            scale=self.scale)                                          # [B, Hkv, G, D]
        return out.reshape(B, self.num_heads, self.head_dim)

    def prefill_chunk(self, q: torch.Tensor, i: int, kv_cache: torch.Tensor,
                      md: AttentionMetadata) -> torch.Tensor:
        """Sequence i's last Lq tokens (q [Lq, Hq, D]) attend to all earlier context plus
        causally to the chunk -> [Lq, Hq, D]."""
        Lq, ctx = q.shape[0], md.seq_lens_cpu[i]
        nblk = -(-ctx // md.block_size)
        k, v = gather_kv(kv_cache, md.block_tables[i, :nblk], ctx)      # [ctx, Hkv, D]
        q_pos = torch.arange(ctx - Lq, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]   # [Lq, ctx]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask[None],
            scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(0, 1)

"""The torch attention backend (``torch_sdpa``): any platform, any cache dtype and layout.

The KV write is an ``index_copy_`` into the cache; decodes run as one padded gather + SDPA
(``decode``), a prompt whose context is exactly its new tokens as causal SDPA (``causal``), and
a prefill chunk with history as SDPA over the gathered context with a position mask
(``prefill_chunk``). A sliding window narrows the masks (``visible``); attention sinks, which
SDPA cannot express, take a plain torch softmax with the sink as an extra logit column
(``attend``); a ``kv_shared`` cache has one plane, read as both keys and values. These are
also the C kernel's test references, and what ``cpu_paged`` runs while torch.compile traces.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.model_executor.forward_context import AttentionMetadata
from vllm.model_executor.layers.attention.interface import AttentionImpl
from vllm.model_executor.layers.scratch import scratch


def visible(q_pos: torch.Tensor, k_len: int, window: int | None) -> torch.Tensor:
    """bool [Lq, k_len]: key j is visible to the query at position q_pos[i] (j <= q_pos[i], and
    j > q_pos[i] - window with a window: HF's sliding-window causal mask)."""
    j = torch.arange(k_len, device=q_pos.device)[None, :]
    mask = j <= q_pos[:, None]
    if window is not None:
        mask &= j > q_pos[:, None] - window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [..., H, Lq, D], k/v [..., Hkv, Lk, D] (H a multiple of Hkv, HF's repeat_kv order);
    mask bool broadcast to [..., H, Lq, Lk] (True = attend) -> [..., H, Lq, D] in q's dtype.
    ``sinks`` (broadcast to [..., H, Lq, 1]) adds exp(sink) to each softmax denominator with no
    value: SDPA has no such term, so that case is plain torch in f32, as HF's GPT-OSS eager
    attention (scores, mask, sink column, softmax, drop the column, weighted sum)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[-3] != k.shape[-3])
    if q.shape[-3] != k.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale   # [..., H, Lq, Lk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence from position 0: q [L, Hq, D], k/v [L, Hkv, D] -> [L, Hq, D]; ``window``
    and ``sinks`` [Hq] as in ``AttentionOptions``."""
    L = q.shape[0]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if sinks is None and (window is None or window >= L):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    else:
        mask = visible(torch.arange(L, device=q.device), L, window)
        out = attend(qt, kt, vt, mask, scale, None if sinks is None else sinks.view(-1, 1, 1))
    return out.transpose(0, 1)


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """block_ids [..., nblk] -> (k, v) [..., length, Hkv, D] read from the paged cache (v is k
    for a one-plane, ``kv_shared``, cache).

    The copies land in a scratch buffer shared by all layers (``layers/scratch.py``): they are
    dead once the caller's attention call returns.
    """
    lead, ids = block_ids.shape[:-1], block_ids.reshape(-1)
    planes, num_blocks = kv_cache.shape[0], kv_cache.shape[1]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    row = kv_cache[0].numel() // num_blocks                           # one block, flattened
    buf = scratch("attention.kv_gather", (planes * ids.numel() * row,), kv_cache.dtype,
                  kv_cache.device)
    out = []
    for i in range(planes):
        dst = buf[i * ids.numel() * row:(i + 1) * ids.numel() * row].view(ids.numel(), row)
        torch.index_select(kv_cache[i].view(num_blocks, row), 0, ids, out=dst)
        out.append(dst.view(*lead, -1, num_kv_heads, head_dim)[..., :length, :, :])
    return out[0], out[-1]


class TorchSdpaAttention(AttentionImpl):
    name = "torch_sdpa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, md: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.write_cache(k, v, md.slot_mapping, kv_cache)
        v = k if v is None else v
        nd, starts = md.num_decodes, md.query_start_loc_cpu
        if nd == q.shape[0] and nd:
            return self.decode(q, kv_cache, md, sinks)          # decode-only: no copy into out
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.decode(q[:nd], kv_cache, md, sinks)
        window = self.options.sliding_window
        for i in range(nd, md.num_seqs):
            s, e = starts[i], starts[i + 1]
            if md.seq_lens_cpu[i] == e - s:
                # Whole prompt in this step: its context is exactly the new tokens.
                out[s:e] = causal(q[s:e], k[s:e], v[s:e], self.scale, window, sinks)
            else:
                out[s:e] = self.prefill_chunk(q[s:e], i, kv_cache, md, sinks)
        return out

    def write_cache(self, k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor,
                    kv_cache: torch.Tensor) -> None:
        """k/v [T, Hkv, D] -> their ``slot_mapping`` [T] slots, each a real slot: PAD_SLOT_ID
        rows come only from decode graphs, which replay the C kernels. v None (a one-plane
        cache): keys only."""
        # .view (not reshape) so a non-contiguous cache fails loudly instead of writing to a copy.
        shape = (-1, self.num_kv_heads, self.head_dim)
        kv_cache[0].view(shape).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        if v is not None:
            kv_cache[1].view(shape).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """All decodes in one padded call: q [B, Hq, D] (one token each, sequences 0..B-1 of
        ``md``) -> [B, Hq, D]."""
        B = q.shape[0]
        max_len = max(md.seq_lens_cpu[:B])
        nblk = -(-max_len // md.block_size)
        k, v = gather_kv(kv_cache, md.block_tables[:B, :nblk], max_len)   # [B, L, Hkv, D]
        lens = md.seq_lens[:B].to(q.device)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]   # [B, L]
        if self.options.sliding_window is not None:
            mask &= torch.arange(max_len, device=q.device)[None, :] >= \
                lens[:, None] - self.options.sliding_window
        # GQA without repeating K/V: a kv head's query group plays the role of the query length.
        group = self.num_heads // self.num_kv_heads
        qg = q.view(B, self.num_kv_heads, group, self.head_dim)
        out = attend(qg, k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :],
                     self.scale, None if sinks is None else sinks.view(self.num_kv_heads, group, 1))
        return out.reshape(B, self.num_heads, self.head_dim)              # out [B, Hkv, G, D]

    def prefill_chunk(self, q: torch.Tensor, i: int, kv_cache: torch.Tensor,
                      md: AttentionMetadata, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Sequence i's last Lq tokens (q [Lq, Hq, D]) attend to all earlier context plus
        causally to the chunk (within the window, if any) -> [Lq, Hq, D]."""
        Lq, ctx = q.shape[0], md.seq_lens_cpu[i]
        nblk = -(-ctx // md.block_size)
        k, v = gather_kv(kv_cache, md.block_tables[i, :nblk], ctx)      # [ctx, Hkv, D]
        q_pos = torch.arange(ctx - Lq, ctx, device=q.device)
        mask = visible(q_pos, ctx, self.options.sliding_window)         # [Lq, ctx]
        out = attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask[None],
                     self.scale, None if sinks is None else sinks.view(-1, 1, 1))
        return out.transpose(0, 1)

"""Python wrappers of the CPU C kernels (the expert kernel's is ``fused_moe/cpu_kernel.py``, a
MoE backend): the packed weight layout, dense linear, paged attention and KV writes,
RMSNorm, rotary, argmax, softmax top-k routing, the MoE combine and the gated activations. Each
checks what the C side cannot and raises with the layer's name."""
from __future__ import annotations

import torch

from vllm.kernels.cpu.build import load_cpu_kernels
from vllm.kernels.cpu.graph import launch

KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""Dtypes the C kernels take, and the code they pass for each."""


def prepack(w: torch.Tensor, pairs: bool | None = None) -> torch.Tensor:
    """Linear weight(s) [..., cols, n] (out, in) -> packed [..., cols * n]: for each block of
    ``pack_block_width()`` output columns, that block's [n, width] transpose, row-major (f32),
    or in bf16 its row pairs interleaved, [n // 2, width, 2], then the last row when n is odd
    (the layouts ``gemm.h`` reads as one stream per block). ``pairs`` (default: bf16 only)
    asks for the interleaved layout whatever the dtype (the FP8 codes of ``qgemm.h``)."""
    block = load_cpu_kernels().pack_block_width()
    cols, n, lead = w.shape[-2], w.shape[-1], w.shape[:-2]
    even = n - n % 2
    interleave = w.dtype == torch.bfloat16 if pairs is None else pairs
    parts = []
    for c in range(0, cols, block):
        blk = w[..., c:c + block, :]                                    # [..., width, n]
        if not interleave:
            parts.append(blk.transpose(-1, -2).reshape(*lead, -1))
            continue
        pairs = blk[..., :even].reshape(*lead, blk.shape[-2], even // 2, 2)
        parts.append(pairs.transpose(-3, -2).reshape(*lead, -1))      # [..., n/2, width, 2]
        if n % 2:
            parts.append(blk[..., even])                                # [..., width]
    return torch.cat(parts, dim=-1).contiguous()


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes [cols, n] (cols % 16 == 0, n even) -> qgemm_fp4.h's stream: gemm.h's
    column blocks; in each, pair of rows p is 16u-byte units of u 16-column vectors (u = width
    // 16 in a full block, 1 in a narrower last one), where slot L = 32v + 2l + r (vector v,
    column l, row 2p + r) is nibble L // 8u of 16-bit word L % 8u (little-endian): a shift and
    one word-table permute turn a unit's words into a bf16 pair vector."""
    cols, n = codes.shape
    if cols % 16 or n % 2:
        raise ValueError(f"fp4 codes [{cols}, {n}]: need cols % 16 == 0 and an even input dim")
    block, parts = load_cpu_kernels().pack_block_width(), []
    for c in range(0, cols, block):
        blk = codes[c:c + block]
        u = block // 16 if blk.shape[0] == block else 1
        units = blk.shape[0] // (16 * u)
        slots = blk.reshape(units, u, 16, n // 2, 2).permute(3, 0, 1, 2, 4)   # [p, unit, L]
        nib = slots.reshape(n // 2, units, 4, 8 * u)                      # nibble, word
        words = torch.stack([nib[:, :, 0] | (nib[:, :, 1] << 4),         # little-endian bytes
                             nib[:, :, 2] | (nib[:, :, 3] << 4)], dim=-1)
        parts.append(words.reshape(-1))
    return torch.cat(parts).contiguous()


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., n] as a contiguous [rows, n] (no call when it already is one: each torch call
    costs about a microsecond here, and a decode step makes dozens)."""
    return x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, n).contiguous()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` contiguous in ``dtype`` (no call when it already is)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def dense_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) with ``packed = prepack(w)``: x [..., n] -> [..., out_features]."""
    n = x.shape[-1]
    if packed.numel() != out_features * n or packed.dtype != x.dtype:
        raise ValueError(f"dense_linear: packed weight ({packed.numel()} x {packed.dtype}) does not "
                         f"match x [..., {n}] ({x.dtype}) and out_features={out_features}")
    if bias is not None:
        if bias.numel() != out_features:
            raise ValueError(f"dense_linear: bias has {bias.numel()} elements, out_features="
                             f"{out_features}")
        bias = _as(bias, x.dtype)
    x2 = _rows(x, n)
    out = torch.empty(x2.shape[0], out_features, dtype=x.dtype, device=x.device)
    rc = launch(
        "dense_linear", x2.data_ptr(), packed.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(), x2.shape[0], n, out_features, KERNEL_DTYPES[x.dtype])
    if rc:
        raise MemoryError("dense_linear: the kernel could not allocate its scratch")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm over the last dim (f32 statistics, cast back, then scale): same shape/dtype."""
    n = x.shape[-1]
    if weight.numel() != n:
        raise ValueError(f"rms_norm: weight has {weight.numel()} elements, x has {n} per row")
    x, weight = x.contiguous(), _as(weight, x.dtype)
    out = torch.empty_like(x)
    launch("rms_norm", x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                x.numel() // max(n, 1), n, eps, KERNEL_DTYPES[x.dtype])
    return out


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """positions [T] int64, inv_freq [rd/2] -> [T, rd] f32: per row cos(a) * scaling then
    sin(a) * scaling, a = position * inv_freq (f32). What ``rotary_embedding`` reads."""
    positions, inv_freq = _as(positions, torch.int64), _as(inv_freq, torch.float32)
    T, h = positions.shape[0], inv_freq.numel()
    cs = torch.empty(T, 2 * h, dtype=torch.float32)
    launch("rope_cos_sin", positions.data_ptr(), inv_freq.data_ptr(), scaling, T, h,
                                    cs.data_ptr())
    return cs


def rotary_embedding(cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                     rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE: cos_sin [T, rotary_dim] from ``rope_cos_sin``, q [T, Hq*D],
    k [T, Hkv*D] -> new (q, k)."""
    T = cos_sin.shape[0]
    if q.shape[0] != T or k.shape[0] != T or q.shape[-1] % head_dim or k.shape[-1] % head_dim \
            or cos_sin.shape[-1] != rotary_dim or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_embedding: q {tuple(q.shape)}, k {tuple(k.shape)}, cos_sin "
                         f"{tuple(cos_sin.shape)} do not fit head_dim={head_dim}, "
                         f"rotary_dim={rotary_dim}")
    q, k, cos_sin = q.contiguous(), k.contiguous(), _as(cos_sin, torch.float32)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    launch(
        "rotary_embedding", cos_sin.data_ptr(), q.data_ptr(), k.data_ptr(), q_out.data_ptr(),
        k_out.data_ptr(), T,
        q.shape[-1] // head_dim, k.shape[-1] // head_dim, head_dim, rotary_dim,
        KERNEL_DTYPES[q.dtype])
    return q_out, k_out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for f32 [rows, n] on CPU (first maximum; NaN counts as the maximum)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    launch("argmax_rows", x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    lens: torch.Tensor, scale: float, num_kv_heads: int,
                    rows: torch.Tensor | None = None, prefix: str = "", *,
                    window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Query tokens over the paged cache: q [B, Hq, D]; kv_cache [2, blocks, block_size, Hkv,
    D], or [1, ...] for a shared K=V (MLA) cache, read as keys and values; block_tables
    [S, max_blocks] int64; query b attends tokens [max(0, lens[b] - window), lens[b]) (all from
    0 without a window) of sequence rows[b] (b when rows is None; lens and rows [>=B] int64, the
    first B read) -> [B, Hq, D]. A decode's lens is its sequence length; a prompt token's is its
    position + 1. ``sinks`` [Hq]: a logit per query head in each softmax denominator, with no
    value (read as f32)."""
    B, num_heads, head_dim = q.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] not in (1, 2) \
            or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim) or len(lens) < B \
            or (rows is None and len(block_tables) < B) or (rows is not None and len(rows) < B) \
            or num_heads % num_kv_heads or (sinks is not None and sinks.numel() != num_heads) \
            or (window is not None and window < 1):
        raise ValueError(f"{prefix}: paged_attention: q {tuple(q.shape)}, kv_cache "
                         f"{tuple(kv_cache.shape)}, {len(lens)} lens, {len(block_tables)} "
                         f"block tables, sinks {None if sinks is None else tuple(sinks.shape)}, "
                         f"window {window} do not fit num_kv_heads={num_kv_heads}")
    q = _as(q, kv_cache.dtype)
    tables, lens = _as(block_tables, torch.int64), _as(lens, torch.int64)
    rows = _as(rows, torch.int64) if rows is not None else None
    sinks = _as(sinks, torch.float32) if sinks is not None else None
    out = torch.empty_like(q)
    rc = launch(
        "paged_attention", q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), tables.shape[0],
        tables.stride(0),
        rows.data_ptr() if rows is not None else None, lens.data_ptr(), out.data_ptr(), B,
        num_heads, num_kv_heads, head_dim, kv_cache.shape[2], kv_cache.shape[1], scale,
        KERNEL_DTYPES[kv_cache.dtype], sinks.data_ptr() if sinks is not None else None,
        window or 0, int(kv_cache.shape[0] == 1))
    if rc:
        raise RuntimeError(f"{prefix}: paged_attention failed ({rc}): "
                           + ("out of memory" if rc == -1 else
                              "a query's sequence, length or block id is outside the block "
                              "tables or the KV cache"))
    return out


def write_kv_cache(k: torch.Tensor, v: torch.Tensor | None, slot_mapping: torch.Tensor,
                   kv_cache: torch.Tensor, prefix: str = "") -> None:
    """kv_cache[0] / [1] at flat slot s <- k / v rows: k, v [T, Hkv, D]; slot_mapping [T]. v is
    None exactly for a one-plane (shared K=V) cache [1, ...]: keys only. A row whose slot is
    ``PAD_SLOT_ID`` (-1, a padding row of a decode graph) is not written."""
    planes = 1 if v is None else 2
    if (v is not None and k.shape != v.shape) or kv_cache.shape[0] != planes or \
            tuple(k.shape[1:]) != tuple(kv_cache.shape[3:]) or slot_mapping.numel() != k.shape[0]:
        raise ValueError(f"{prefix}: write_kv_cache: k {tuple(k.shape)}, v "
                         f"{None if v is None else tuple(v.shape)}, {slot_mapping.numel()} slots "
                         f"do not fit kv_cache {tuple(kv_cache.shape)}")
    k = _as(k, kv_cache.dtype)
    v = _as(v, kv_cache.dtype) if v is not None else None
    slots = _as(slot_mapping, torch.int64)
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    rc = launch("write_kv_cache", k.data_ptr(), v.data_ptr() if v is not None else None,
                slots.data_ptr(), kv_cache.data_ptr(), k.shape[0], num_slots,
                k[0].numel() * k.element_size() if len(k) else 0)
    if rc:
        raise RuntimeError(f"{prefix}: a KV slot is outside the cache ({num_slots} slots)")


def topk_softmax(logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: logits [T, E] -> (weights [T, top_k] f32, ids [T, top_k] int64),
    largest score first; weights renormalised to sum 1 when ``renormalize``."""
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"topk_softmax: top_k={top_k} is invalid: must be in [1, {E}]")
    logits = logits.contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32)
    ids = torch.empty(T, top_k, dtype=torch.int64)
    launch("topk_softmax", logits.data_ptr(), T, E, top_k, int(renormalize),
                                    KERNEL_DTYPES[logits.dtype], weights.data_ptr(),
                                    ids.data_ptr())
    return weights, ids


def moe_sum(pairs: torch.Tensor) -> torch.Tensor:
    """``pairs.sum(dim=1)`` for [T, K, H] -> [T, H], summed in k order."""
    if pairs.dim() != 3:
        raise ValueError(f"moe_sum: pairs must be [T, K, H], got {tuple(pairs.shape)}")
    T, K, H = pairs.shape
    pairs = pairs.contiguous()
    out = torch.empty(T, H, dtype=pairs.dtype, device=pairs.device)
    launch("moe_sum", pairs.data_ptr(), out.data_ptr(), T, K, H,
                               KERNEL_DTYPES[pairs.dtype])
    return out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` with the model dtype's roundings (``activation.c``): gate, up
    [..., N] -> [..., N]."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_and_mul: gate {tuple(gate.shape)} {gate.dtype} and up "
                         f"{tuple(up.shape)} {up.dtype} must match")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    N = gate.shape[-1]
    launch("silu_and_mul", gate.data_ptr(), up.data_ptr(), out.data_ptr(),
           gate.numel() // max(N, 1), N, KERNEL_DTYPES[gate.dtype])
    return out


def sigmoid_gate_add(x: torch.Tensor, gate_logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + torch.sigmoid(gate_logits) * y`` with the model dtype's roundings
    (``activation.c``): x, y [T, H], gate_logits [T, 1] -> [T, H]."""
    if x.dim() != 2 or x.shape != y.shape or tuple(gate_logits.shape) != (x.shape[0], 1) \
            or not x.dtype == y.dtype == gate_logits.dtype:
        raise ValueError(f"sigmoid_gate_add: x {tuple(x.shape)}, y {tuple(y.shape)} must be one "
                         f"[T, H] shape and gate_logits {tuple(gate_logits.shape)} [T, 1], "
                         "all in one dtype")
    x, gate_logits, y = x.contiguous(), gate_logits.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    launch("sigmoid_gate_add", x.data_ptr(), gate_logits.data_ptr(), y.data_ptr(), out.data_ptr(),
           x.shape[0], x.shape[1], KERNEL_DTYPES[x.dtype])
    return out

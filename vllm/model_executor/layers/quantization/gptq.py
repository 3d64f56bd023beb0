"""INT4 weight-only GPTQ experts (AutoGPTQ / GPTQModel checkpoint layout).

Checkpoint tensors per expert projection (out x in, G = ceil(in / group_size)):
  qweight  int32 [in/8, out]   4-bit values packed along the input dim (low bits first)
  qzeros   int32 [G, out/8]    4-bit zero points packed along the output dim; checkpoint_format
                               "gptq" (v1) stores zero - 1, "gptq_v2" stores zero
  scales   float16 [G, out]
  g_idx    int32 [in]          group of each input channel (a permutation of groups under
                               desc_act; arange(in) // group_size otherwise, then optional)
weight[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o]); symmetric checkpoints store
zero = 8 everywhere. Activations stay in the model dtype (W4A16).

Layer layout: the checkpoint's [in, out]-major tensors are transposed so output rows lead and
gate/up fuse as halves of dim 0: w13_qweight [E, 2N, K/8], w13_qzeros [E, 2N/8, G13],
w13_scales [E, 2N, G13], w13_g_idx [E, 2, K] (gate, up); w2_qweight [E, K, N/8],
w2_qzeros [E, K/8, G2], w2_scales [E, K, G2], w2_g_idx [E, 1, N].
"""
from __future__ import annotations

import torch

from vllm.kernels.cpu.qgemv import QuantRows
from vllm.model_executor.layers.quantization.base import MoEShape
from vllm.model_executor.layers.quantization.moe_ref import (CheckpointTensor,
                                                             QuantizedFusedMoEMethod, TensorSpec,
                                                             check_dtype, require_multiple)
from vllm.model_executor.layers.quantization.utils import ceil_div, pack_int4, unpack_int4

GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}
"""checkpoint_format -> offset added to the stored zero point."""


class GptqMoEMethod(QuantizedFusedMoEMethod):
    scheme = "w4a16-gptq"

    def __init__(self, group_size: int, sym: bool, desc_act: bool,
                 checkpoint_format: str = "gptq", activation: str = "silu"):
        super().__init__(activation)
        if not (group_size == -1 or group_size > 0):
            raise ValueError(f"gptq group_size={group_size!r} is invalid: must be -1 or > 0")
        if checkpoint_format not in GPTQ_FORMATS:
            raise ValueError(f"gptq checkpoint_format={checkpoint_format!r} is invalid: must be "
                             f"one of {sorted(GPTQ_FORMATS)}")
        self.group_size, self.sym, self.desc_act = group_size, sym, desc_act
        self.zero_offset = GPTQ_FORMATS[checkpoint_format]
        self.checkpoint_tensors = (CheckpointTensor("qweight"), CheckpointTensor("qzeros"),
                                   CheckpointTensor("scales"),
                                   CheckpointTensor("g_idx", required=desc_act))
        self.contiguous_groups: dict[str, bool] = {}
        """Per projection ("w13", "w2"): whether every expert processed so far has g_idx =
        column // group size (no act order); kernels may then read one group per tile."""

    def _groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else ceil_div(in_features, self.group_size)

    def layout(self, shape: MoEShape) -> dict[str, TensorSpec]:
        K, N = shape.hidden_size, shape.intermediate_size
        for what, v in (("hidden_size", K), ("moe intermediate_size", N)):
            require_multiple(what, v, 8, "gptq int4")
        G13, G2 = self._groups(K), self._groups(N)
        i32, f16 = torch.int32, torch.float16
        return {"w13_qweight": TensorSpec((2 * N, K // 8), i32),
                "w13_qzeros": TensorSpec((2 * N // 8, G13), i32),
                "w13_scales": TensorSpec((2 * N, G13), f16),
                "w13_g_idx": TensorSpec((2, K), i32),
                "w2_qweight": TensorSpec((K, N // 8), i32),
                "w2_qzeros": TensorSpec((K // 8, G2), i32),
                "w2_scales": TensorSpec((K, G2), f16),
                "w2_g_idx": TensorSpec((1, N), i32)}

    def create_weights(self, layer, shape, device) -> None:
        super().create_weights(layer, shape, device)
        # Checkpoints without desc_act may omit g_idx: default to contiguous groups.
        for name, width in (("w13_g_idx", shape.hidden_size), ("w2_g_idx", shape.intermediate_size)):
            gs = width if self.group_size == -1 else self.group_size
            getattr(layer, name).data.copy_(torch.arange(width, dtype=torch.int32) // gs)

    def load_transform(self, suffix: str, proj: str, tensor: torch.Tensor) -> torch.Tensor:
        if suffix == "scales":
            check_dtype(suffix, tensor, torch.float16, torch.bfloat16, torch.float32)
            return tensor.t()
        check_dtype(suffix, tensor, torch.int32, *((torch.int64,) if suffix == "g_idx" else ()))
        return tensor.unsqueeze(0) if suffix == "g_idx" else tensor.t()

    def process_expert(self, tensors):
        # Bounds-check g_idx once per expert at load time (the forward gathers with it).
        for name in ("w13", "w2"):
            g, G = tensors[f"{name}_g_idx"], tensors[f"{name}_scales"].shape[1]
            if g.numel() and (int(g.min()) < 0 or int(g.max()) >= G):
                raise ValueError(f"{name}_g_idx has values in [{int(g.min())}, {int(g.max())}], "
                                 f"but the layer has {G} group(s) per row: must be in [0, {G - 1}]")
            width = g.shape[-1]
            want = torch.arange(width, dtype=g.dtype, device=g.device) // self.group_width(width)
            self.contiguous_groups[name] = self.contiguous_groups.get(name, True) and \
                bool(torch.equal(g, want.expand_as(g)))
        return tensors

    def group_width(self, in_features: int) -> int:
        """Input columns per group (all of them for group_size -1)."""
        return in_features if self.group_size == -1 else self.group_size

    def unpacked_weight(self, qweight: torch.Tensor) -> torch.Tensor:
        """[R, C/8] int32 words -> [R, C] values (a repacking subclass changes this)."""
        return unpack_int4(qweight, dim=1)

    def _dequant(self, qweight, qzeros, scales, g_idx) -> torch.Tensor:
        """Rows of one fused tensor -> float32 [R, C]; g_idx [H, C] with R/H rows per half."""
        q = self.unpacked_weight(qweight)                                # [R, C]
        zeros = unpack_int4(qzeros, dim=0) + self.zero_offset            # [R, G]
        R, H = q.shape[0], g_idx.shape[0]
        halves = []
        for h in range(H):
            rows, gi = slice(h * R // H, (h + 1) * R // H), g_idx[h].long()   # [C] group ids
            s = scales[rows].float().index_select(1, gi)                  # [R/H, C]
            z = zeros[rows].index_select(1, gi)
            halves.append((q[rows] - z).float() * s)
        return torch.cat(halves)

    def dequantize(self, t, dtype):
        w13 = self._dequant(t["w13_qweight"], t["w13_qzeros"], t["w13_scales"], t["w13_g_idx"])
        w2 = self._dequant(t["w2_qweight"], t["w2_qzeros"], t["w2_scales"], t["w2_g_idx"])
        return w13.to(dtype), w2.to(dtype)

    def host_rows(self, t):
        """qweight, scales (as float32) and the packed qzeros as they are, for GPTQ's own packing
        (not a repacking subclass's ``unpacked_weight``) with groups of whole words; with act
        order (g_idx not column // group size in some expert) g_idx goes along, and each
        column's group comes from it."""
        if type(self).unpacked_weight is not GptqMoEMethod.unpacked_weight:
            return None
        rows = []
        for p in ("w13", "w2"):
            q = t[f"{p}_qweight"]
            group = self.group_width(q.shape[1] * 8)
            if group % 8:
                return None
            act_order = not self.contiguous_groups.get(p, False)
            rows.append(QuantRows("int4", q, t[f"{p}_scales"].float().contiguous(), 1, group,
                                  t[f"{p}_qzeros"], self.zero_offset,
                                  g_idx=t[f"{p}_g_idx"].contiguous() if act_order else None))
        return rows[0], rows[1]

    def cpu_kernel_layout(self):
        """The C expert kernel's view of these tensors (fused_moe/cpu_kernel.py, qgemm.h): int4
        values, f32 scale and zero-point tables [groups, columns], g_idx as loaded; under act
        order ``pack`` sorts each projection's input rows by group and keeps the permutation
        beside the groups, and the kernel gathers the activations by it."""
        from vllm.model_executor.layers.fused_moe.cpu_kernel import QuantLayout
        roles = {"w13": "qweight", "w2": "qweight", "s13": "scales", "s2": "scales",
                 "z13": "qzeros", "z2": "qzeros", "g13": "g_idx", "g2": "g_idx"}
        return QuantLayout("int4", {r: f"{'w13' if r.endswith('13') else 'w2'}_{n}"
                                    for r, n in roles.items()}, self._kernel_tensors)

    def _kernel_tensors(self, t):
        """The values ``_dequant`` computes with: q, zero (with the format's offset), scale."""
        out = {}
        for p in ("w13", "w2"):
            out[p] = self.unpacked_weight(t[f"{p}_qweight"]).to(torch.uint8)         # [R, C]
            zeros = unpack_int4(t[f"{p}_qzeros"], dim=0) + self.zero_offset           # [R, G]
            out[f"s{p[1:]}"] = t[f"{p}_scales"].float().t()                          # [G, R]
            out[f"z{p[1:]}"] = zeros.float().t()
            out[f"g{p[1:]}"] = t[f"{p}_g_idx"]
        return out


# ---- offline quantizer (round to nearest in the GPTQ storage format) ------------------------
def quantize_gptq(w: torch.Tensor, group_size: int, sym: bool, desc_act: bool = False,
                  checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """RTN int4 of one weight [out, in] -> {qweight, qzeros, scales, g_idx} as a GPTQ checkpoint
    stores them. No calibration data: with ``desc_act`` the group order follows the input columns'
    weight norm (largest first), a stand-in for GPTQ's Hessian-diagonal order."""
    w = w.float()
    out, inp = w.shape
    dev = {"device": w.device}                 # w's, not a default device a caller may set
    gs = inp if group_size == -1 else group_size
    order = (w.norm(dim=0).argsort(descending=True, stable=True) if desc_act
             else torch.arange(inp, **dev))
    g_idx = torch.empty(inp, dtype=torch.int32, **dev)
    g_idx[order] = (torch.arange(inp, **dev) // gs).to(torch.int32)     # [in] group of column
    G = ceil_div(inp, gs)
    idx = g_idx.long().unsqueeze(1).expand(inp, out)                    # [in, out]
    lo = torch.zeros(G, out, **dev).scatter_reduce_(0, idx, w.t(), "amin", include_self=False)
    hi = torch.zeros(G, out, **dev).scatter_reduce_(0, idx, w.t(), "amax", include_self=False)
    if sym:
        scale = (torch.maximum(hi.abs(), lo.abs()) / 7.5).clamp(min=1e-8)   # [G, out]
        zero = torch.full_like(scale, 8.0)
    else:
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        # v1 stores zero - 1 in 4 bits, so zero must be in [1, 15] there.
        zero = (-lo / scale).round().clamp(GPTQ_FORMATS[checkpoint_format], 15)
    scale = scale.half()
    s_col, z_col = scale.float()[g_idx.long()], zero[g_idx.long()]       # [in, out]
    q = (w.t() / s_col + z_col).round().clamp(0, 15).to(torch.int32)    # [in, out]
    stored_zero = zero.to(torch.int32) - GPTQ_FORMATS[checkpoint_format]
    return {"qweight": pack_int4(q, dim=0), "qzeros": pack_int4(stored_zero, dim=1),
            "scales": scale, "g_idx": g_idx}

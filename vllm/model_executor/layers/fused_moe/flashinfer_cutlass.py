"""The "flashinfer_cutlass" MoE expert backend: FlashInfer's CUTLASS fused MoE
(``flashinfer.fused_moe.cutlass_fused_moe``, package flashinfer-python, the optional ``cuda``
extra) behind the ``MoEExperts`` pair contract. NOT YET RUN ON A GPU, and never chosen by "auto":
only ``moe_backend="flashinfer_cutlass"`` selects it.

Schemes: unquantized fp16/bf16 (SM 89, 90, 10x, 11x, 12x); ``fp8-block`` 128x128, bf16, SM 90
only (FlashInfer quantizes the activations per 1x128 group itself: W8A8); ``nvfp4`` fp16/bf16 on
SM 10x-12x (W4A4: activations are quantized to FP4 with the checkpoint's static input scales);
``mxfp4`` (GPT-OSS) bf16 on SM 90: FlashInfer's mixed-input W4A16 path (``isWFP4A16Quant``:
``use_w4_group_scaling=True``, uint8 weights, bf16 activations kept as they are), with biases
and swigluoai. ``w4a16-gptq`` is not run (``UNMAPPED_SCHEMES``).

The contract, read from flashinfer-python 0.7.2 (``flashinfer/fused_moe/core.py``:
``cutlass_fused_moe``, ``cutlass_fused_moe_workspace_size``; ``fused_moe/prepare.py``:
``interleave_moe_{weights,scales}_for_sm90_mixed_gemm``, ``prepare_cutlass_w4a16_weights``;
``data/csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu``: dtypes, shapes,
``getQuantParams``; ``cutlass_fused_moe_kernels.cuh``: the activation reads the gate at offset
``inter_size``, the linear (up) half first; finalize skips experts outside [0, G) and adds fc2's
bias before the router weight):
  fc1 [G, 2N, H] is [up; gate] (w3 then w1), ours is [gate; up]: ``pack`` swaps the halves (of
  every w13 tensor, ``flashinfer_cutlass_layouts.py``); fc2 [G, H, N] as ours.
  fp8-block quant_scales = [fc1 scales f32 [G, 2N/128, H/128], fc2 [G, H/128, N/128]], dequant
  multiplies. nvfp4: weights are our uint8 e2m1 pairs (low nibble first) viewed as int64;
  quant_scales = [fc1 activation global scale (1 / input_scale), fc1 block scales (e4m3 in the
  128x4-tiled layout, viewed as int32), fc1 alpha [G] (= weight global * input scale), the same
  three for fc2]; one fc1 global scale per expert, so gate and up share one.
  mxfp4: weights uint8 e2m1 pairs [G, 2N, H/2] and [G, H, N/2] (the binding's inner-dim
  multiplier 2), in the byte order of FlashInfer's ``interleave_moe_weights_for_sm90_mixed_gemm``
  (quant_type "fp4", a CUDA kernel: ``pack`` runs it, on the GPU for a host tensor); quant_scales
  = [fc1, fc2] e8m0 bytes [G, rows, K/32] folded by ``interleave_moe_scales_for_sm90_mixed_gemm``
  (group 32, ``wfp4a16_group_size``), viewed as int32; no alpha. H and N are padded to 128
  (``MXFP4_ALIGN``; GPT-OSS's 2880 becomes 2944) with zero weights; x is padded and the output
  sliced per call.
  token_final_scales f32 multiplies fc2's output plus its bias; biases are in the output dtype.

Pairs: each (token, k) pair is its own row with top_k = 1 (x repeated K times, which the kernel
would expand to anyway), so ``out[t, k]`` is that pair alone and ``combine_pairs`` reduces in k
order as for every backend. The ids are expert ids or the expert cache's slot ids: every weight
and scale above is read at the same row, and ``pack`` works per expert (the interleave and the
scale fold included), so a slot holds its expert's packed bytes and a miss copies them as they
are. Rows with id -1 are outside the kernel's local experts [0, G), which it skips; their
``out`` entries keep what they held (a ``torch.where``), so a cache wave leaves the other waves'
pairs untouched.

CUDA graphs: a call does host work (the JIT build of the module on first use, FlashInfer's
runner and tactic lookup, shape checks) and, without ``workspace_buffer``, allocates its
workspace. The capture path's eager warm-up (``modular_kernel.capture_warm_up``, entered by
``worker/cuda_graphs.py`` before each capture) runs the kernel once at the largest captured
batch and sizes one workspace per device shared by every layer; captured calls then reuse it.
A capture larger than that raises (the capture is refused, decode stays eager). The autotuner
is not run: FlashInfer's default tactics.
"""
from __future__ import annotations

import inspect
from types import ModuleType

import torch
import torch.nn.functional as F

from vllm.kernels.flashinfer import INSTALL_HINT, flashinfer_refusal, import_flashinfer
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.flashinfer_cutlass_layouts import (  # noqa: F401
    MXFP4_ALIGN, fp8_block_to_flashinfer, mxfp4_to_flashinfer, nvfp4_to_flashinfer,
    swap_halves, swizzle_block_scales, unquantized_to_flashinfer)
from vllm.model_executor.layers.fused_moe.modular_kernel import (GATED_ACTIVATIONS,
                                                                 MoEActivation, MoEExperts,
                                                                 MoEKernelQuery,
                                                                 capture_warm_up_tokens)
from vllm.model_executor.layers.fused_moe.workspace import SharedWorkspace, capturing
from vllm.platforms import platform_for

logger = init_logger(__name__)

FLASHINFER_SCHEMES = ("unquantized", "fp8-block", "nvfp4", "mxfp4")
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_SM = {"unquantized": (89, 90, 100, 103, 107, 110, 120, 121),
                 "fp8-block": (90,),
                 "nvfp4": (100, 103, 107, 110, 120, 121),
                 "mxfp4": (90,)}
"""SMs per scheme: those FlashInfer builds a CUTLASS fused-MoE module for
(``get_cutlass_fused_moe_module``); FP8 block scaling is SM90 only, NVFP4 SM10x-12x, and MXFP4
here is the SM90 mixed-input W4A16 GEMM (``use_sm90_mixed_input_gemm``)."""
BF16_ONLY = ("fp8-block", "mxfp4")
"""Schemes FlashInfer runs with bfloat16 activations only (the binding refuses fp16 for W4A16
MXFP4: "FP16 is incompatible with the interleaved weight layout")."""
UNMAPPED_SCHEMES = {
    "w4a16-gptq": "FlashInfer's INT4 W4A16 path (use_packed_weights=True with bf16/fp16 "
                  "activations: CutlassMoeFCRunner<bf16, uint4b_t>) is not an SM90 mixed-input "
                  "GEMM (isValidHopperMOESpecialisation pairs uint4 with FP8 activations only); "
                  "it runs TensorRT-LLM's SM80 fpA_intB grouped GEMM, whose ColumnMajorTile"
                  "Interleave<64, 4> weight layout FlashInfer neither prepares nor tests, and its "
                  "SM90 int4 interleave is for W4A8 (FP8 activations); use 'triton' or 'torch'"}
"""Schemes this backend does not run, and why (read from FlashInfer 0.7.2's sources)."""
MXFP4_API = ("interleave_moe_weights_for_sm90_mixed_gemm",
             "interleave_moe_scales_for_sm90_mixed_gemm")
"""``flashinfer.fused_moe`` functions the MXFP4 layout needs (added with its SM90 W4A16 path)."""
_SCHEME_FLAGS = {"fp8-block": {"use_deepseek_fp8_block_scale": True},
                 "mxfp4": {"use_w4_group_scaling": True}}
"""Keywords of ``cutlass_fused_moe`` and its workspace size that pick the scheme's runner."""
_STATEFUL_WORKSPACE = {"fp8-block"}
"""Schemes whose workspace FlashInfer sizes from the most rows its runner has seen, not from
the call's (the DeepSeek FP8 block-scale GEMM keeps a running maximum)."""
_INNER_PER_ELEMENT = {"nvfp4": 16, "mxfp4": 2}
"""Inputs per element of fc2's last dim as passed (int64 of 16 FP4, uint8 of 2)."""
_ACTIVATION_TYPES = {"silu": "Swiglu", "gelu": "Geglu", "swigluoai": "SwigluBias",
                     "relu2_no_mul": "Relu2"}
"""Ours -> FlashInfer's ActivationType. Geglu is CUTLASS's erf GELU, as F.gelu's default;
SwigluBias is GPT-OSS's clamped (up + beta) * gate * sigmoid(alpha * gate) with beta = 1."""


def flashinfer_cutlass_refusal(q: MoEKernelQuery) -> str | None:
    """The registry's extra check (after schemes, platforms and dtypes): the scheme's SMs and
    dtypes, biases, gating, TMA / block alignment, and the package."""
    if q.scheme in UNMAPPED_SCHEMES:
        return f"it does not run {q.scheme}: {UNMAPPED_SCHEMES[q.scheme]}"
    cap = q.platform.get_device_capability()
    sm = cap.to_int() if cap is not None else None
    allowed = FLASHINFER_SM[q.scheme]
    if sm not in allowed:
        return (f"it runs {q.scheme} on SM {', '.join(map(str, allowed))}, not "
                + (f"SM {sm}" if sm is not None else "a device without a compute capability"))
    reason = _scheme_refusal(q)
    if reason is None:
        reason = flashinfer_refusal()
    return reason


def _scheme_refusal(q: MoEKernelQuery) -> str | None:
    if q.scheme in BF16_ONLY and q.dtype != torch.bfloat16:
        return f"it runs {q.scheme} with bfloat16 activations only, not {q.dtype}"
    if q.scheme == "fp8-block" and _cuda_version() < (12, 8):
        return (f"it runs fp8-block with a CUDA 12.8 or newer build of torch, not CUDA "
                f"{torch.version.cuda}")
    if q.scheme not in ("unquantized", "mxfp4") and q.has_bias:
        return f"it adds expert biases to unquantized and mxfp4 experts only, not {q.scheme}"
    if q.scheme == "mxfp4":
        if q.activation not in GATED_ACTIVATIONS:
            return f"it runs mxfp4 with gated activations only, not {q.activation!r}"
        return None                       # any size the method loads: pack pads to 128
    # Unquantized: TMA's 16-byte rows of 2-byte elements; quantized: 128-wide scale blocks
    # (FP8) and 128-row NVFP4 scale tiles per half of fc1.
    align = 8 if q.scheme == "unquantized" else 128
    for what, v in (("hidden_size", q.hidden_size), ("intermediate_size", q.intermediate_size)):
        if v % align:
            return f"it runs {q.scheme} with {what} a multiple of {align}, not {v}"
    return None


def _cuda_version() -> tuple[int, ...]:
    """torch's CUDA runtime version, e.g. (12, 8); a build without CUDA (tests) passes."""
    if torch.version.cuda is None:
        return (999,)
    return tuple(int(p) for p in torch.version.cuda.split(".")[:2])


def import_flashinfer_moe() -> ModuleType:
    """``flashinfer.fused_moe`` (about 2.5 s to import), or ImportError naming the package."""
    return import_flashinfer("flashinfer.fused_moe", "moe_backend='flashinfer_cutlass'")


# ---- the backend ---------------------------------------------------------------------------
_WORKSPACE = SharedWorkspace("flashinfer_cutlass")


class FlashInferCutlassExperts(MoEExperts):
    """``cutlass_fused_moe`` over the layout ``pack`` makes (module docstring). ``api``: the
    ``flashinfer.fused_moe`` module (imported here), or a stand-in with the same names
    (``cutlass_fused_moe``, ``cutlass_fused_moe_workspace_size``, ``ActivationType``, and for
    mxfp4 the two ``MXFP4_API`` functions)."""
    name = "flashinfer_cutlass"
    cuda_graph_safe = True    # after the capture warm-up: a preallocated workspace, no host read

    def __init__(self, activation: MoEActivation, api: ModuleType | None = None):
        self.activation = activation
        self.api = api if api is not None else import_flashinfer_moe()
        self.kind = "unquantized"
        self.scale_name = ""
        self._act_type = getattr(self.api.ActivationType, _ACTIVATION_TYPES[activation.name])
        self._act_params: dict[tuple[int, torch.device], dict[str, torch.Tensor]] = {}
        self._input_scales: tuple[torch.Tensor, ...] | None = None
        self._ws_rows = 0
        """Pair rows the shared workspace was sized for by this layer (0: never)."""
        params = inspect.signature(self.api.cutlass_fused_moe).parameters
        self._has_workspace = "workspace_buffer" in params
        if not self._has_workspace:
            # Older FlashInfer allocates its workspace inside every call: keep decode eager.
            self.cuda_graph_safe = False
            logger.warning("flashinfer_cutlass: this flashinfer-python has no workspace_buffer "
                           "argument; decode steps will not be captured in CUDA graphs")

    def bind_scheme(self, method) -> None:
        """Called once by the quant method after selection."""
        if method.scheme not in FLASHINFER_SCHEMES:
            raise ValueError(f"moe_backend='flashinfer_cutlass' does not run {method.scheme}: "
                             + UNMAPPED_SCHEMES.get(method.scheme, "no FlashInfer path mapped"))
        if method.scheme == "mxfp4":
            missing = [n for n in MXFP4_API if not hasattr(self.api, n)]
            if missing:
                raise ValueError(f"moe_backend='flashinfer_cutlass' runs mxfp4 through "
                                 f"FlashInfer's SM90 W4A16 layout, and this flashinfer-python "
                                 f"has no {', '.join(missing)}: upgrade it ({INSTALL_HINT})")
            self.kind = "mxfp4"
        if method.scheme == "fp8-block":
            if tuple(method.block) != (128, 128):
                raise ValueError(f"moe_backend='flashinfer_cutlass' runs fp8-block with 128x128 "
                                 f"blocks only, not {tuple(method.block)}; use 'triton' or "
                                 "'torch'")
            self.kind, self.scale_name = "fp8-block", method.scale_name
        elif method.scheme == "nvfp4":
            self.kind = "nvfp4"

    def bind_shared(self, shared: dict[str, torch.Tensor]) -> None:
        """The layer's shared (not expert-indexed) tensors after loading. NVFP4 quantizes
        activations with the checkpoint's static input scales (0-d, ModelOpt's dequant
        convention, max over experts): both must be present."""
        if self.kind != "nvfp4":
            return
        scales = [shared.get(n) for n in ("w13_input_scale", "w2_input_scale")]
        # One host read per layer at load time, never in a forward.
        if any(s is None or not float(s) > 0 for s in scales):
            raise ValueError("moe_backend='flashinfer_cutlass' quantizes NVFP4 activations "
                             "(W4A4) with the checkpoint's input_scale of each projection; this "
                             "checkpoint has none for gate/up or down: use 'torch' (weight-only)")
        s13, s2 = (s.detach().float().reshape(()) for s in scales)
        self._input_scales = (1.0 / s13, 1.0 / s2, s13, s2)

    def pack(self, tensors):
        if self.kind == "mxfp4":
            return mxfp4_to_flashinfer(tensors, self._interleave, self._fold_scales)
        if self.kind == "nvfp4":
            return nvfp4_to_flashinfer(tensors)
        if self.kind == "fp8-block":
            return fp8_block_to_flashinfer(tensors, self.scale_name)
        return unquantized_to_flashinfer(tensors, self.activation.gated)

    def _interleave(self, w: torch.Tensor) -> torch.Tensor:
        """FlashInfer's SM90 mixed-GEMM byte interleave of uint8 FP4 [E, rows, cols / 2]: a CUDA
        kernel, so a host tensor (the expert cache's store) goes to the GPU and back."""
        run_on = w.device
        if w.device.type != "cuda" and platform_for("cuda").is_available():
            run_on = torch.device("cuda")            # the current device
        fn = getattr(self.api, MXFP4_API[0])
        return fn(w.to(run_on).contiguous(), "fp4").to(w.device)

    def _fold_scales(self, s: torch.Tensor) -> torch.Tensor:
        """FlashInfer's fold of e8m0 scales [E, rows, cols / 32] (torch: any device)."""
        return getattr(self.api, MXFP4_API[1])(s.contiguous(), 32)

    def apply_pairs(self, weights, x, topk_weights, ids, out, max_ids=None):
        T, K = ids.shape
        if T == 0:
            return
        max_tokens = capture_warm_up_tokens()
        if max_tokens is not None and not capturing(x.device):
            self._warm_up(weights, x, max(max_tokens, T), K)
        res = self._run(weights, x, topk_weights, ids)[:, :x.shape[-1]]    # less H's padding
        # Rows of id -1 came back zero: keep what earlier waves wrote there.
        out.copy_(torch.where((ids >= 0).unsqueeze(-1), res.reshape(T, K, -1), out))

    # ---- one call ---------------------------------------------------------------------------
    def _run(self, weights, x, topk_weights, ids) -> torch.Tensor:
        """One kernel call over the T * K pair rows of ``ids`` [T, K] -> [T * K, Hp], Hp the
        hidden size ``pack`` padded to (fc2's rows; H but for MXFP4)."""
        T, K = ids.shape
        rows = T * K
        w1, w2, quant_scales = self._operands(weights)
        Hp = w2.shape[1]
        xp = F.pad(x, (0, Hp - x.shape[-1])) if Hp != x.shape[-1] else x
        xr = xp.repeat_interleave(K, dim=0) if K > 1 else xp.contiguous()  # row t*K + k: x[t]
        res = torch.empty(rows, Hp, dtype=x.dtype, device=x.device)
        kwargs = self._call_kwargs(weights, w2.shape[0], x.device)
        if self._has_workspace:
            kwargs["workspace_buffer"] = self._workspace(x, rows, w1, w2)
        self.api.cutlass_fused_moe(
            xr, ids.reshape(rows, 1).to(torch.int32),
            topk_weights.reshape(rows, 1).to(torch.float32), w1, w2, x.dtype, quant_scales,
            output=res, **kwargs)
        return res

    def _operands(self, weights) -> tuple[torch.Tensor, torch.Tensor, list | None]:
        """(fc1 weights, fc2 weights, quant_scales) as FlashInfer takes them, from the slot (or
        expert) tensors of this call: views and [G]-sized products only."""
        if self.kind == "mxfp4":
            return (weights["w13_blocks"], weights["w2_blocks"],
                    [weights["w13_scales"].view(torch.int32),
                     weights["w2_scales"].view(torch.int32)])
        w13, w2 = weights["w13_weight"], weights["w2_weight"]
        if self.kind == "fp8-block":
            s = self.scale_name
            return w13, w2, [weights[f"w13_{s}"], weights[f"w2_{s}"]]
        if self.kind != "nvfp4":
            return w13, w2, None
        if self._input_scales is None:
            raise RuntimeError("flashinfer_cutlass: NVFP4 input scales were never bound "
                               "(FusedMoE.finish_loading calls bind_shared)")
        a13, a2, s13, s2 = self._input_scales
        alpha13 = (weights["w13_weight_scale_2"][:, 0] * s13).contiguous()      # [G] f32
        alpha2 = (weights["w2_weight_scale_2"][:, 0] * s2).contiguous()
        return (w13.view(torch.int64), w2.view(torch.int64),
                [a13, weights["w13_weight_scale"].view(torch.int32), alpha13,
                 a2, weights["w2_weight_scale"].view(torch.int32), alpha2])

    def _call_kwargs(self, weights, G: int, device: torch.device) -> dict:
        kw = dict(fc1_expert_biases=weights.get("w13_bias"),
                  fc2_expert_biases=weights.get("w2_bias"), activation_type=self._act_type,
                  use_fused_finalize=False)      # the deterministic finalize (top_k is 1 anyway)
        kw.update(_SCHEME_FLAGS.get(self.kind, {}))
        if self.activation.name == "swigluoai":
            kw.update(self._swiglu_params(G, device))
        return kw

    def _swiglu_params(self, G: int, device: torch.device) -> dict[str, torch.Tensor]:
        """GPT-OSS's alpha, beta = 1 and limit, one float32 per slot (FlashInfer's [G] shape);
        made on the first, eager, call of a (G, device)."""
        key = (G, device)
        if key not in self._act_params:
            a = self.activation
            self._act_params[key] = {n: torch.full((G,), v, dtype=torch.float32, device=device)
                                     for n, v in (("swiglu_alpha", a.alpha), ("swiglu_beta", 1.0),
                                                  ("swiglu_limit", a.limit))}
        return self._act_params[key]

    # ---- capture ----------------------------------------------------------------------------
    def _workspace(self, x: torch.Tensor, rows: int, w13: torch.Tensor, w2: torch.Tensor
                   ) -> torch.Tensor | None:
        """The shared workspace where it holds what this call needs; else None (FlashInfer
        allocates) for an eager call, and an error for a captured one (it would allocate inside
        the graph). Rows bound the need, except for FP8 block scaling, whose size FlashInfer
        takes from the most rows its shared runner has seen (an eager prefill raises it for
        every later call): that need is asked for (host only) per call."""
        buf = _WORKSPACE.current(x.device)
        if self.kind in _STATEFUL_WORKSPACE:
            fits = buf is not None and buf.numel() >= self._workspace_bytes(x, rows, w13, w2)
        else:
            fits = buf is not None and rows <= self._ws_rows
        if fits:
            return buf
        if capturing(x.device):
            raise RuntimeError(f"flashinfer_cutlass: capturing {rows} pair rows, but the "
                               f"workspace was sized for {self._ws_rows} (the capture warm-up, "
                               "modular_kernel.capture_warm_up, did not cover this batch)")
        return None

    def _workspace_bytes(self, x: torch.Tensor, rows: int, w13: torch.Tensor,
                         w2: torch.Tensor) -> int:
        G, Hp = w2.shape[0], w2.shape[1]                                  # padded: MXFP4
        inter = w2.shape[-1] * _INNER_PER_ELEMENT.get(self.kind, 1)
        return int(self.api.cutlass_fused_moe_workspace_size(
            rows, Hp, inter, G, 1, x_dtype=x.dtype, weight_dtype=w13.dtype, output_dtype=x.dtype,
            activation_type=self._act_type, use_fused_finalize=False, device=x.device,
            **_SCHEME_FLAGS.get(self.kind, {})))

    def _warm_up(self, weights, x: torch.Tensor, max_tokens: int, K: int) -> None:
        """Before a capture: size the shared workspace for ``max_tokens`` * K pair rows and run
        the kernel once at that size on zeros (JIT build, runner and tactic lookup), eagerly."""
        rows = max_tokens * K
        sized = rows <= self._ws_rows
        # FP8 block's need may have grown since (FlashInfer's running maximum): asked again.
        if not self._has_workspace or (sized and self.kind not in _STATEFUL_WORKSPACE):
            return
        w13, w2, _ = self._operands(weights)
        _WORKSPACE.get(x.device, self._workspace_bytes(x, rows, w13, w2))
        if sized:
            return
        self._ws_rows = rows
        ids = (torch.arange(rows, device=x.device) % w2.shape[0]).view(max_tokens, K)
        self._run(weights, x.new_zeros(max_tokens, x.shape[-1]), x.new_ones(max_tokens, K), ids)

"""The "flashinfer_paged" attention backend: FlashInfer's paged-KV attention wrappers (package
flashinfer-python, the optional ``cuda`` extra) behind the ``AttentionImpl`` contract. NOT YET RUN
ON A GPU, and never chosen by "auto": only ``attention_backend="flashinfer_paged"`` selects it.

The contract, read from flashinfer-python 0.7.2 (``flashinfer/prefill.py``:
``BatchPrefillWithPagedKVCacheWrapper.__init__/plan/run``; ``flashinfer/decode.py``:
``BatchDecodeWithPagedKVCacheWrapper.__init__/plan/_plan_impl/run``):
  Pages: ``indptr`` [B + 1] int32 (sequence i's pages are ``indices[indptr[i]:indptr[i+1]]``),
  ``indices`` int32 page ids, ``last_page_len`` [B] int32 in [1, page_size]; ``qo_indptr`` [B+1]
  (prefill) in tokens. ``plan`` is host work (scheduling, host-to-device copies) and "cannot be
  used in Cuda Graph": it runs once per step, before the forward, never inside a capture.
  Cache: ``run(q, (k_cache, v_cache))`` with ``kv_layout="NHD"`` takes each plane as
  [pages, page_size, kv_heads, head_dim]: exactly ``kv_cache[0]`` and ``kv_cache[1]`` of our
  [P, blocks, block_size, kv_heads, head_dim] cache (views, no copy; page = block). A one-plane
  ``kv_shared`` cache passes plane 0 as both.
  Masks: prefill ``causal=True`` aligns each sequence's queries to the end of its KV (query j of
  qo_len attends keys <= j + kv_len - qo_len), our new-tokens-last layout; ``window_left`` is
  inclusive (keys >= p - window_left), so our window W (keys in (p - W, p]) is W - 1.
  GQA: query head h reads kv head h // (Hq // Hkv), as ours.
Not mapped: sinks (FlashInfer 0.7.2 takes sink logits only on its trtllm-gen, cuDNN and cute-dsl
routes, not the fa2 paged kernels planned here: ``UNSUPPORTED``); float32 caches (fa2 kernels
are fp16/bf16); head dims other than ``HEAD_DIMS``.

Steps: an eager step (any mix of prompts, chunks and decodes) runs the prefill wrapper over all
its tokens, planned by the first layer that sees the step's metadata (``FlashInferPlanner``;
later layers reuse the plan). A decode step replayed from a CUDA graph (``worker/cuda_graphs.py``)
runs a decode wrapper made for its padded size P with ``use_cuda_graph=True`` and fixed index
buffers (indices: P * max_blocks), planned by ``plan_decode_graph`` from the staged host rows
before the warm-up and before every replay; padding rows (context 1, block 0) attend one
throwaway key. The KV write is the Triton write kernel (``triton_paged``'s), which skips
PAD_SLOT_ID rows: FlashInfer's ``append_paged_kv_cache`` takes batch indices and positions
instead of slots and has no padding row.
"""
from __future__ import annotations

import weakref
from types import ModuleType

import torch

from vllm.kernels.flashinfer import flashinfer_refusal, import_flashinfer
from vllm.kernels.triton import triton_refusal
from vllm.model_executor.forward_context import AttentionMetadata
from vllm.model_executor.layers.attention.interface import AttentionImpl, AttentionOptions
from vllm.platforms import platform_for

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
"""Head dims of FlashInfer's fa2 kernels as it builds and tests them (kept conservative)."""
UNSUPPORTED = {"sinks": "FlashInfer 0.7.2 takes sink logits only on its trtllm-gen, cuDNN and "
                        "cute-dsl routes, not the fa2 paged kernels this backend plans"}
"""Attention features this backend does not run, and why."""
WORKSPACE_BYTES = 256 * 1024 * 1024
"""The float workspace (split-KV partial results), one per device: graph-mode decode always
splits the KV and pads the batch, which at many heads x head dim 256 passes FlashInfer's
suggested 128 MB (its plan then raises); vLLM uses 256 MB too."""
BACKEND = "fa2"
"""Pinned so the features checked above (window_left, no sinks) are those of the kernel run."""


def flashinfer_paged_refusal(head_dim: int, device_type: str) -> str | None:
    """The registry's extra check (after platform, dtype, layout and features)."""
    if head_dim not in HEAD_DIMS:
        return f"it runs head_dim {list(HEAD_DIMS)}, not {head_dim}"
    reason = flashinfer_refusal()
    if reason is not None:
        return reason
    reason = triton_refusal(device_type)        # the KV write
    return None if reason is None else f"its KV write is a Triton kernel: {reason}"




def plan_arrays(block_tables: torch.Tensor, seq_lens: list[int], block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our block tables [B, M] (any device) and host context lengths -> FlashInfer's
    (indptr [B + 1] int32 host, indices [sum pages] int32 on the tables' device, last_page_len
    [B] int32 host). Sequence i uses its first ceil(seq_lens[i] / block_size) blocks; the
    gather's positions are built on the host, so a device table is read without a sync."""
    pages = torch.tensor([-(-n // block_size) for n in seq_lens], dtype=torch.int64)
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    rows = torch.repeat_interleave(torch.arange(len(seq_lens)), pages)
    cols = torch.arange(int(indptr[-1])) - torch.repeat_interleave(indptr[:-1].long(), pages)
    dev = block_tables.device
    # [2, pages] positions, uploaded without a blocking copy mid-forward where the device allows
    pos = platform_for(dev).upload(torch.stack([rows, cols]), dev)
    indices = block_tables[pos[0], pos[1]].to(torch.int32)
    last = torch.tensor([n - (p - 1) * block_size for n, p in zip(seq_lens, pages.tolist())],
                        dtype=torch.int32)
    return indptr, indices, last


_WORKSPACES: dict[torch.device, torch.Tensor] = {}
"""One zeroed float workspace per device, shared by every wrapper (they run one at a time on
one stream; FlashInfer wants it zero before its first use)."""


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _WORKSPACES:
        _WORKSPACES[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[device]


class FlashInferPlanner:
    """The wrappers and per-step plans shared by every layer with the same plan arguments
    (heads, head dim, window, scale, dtype, device): FlashInfer plans once per step for them."""

    def __init__(self, api: ModuleType, key: tuple):
        self.api = api
        self.num_heads, self.num_kv_heads, self.head_dim, self.window_left, self.scale, \
            self.dtype, self.device = key
        self._prefill = None
        self._eager_md: AttentionMetadata | None = None
        """The metadata the prefill wrapper was last planned for (identity: one per step)."""
        self._graphs: dict[int, object] = {}
        """id(a graph's static metadata) -> its use_cuda_graph decode wrapper, dropped when
        that metadata is (its graphs read the wrapper's buffers: two engines in one process
        each keep theirs)."""
        self._indices = _DeviceIndices(self.device)

    def _common(self) -> dict:
        return dict(window_left=self.window_left, sm_scale=self.scale,
                    q_data_type=self.dtype, kv_data_type=self.dtype)

    def wrapper_for(self, md: AttentionMetadata, capturing: bool):
        """The planned wrapper to run ``md`` with: its graph's decode wrapper (planned by
        ``plan_decode_graph``), else the prefill wrapper, planned now for a new step's
        metadata; never plans while ``capturing``."""
        graph = self._graphs.get(id(md))
        if graph is not None:
            return graph
        if md is not self._eager_md:
            if capturing:
                raise RuntimeError("flashinfer_paged: a capture reached attention with metadata "
                                   "no plan was made for (plan_decode_graph runs before it)")
            self._plan_prefill(md)
        return self._prefill

    def _plan_prefill(self, md: AttentionMetadata) -> None:
        if self._prefill is None:
            self._prefill = self.api.BatchPrefillWithPagedKVCacheWrapper(
                _workspace(self.device), kv_layout="NHD", backend=BACKEND)
        indptr, indices, last = plan_arrays(md.block_tables, md.seq_lens_cpu, md.block_size)
        qo_indptr = torch.tensor(md.query_start_loc_cpu, dtype=torch.int32)
        self._prefill.plan(qo_indptr, indptr, indices, last, self.num_heads, self.num_kv_heads,
                           self.head_dim, md.block_size, causal=True, **self._common())
        self._eager_md = md

    def plan_decode_graph(self, md: AttentionMetadata, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor) -> None:
        """Host-side plan of a decode graph's step, before its warm-up or replay: ``md`` is the
        graph's static metadata (P rows), ``seq_lens`` [P] / ``block_tables`` [P, M] the step's
        staged host rows (padding rows: context 1, block 0)."""
        P, M = block_tables.shape
        wrapper = self._graphs.get(id(md))
        if wrapper is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            # Fixed buffers: a captured replay reads them; plan() rewrites them in place.
            wrapper = self.api.BatchDecodeWithPagedKVCacheWrapper(
                _workspace(self.device), kv_layout="NHD", use_cuda_graph=True,
                use_tensor_cores=True, paged_kv_indptr_buffer=torch.zeros(P + 1, **i32),
                paged_kv_indices_buffer=torch.zeros(P * M, **i32),
                paged_kv_last_page_len_buffer=torch.zeros(P, **i32), backend=BACKEND)
            self._graphs[id(md)] = wrapper
            weakref.finalize(md, self._graphs.pop, id(md), None)
        indptr, indices, last = plan_arrays(block_tables, seq_lens.tolist(), md.block_size)
        wrapper.plan(indptr, self._indices(indices), last, self.num_heads, self.num_kv_heads,
                     self.head_dim, md.block_size, **self._common())


class _DeviceIndices:
    """Host page indices -> a device copy, through a reused pinned buffer: FlashInfer's plan
    copies host indices with a blocking copy (a host sync per step); from the device it is an
    ordered device-to-device copy. An event keeps the next step from rewriting the pinned
    buffer while its copy may be in flight. On a host device the indices pass through."""

    def __init__(self, device: torch.device):
        self.device, self.host, self.dev, self.done = device, None, None, None

    def __call__(self, indices: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return indices
        n = indices.numel()
        if self.done is not None:
            self.done.synchronize()            # the previous step's copy has left the buffer
        if self.host is None or self.host.numel() < n:
            self.host = torch.empty(max(n, 1024), dtype=torch.int32, pin_memory=True)
            self.dev = torch.empty(self.host.numel(), dtype=torch.int32, device=self.device)
        self.host[:n].copy_(indices)
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record(torch.cuda.current_stream(self.device))   # the copy's, on cuda:N too
        return self.dev[:n]


_PLANNERS: dict[tuple, FlashInferPlanner] = {}


class FlashInferPagedAttention(AttentionImpl):
    name = "flashinfer_paged"
    cuda_graph_safe = True
    """A decode graph's step is planned outside the capture (``graph_planner``, called by
    ``worker/cuda_graphs.py``); its run reads only the wrapper's fixed device buffers."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 prefix: str = "", options: AttentionOptions = AttentionOptions(),
                 api: ModuleType | None = None):
        super().__init__(num_heads, head_dim, num_kv_heads, scale, prefix, options)
        refused = sorted(options.features & UNSUPPORTED.keys())
        if refused:        # the registry refuses these first; a direct make fails the same way
            raise ValueError(f"attention_backend='flashinfer_paged' does not run {refused[0]}: "
                             f"{UNSUPPORTED[refused[0]]}")
        self.api = api if api is not None else import_flashinfer(
            "flashinfer", "attention_backend='flashinfer_paged'")
        from vllm.kernels.triton import paged_attention     # the KV write; optional package
        self._write = paged_attention.write_kv_cache
        window = options.sliding_window
        self._window_left = -1 if window is None else window - 1

    def graph_planner(self, kv_cache: torch.Tensor) -> FlashInferPlanner:
        """The planner shared by the layers of this cache's plan arguments: what a forward runs
        with, and what ``worker/cuda_graphs.py`` plans before a decode graph's warm-up and
        replay (``plan_decode_graph``)."""
        key = (self.num_heads, self.num_kv_heads, self.head_dim, self._window_left, self.scale,
               kv_cache.dtype, kv_cache.device)
        if key not in _PLANNERS or _PLANNERS[key].api is not self.api:
            _PLANNERS[key] = FlashInferPlanner(self.api, key)
        return _PLANNERS[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                kv_cache: torch.Tensor, md: AttentionMetadata,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        self._write(k, v, md.slot_mapping, kv_cache)
        capturing = q.is_cuda and platform_for(q.device).is_capturing()
        wrapper = self.graph_planner(kv_cache).wrapper_for(md, capturing)
        # NHD planes [blocks, block_size, Hkv, D]: views of our cache; one plane read twice
        # when kv_shared (kv_cache[-1] is kv_cache[0]).
        return wrapper.run(q.contiguous(), (kv_cache[0], kv_cache[-1]))

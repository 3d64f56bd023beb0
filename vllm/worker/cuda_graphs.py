"""Decode steps replayed from CUDA graphs (vLLM's FULL_DECODE_ONLY): one graph per padded batch
size of the forward and ``compute_logits``, with the expert cache inside. Run on an H100
(2026-11-26): the real capture, the test marked ``gpu`` in tests/worker/test_cuda_graphs.py,
passed, and the decode benchmark replayed one graph per step. The CPU tests drive this module
through ``EagerCapturer``.

Sizes: ``SchedulerConfig.cuda_graph_sizes`` (default 1, 2, 4, 8, 16, 24, ... up to
``max_num_seqs``). A decode-only step of B sequences replays the smallest size P >= B
(``config/graph_sizes.padded_size``, the ladder the CPU graphs use too); a larger step, and every
prefill or mixed step, runs eagerly. Rows [B, P) are padding: token 0 at position 0, slot
``PAD_SLOT_ID`` (no KV write), context length 1, and an expert cache routes them nowhere, so the
real rows, the KV cache and the cache's state are what an eager step would give. Sampling (and
guided decoding's masks) stays outside the graph, on the returned logits rows.

Static inputs, one int64 buffer on the device shared by every size (``_Inputs``): the graph of
size P reads its token ids, positions, slot mapping and seq lens [P] and block tables [P, M] (M
= max blocks per sequence) laid end to end from the buffer's start, plus ``query_start_loc`` =
arange(Pmax + 1)[:P + 1] (Pmax = the largest size). A step writes its values into a pinned host
staging buffer of the same layout and copies that prefix in with one non-blocking copy (an
event keeps the next step from rewriting the staging while the copy may be in flight); before,
five copies, one per field, and about twice the host ops. The metadata's host lists are fixed
placeholders: ``query_lens_cpu`` all 1 and ``seq_lens_cpu`` all ``max_model_len`` (an upper
bound; a ``cuda_graph_safe`` backend never reads them).

Capture is lazy, on the first decode step of a size: that step runs eagerly over the static
buffers (the warm-up: Triton compiles and cuBLAS initialises for these shapes, and its KV writes
and expert-cache updates are the step's own; MoE backends see ``capture_warm_up`` with the largest
size and allocate what a capture must not), then the graph is captured (which records without
executing), so no dummy forward ever touches the KV cache or the cache's clock and policy state,
and sizes a run never sees cost nothing. The warm-up runs on the capture stream (cuBLAS and
other per-stream state are made there, not in the capture), under the engine's device: every
stream, synchronize and capture call names it. All graphs share one memory pool
(``torch.cuda.graph_pool_handle()``) and keep nothing in it: each copies its logits into rows
[:P] of one [Pmax, V] buffer allocated outside any capture (an exact copy), so its own logits
and intermediates are reused by later captures (graphs never run concurrently, and a step's
logits are sampled before the next replay overwrites the buffer). Eager capture at startup,
largest first, would size the pool up front instead, at
the cost of a forward and a capture for every listed size before serving. A capture that raises
(e.g. a host sync inside the forward) is logged once, with the error ``capture_end`` may have
masked; the step keeps its warm-up result, every later decode step runs eagerly, and the failed
capture's pool is never captured into again.

Host-side plans: an attention impl with a ``graph_planner(kv_cache)`` (``flashinfer_paged``,
whose FlashInfer ``plan`` is host work that must not be captured) gets
``plan_decode_graph(graph_md, seq_lens, block_tables)`` with the step's staged host rows [:P]
(padding included) after each step is staged, before its warm-up or replay: outside the
captured region, once per distinct planner.

Eligibility (``cuda_graph_refusal``, logged once by the runner): every attention impl declares
``cuda_graph_safe``; so does every MoE backend (``MoEExperts``: ``grouped_mm`` and ``triton``,
not the ``torch`` loop); a cached layer's provider has no ``cuda_graph_refusal`` (the fused
residency step, a sync-free copy). Refused: a routing trace (its observer is Python per step),
recurrent-state models (padding rows would need state slots of their own, and
``has_initial_state`` is a host list per step). Next-layer prefetch is captured: its hooks only
enqueue device work (the next router, ``Residency.load``, the copy), and the one Python flag they
keep (``CachedWeightProvider._settled``) takes the same values in every decode step, so a replay
repeats what the capture recorded.

Graph breaks (``vllm/model_executor/graph_break.py``): a MoE layer whose step reads the device
on the host (``moe_expert_cpu_compute``) is not refused but cut: the capture ends at each
break and a new graph begins after it, and a replay runs the pieces and the breaks eagerly, in
order (``CudaGraphCapturer.capture``, in ``graph_capture.py`` with the other capturers). Such a layer breaks twice, for its split (the host read
and decision: ``HostMissCompute.step``) and for its CPU pairs, and its device waves between
them are captured; where they cannot be (the provider's ``capture_refusal``, or a backend not
``cuda_graph_safe``) the whole layer is one break. Padding rows stay off the CPU
(``HostMissCompute.host_pairs``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm.config.graph_sizes import padded_size
from vllm.logger import init_logger
from vllm.model_executor.forward_context import (PAD_SLOT_ID, AttentionMetadata,
                                                 set_forward_context)
from vllm.model_executor.layers.fused_moe.modular_kernel import capture_warm_up
from vllm.platforms import platform_for
from vllm.worker.graph_capture import (GraphCapturer, Replay, capture_error,
                                        default_capturer)

logger = init_logger(__name__)


def uses_cuda_graphs(device: torch.device) -> bool:
    """Whether decode graphs on ``device`` are CUDA graphs (else CPU graphs, or none). Tests
    patch it to drive ``CudaDecodeGraphs`` on CPU with ``EagerCapturer``."""
    return device.type == "cuda"


def cuda_graph_refusal(attn_layers: list, moe_layers: list, state_layers: list = ()
                       ) -> str | None:
    """Why the model's decode steps cannot be captured (the first reason found), or None."""
    if state_layers:
        return (f"the model has {len(state_layers)} recurrent-state layers (padding rows would "
                "need state slots of their own)")
    for a in attn_layers:
        if a.impl is None:
            return f"{a.prefix}: no KV cache is bound"
        if not getattr(a.impl, "cuda_graph_safe", False):
            return (f"{a.prefix}: attention backend {a.impl.name!r} is not cuda_graph_safe "
                    "(it reads host lengths or writes padding rows)")
    for m in moe_layers:
        if m.routing_observer is not None:
            return "a routing trace is recorded (its observer runs Python every step)"
        reason = m.expert_cache.cuda_graph_refusal() if m.expert_cache is not None else None
        if reason is not None:
            return f"{m.prefix}: expert cache: {reason}"
        if getattr(m.expert_cache, "reads_on_host", False):
            continue                           # runs between the pieces (graph_break)
        kernel = m.quant_method.kernel
        if not getattr(kernel, "cuda_graph_safe", False):
            name = getattr(kernel, "name", type(kernel).__name__)
            return (f"{m.prefix}: MoE backend {name!r} is not cuda_graph_safe (it sizes its work "
                    "on the host)")
    return None




class _Inputs:
    """One int64 buffer of Pmax * (4 + M) values holding, for a padded size P, the layout
    ``fields(P)``: token ids, positions, slot mapping and seq lens [P] each, then block tables
    [P, M], end to end from offset 0 (Pmax: the largest size, M: max blocks per sequence). A
    size's fields are one contiguous prefix, so a step stages them in one copy; sizes overlap
    in the buffer, and each step writes all of its own size's prefix before its replay."""

    def __init__(self, P: int, M: int, device: torch.device, pin: bool = False):
        with torch.inference_mode(False):      # written inside and outside inference mode
            self.buf = torch.zeros(P * (4 + M), dtype=torch.int64, device=device,
                                   pin_memory=pin)
        self.M = M
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}
        """Per size: its fields, its [4, P] rows and its prefix, made once (a view is a
        host op per step otherwise)."""

    def _of(self, P: int) -> tuple[torch.Tensor, ...]:
        views = self._views.get(P)
        if views is None:
            b, M = self.buf, self.M
            with torch.inference_mode(False):  # views written outside inference mode too
                views = self._views[P] = (b[:P], b[P:2 * P], b[2 * P:3 * P], b[3 * P:4 * P],
                                          b[4 * P:P * (4 + M)].view(P, M),
                                          b[:4 * P].view(4, P), b[:P * (4 + M)])
        return views

    def fields(self, P: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, slots, seq_lens [P], tables [P, M]) of size P, the same tensors
        at every call."""
        return self._of(P)[:5]

    def model_inputs(self, P: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) of size P as new views at each call: a forward's positions must
        be a tensor no earlier forward had (``RotaryEmbedding._cos_sin`` keeps its rows by
        the positions tensor's identity, so a warm-up's would stand in for a capture's)."""
        return self.buf[:P], self.buf[P:2 * P]

    def rows(self, P: int) -> torch.Tensor:
        """[4, P]: size P's ids, positions, slots and seq lens, one row each."""
        return self._of(P)[5]

    def prefix(self, P: int) -> torch.Tensor:
        """Size P's fields, end to end."""
        return self._of(P)[6]


@dataclass
class _Entry:
    """One padded size P: metadata over rows [:P] of the static inputs, and its replay."""
    md: AttentionMetadata          # seq_lens_cpu, query_lens_cpu: fixed placeholders
    replay: Replay | None = None   # None until captured


class CudaDecodeGraphs:
    def __init__(self, model: nn.Module, sizes: list[int], max_blocks_per_seq: int,
                 max_model_len: int, block_size: int, device: torch.device,
                 capturer: GraphCapturer | None = None):
        self.model = model
        self.sizes = sorted(sizes)
        self.max_blocks, self.max_model_len = max_blocks_per_seq, max_model_len
        self.block_size, self.device = block_size, torch.device(device)
        self.capturer = capturer if capturer is not None else default_capturer(self.device)
        pin = self.device.type == "cuda" and platform_for(self.device).is_pin_memory_available()
        P = self.sizes[-1]
        self.static = _Inputs(P, max_blocks_per_seq, self.device)
        self.staging = _Inputs(P, max_blocks_per_seq, torch.device("cpu"), pin)
        self.fence = None
        """Recorded after the copies out of the pinned staging: the next step waits for it
        before rewriting the staging."""
        if pin:
            with torch.cuda.device(self.device):
                self.fence = torch.cuda.Event()
        with torch.inference_mode(False):
            self.query_start_loc = torch.arange(P + 1, dtype=torch.int64, device=self.device)
        self._pad_rows = torch.tensor([[0], [0], [PAD_SLOT_ID], [1]], dtype=torch.int64)
        """A padding row's token, position, slot (no KV write) and context length."""
        self._entries: dict[int, _Entry] = {}
        self._out: torch.Tensor | None = None
        """Logits [Pmax, V], allocated outside any capture at the first one: each graph copies
        its logits into rows [:P] and keeps only that view, so the logits it computes are an
        intermediate of the shared pool, not a [P, V] block per graph held forever."""
        self.refused: str | None = None
        """Why decode steps run eagerly from now on (a capture raised), or None."""
        self._planners: list | None = None
        """The distinct attention ``graph_planner``s of the model's bound caches (found once)."""

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(P for P, e in self._entries.items() if e.replay is not None)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor,
               md: AttentionMetadata, ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [B, V] of a decode-only step of B sequences (``input_ids``, ``positions`` and
        ``md``'s tensors on the host) from the graph of the smallest size >= B, captured now on
        its first use; None when the step must run eagerly. A replay's rows are a view of the
        logits buffer every graph shares, rewritten by the next replay of any size: consume them
        within the step and keep no reference (the runner's sampler reads them in stream order,
        before the next replay is enqueued). ``ids``: token ids [n <= B] on the device for the
        first n rows, in place of ``input_ids``' (a step scheduled ahead takes them from the
        step in flight), copied over the staged rows in stream order."""
        B = input_ids.shape[0]
        if self.refused is not None or md.num_decodes != md.num_seqs or B != md.num_seqs \
                or md.block_tables.shape[1] > self.max_blocks:
            return None
        P = padded_size(B, self.sizes)
        if P is None:
            return None
        e = self._entries.get(P) or self._new_entry(P)
        self._stage(P, input_ids, positions, md)
        if ids is not None:
            self.static.fields(P)[0][:ids.shape[0]].copy_(ids)
        self._plan(P, e)
        if e.replay is None:
            return self._warm_up_and_capture(P, e)[:B]
        return e.replay()[:B]

    def _new_entry(self, P: int) -> _Entry:
        _, _, slots, seq_lens, tables = self.static.fields(P)
        md = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                               query_start_loc=self.query_start_loc[:P + 1],
                               seq_lens_cpu=[self.max_model_len] * P, query_lens_cpu=[1] * P,
                               num_decodes=P, block_size=self.block_size)
        e = self._entries[P] = _Entry(md)
        return e

    def _stage(self, P: int, input_ids: torch.Tensor, positions: torch.Tensor,
               md: AttentionMetadata) -> None:
        """The step's B rows, then P - B padding rows, into size P's fields of the staging;
        then that prefix into the static inputs in one copy (non-blocking from pinned
        memory)."""
        B, m = input_ids.shape[0], md.block_tables.shape[1]
        if self.fence is not None:
            self.fence.synchronize()           # the previous step's copy has finished
        h = self.staging
        rows = h.rows(P)                       # ids, positions, slots, seq lens
        for i, src in enumerate((input_ids, positions, md.slot_mapping, md.seq_lens)):
            rows[i, :B] = src
        if B < P:
            rows[:, B:] = self._pad_rows
        tables = h.fields(P)[4]
        tables[:B, :m] = md.block_tables
        if m < h.M:
            tables[:B, m:] = 0
        if B < P:
            tables[B:] = 0
        self.static.prefix(P).copy_(h.prefix(P), non_blocking=self.fence is not None)
        if self.fence is not None:
            self.fence.record(torch.cuda.current_stream(self.device))   # the copy's stream

    def _plan(self, P: int, e: _Entry) -> None:
        """Host-side per-step plans (module docstring), from the staged rows: never captured."""
        if self._planners is None:
            found = {}
            for m in self.model.modules():
                make = getattr(getattr(m, "impl", None), "graph_planner", None)
                if make is not None and getattr(m, "kv_cache", None) is not None:
                    planner = make(m.kv_cache)
                    found[id(planner)] = planner
            self._planners = list(found.values())
        _, _, _, seq_lens, tables = self.staging.fields(P)
        for planner in self._planners:
            planner.plan_decode_graph(e.md, seq_lens, tables)

    def _run(self, P: int, e: _Entry) -> torch.Tensor:
        """The forward and logits over rows [:P] of the static inputs: [P, V]."""
        with set_forward_context(e.md):
            return self.model.compute_logits(self.model(*self.static.model_inputs(P)))

    def _warm_up_and_capture(self, P: int, e: _Entry) -> torch.Tensor:
        # This step, eagerly: the warm-up. MoE backends that must not allocate or compile inside
        # a capture prepare for the largest size here (flashinfer_cutlass: its workspace).
        with capture_warm_up(self.sizes[-1]):
            out = self.capturer.warm_up(lambda: self._run(P, e))
        if self._out is None:                  # outside any capture
            with torch.inference_mode(False):
                self._out = torch.empty((self.sizes[-1], *out.shape[1:]), dtype=out.dtype,
                                        device=out.device)
        try:
            e.replay = self.capturer.capture(lambda: self._out[:P].copy_(self._run(P, e)))
        except Exception as err:               # noqa: BLE001 - any failure means: stay eager
            self._refuse(P, err)
            return out
        logger.debug("captured a CUDA graph for decode batch size %d", P)
        return out

    def _refuse(self, P: int, err: Exception) -> None:
        """A capture raised: every later decode step runs eagerly."""
        self.refused = capture_error(err)
        self._entries.clear()
        self._out = None
        self.capturer.after_failure()
        # Nothing captured ran, so the device state is the warm-up's; Python flags the aborted
        # forward set (a prefetch "in flight") are dropped.
        for m in self.model.modules():
            forget = getattr(getattr(m, "expert_cache", None), "forget_capture", None)
            if forget is not None:
                forget()
        logger.warning("decode steps run eagerly from now on (capturing a CUDA graph of batch "
                       "size %d failed): %s", P, self.refused)
        logger.debug("the failed capture's traceback", exc_info=err)

"""ModelRunner: SchedulerOutput -> flattened tensors -> model -> sampler -> RunnerOutput.

The runner owns the model, the paged KV cache tensors, the recurrent-state pool (one slot per
running request for models with Mamba / Gated DeltaNet layers) and per-request sampling
generators. It never changes request state: it reads ``ScheduledSequence`` and returns sampled
tokens.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.core.sched_output import (RunnerOutput, SampledToken, ScheduledSequence,
                                    SchedulerOutput)
from vllm.logger import init_logger
from vllm.model_executor.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.recurrent_state import recurrent_layers, state_bytes_per_slot
from vllm.platforms import platform_for
from vllm.worker import cuda_graphs
from vllm.worker.cpu_graphs import DecodeGraphs
from vllm.worker.cpu_graphs import eligible as graphs_eligible
from vllm.worker.cuda_graphs import CudaDecodeGraphs
from vllm.worker.pending_step import PendingStep
from vllm.worker.sampler import Sampler, SamplingMetadata, TokenMasks, prompt_logprobs
from vllm.worker.step_inputs import StepInputs, prepare_inputs, to_device

logger = init_logger(__name__)

PROMPT_LOGPROB_ROWS = 512
"""Prompt positions whose logits and logprobs are computed at once (``_prompt_logprobs``)."""

_CPU_KV_BUDGET = 1 << 30  # bytes for the KV cache on CPU when nothing is configured


def kv_bytes_per_block(attn_layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes summed over ``attn_layers``, each at its ``kv_cache_shape``."""
    elem = torch.finfo(dtype).bits // 8
    return sum(math.prod(a.kv_cache_shape(1, block_size)) * elem for a in attn_layers)


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig):
        from vllm.model_executor.model_loader import get_model
        self.config = vllm_config
        self.device = vllm_config.device_config.torch_device
        self.dtype = vllm_config.model_config.dtype
        self.block_size = vllm_config.cache_config.block_size
        self._platform = platform_for(self.device)
        self._platform.select_device(self.device)
        torch.manual_seed(vllm_config.model_config.seed)
        self.model: nn.Module = get_model(vllm_config)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        self.state_layers = recurrent_layers(self.model)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.eos_token_id: int | None = None
        """Masked while a request is below min_tokens; set by the engine from the tokenizer."""
        self._sampling_metadata: SamplingMetadata | None = None
        """The last step's, reused or advanced by one token while it stays valid
        (``SamplingMetadata.advance``): building it costs more than a decode step's sampling."""
        budget = self._memory_budget()
        state_bytes = self._allocate_state(budget)
        self.num_blocks = self._allocate_kv_cache(budget, state_bytes)
        self.routing_recorder = self._attach_routing_recorder()
        self._log_moe_cache_config()
        self.prefetch_pairs = self._wire_prefetch()
        """MoE layer pairs with next-layer prefetch (0: off)."""
        self.decode_graphs = self._make_decode_graphs()

    # ---- KV cache --------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over every layer's cache (``Attention.kv_cache_shape``: 2 planes,
        1 for a layer whose values are its keys)."""
        return kv_bytes_per_block(self.attn_layers, self.block_size, self.dtype)

    def _memory_budget(self) -> int | None:
        """Bytes for the KV cache and the recurrent-state pool together; None when the block
        count is given (``num_gpu_blocks``)."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks is not None:
            return None
        return cc.kv_cache_memory_bytes or self._default_kv_budget()

    def _allocate_state(self, budget: int | None) -> int:
        """The recurrent-state pool: one slot per running request (``core/state_slots.py``),
        ``max_num_seqs`` of them unless that would take more than half the ``budget`` (then
        fewer, at least 1: admission waits for a free slot, so fewer requests run at once).
        Zeros. Tells the scheduler the slot count through ``cache_config.num_state_slots``;
        returns the pool's bytes."""
        cc = self.config.cache_config
        if not self.state_layers:
            cc.num_state_slots = 0
            return 0
        num_slots = self.config.scheduler_config.max_num_seqs
        per_slot = state_bytes_per_slot(self.state_layers)
        if budget is not None and num_slots * per_slot > budget // 2:
            fit = max(1, budget // 2 // per_slot)
            logger.warning("recurrent state: %d slots of %.1f MiB would take more than half of "
                           "the %.1f MiB budget: %d slots, so at most %d requests run at once "
                           "(raise kv_cache_memory_bytes or lower max_num_seqs)", num_slots,
                           per_slot / 2**20, budget / 2**20, fit, fit)
            num_slots = fit
        for layer in self.state_layers:
            layer.bind_state(num_slots, self.device)
        cc.num_state_slots = num_slots
        nbytes = num_slots * per_slot
        logger.info("recurrent state: %d slots x %d layers (%.1f MiB)", num_slots,
                    len(self.state_layers), nbytes / 2**20)
        return nbytes

    def _allocate_kv_cache(self, budget: int | None = None, state_bytes: int = 0) -> int:
        """``num_gpu_blocks`` blocks when given, else as many as ``budget`` (default
        ``_memory_budget()``) less ``state_bytes`` holds (the recurrent-state pool shares the
        budget, as in vLLM's hybrid allocator)."""
        cc, mc, sc = self.config.cache_config, self.config.model_config, self.config.scheduler_config
        # A model without attention layers: blocks only count tokens (1 byte each, nominally).
        per_block = self.kv_bytes_per_block() or 1
        if cc.num_gpu_blocks is not None:
            num_blocks = cc.num_gpu_blocks
        else:
            budget = self._memory_budget() if budget is None else budget
            fit = (budget - state_bytes) // per_block
            per_seq = -(-mc.max_model_len // self.block_size)
            if fit < 1:
                raise ValueError(
                    f"no memory left for the KV cache: a budget of {budget / 2**20:.1f} MiB "
                    f"(less {state_bytes / 2**20:.1f} MiB of recurrent state) holds no "
                    f"{per_block}-byte block; raise gpu_memory_utilization (now "
                    f"{cc.gpu_memory_utilization}) or kv_cache_memory_bytes, or free the device")
            if fit < per_seq:
                logger.warning("KV cache: %d blocks, fewer than one %d-token sequence needs "
                               "(%d): longer requests fail; raise gpu_memory_utilization or "
                               "kv_cache_memory_bytes, or lower max_model_len", fit,
                               mc.max_model_len, per_seq)
            # No point in more blocks than max_num_seqs full-length sequences can use.
            num_blocks = min(fit, sc.max_num_seqs * per_seq)
        for a in self.attn_layers:
            a.kv_cache = torch.zeros(a.kv_cache_shape(num_blocks, self.block_size),
                                     dtype=self.dtype, device=self.device)
        cc.num_gpu_blocks = num_blocks
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB); recurrent state %.1f MiB",
                    num_blocks, self.block_size, num_blocks * self.kv_bytes_per_block() / 2**20,
                    state_bytes / 2**20)
        return num_blocks

    def _default_kv_budget(self) -> int:
        info = self._platform.memory_info(self.device)
        if info is None:
            return _CPU_KV_BUDGET
        free, total = info
        used = total - free
        return max(0, int(total * self.config.cache_config.gpu_memory_utilization) - used)

    def _make_decode_graphs(self) -> DecodeGraphs | CudaDecodeGraphs | None:
        """Graphs for decode-only steps where they apply: CUDA graphs on CUDA
        (``worker/cuda_graphs.py``), CPU graphs on CPU (``worker/cpu_graphs.py``)."""
        if self.config.enforce_eager:
            return None
        max_len = self.config.model_config.max_model_len
        max_blocks = -(-max_len // self.block_size)
        if cuda_graphs.uses_cuda_graphs(self.device):
            refusal = cuda_graphs.cuda_graph_refusal(self.attn_layers, self.moe_layers,
                                                     self.state_layers)
            if refusal is not None:
                logger.info("decode steps run eagerly (no CUDA graphs): %s", refusal)
                return None
            return CudaDecodeGraphs(self.model, self.config.scheduler_config.cuda_graph_sizes,
                                    max_blocks, max_len, self.block_size, self.device)
        if not graphs_eligible(self.moe_layers, self.dtype, self.device, False,
                               self.state_layers):
            return None
        if self.prefetch_pairs:
            # The prefetch hooks are Python per layer: a graph replay would skip them.
            logger.info("decode steps run eagerly (no CPU graphs): next-layer expert prefetch")
            return None
        return DecodeGraphs(self.model, max_blocks, [m.expert_cache for m in self.moe_layers
                                                     if m.expert_cache is not None])

    # ---- one step --------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput,
                      token_masks: TokenMasks | None = None) -> RunnerOutput:
        """One step, its tokens read back (``launch`` then ``result``)."""
        return self.launch(sched, token_masks).result()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, token_masks: TokenMasks | None = None,
               previous: PendingStep | None = None) -> PendingStep:
        """Enqueue one step and return before its tokens reach the host (``result()`` reads
        them). ``token_masks``: tokens allowed to some sampled sequences (guided decoding),
        rows indexing the sequences with ``do_sample`` in order. ``previous``: the step in
        flight, whose device tokens feed this step's ``pending_token`` decodes. A step that
        raises leaves no expert cache trusting a slot whose copy may not have run."""
        try:
            return self._launch(sched, token_masks, previous)
        except BaseException:
            self._invalidate_caches()
            raise

    def _invalidate_caches(self) -> None:
        for m in self.moe_layers:
            if m.expert_cache is not None:
                m.expert_cache.invalidate()

    def _launch(self, sched: SchedulerOutput, token_masks: TokenMasks | None,
                previous: PendingStep | None) -> PendingStep:
        # The current device is per thread, and the engine may step from another thread than
        # the one that built the runner (AsyncLLM's): launches that take it must find ours.
        self._platform.select_device(self.device)
        for req_id in sched.finished_req_ids:
            self.generators.pop(req_id, None)
        seqs = sched.sequences
        if not seqs:
            return PendingStep.done(RunnerOutput(sampled={}))
        inputs = self._prepare_inputs(seqs)                 # host tensors
        ids = self._pending_ids(seqs, previous)             # [T] on the device, or None
        sampled_seqs = [s for s in seqs if s.do_sample]
        logits = None
        if self.decode_graphs is not None and len(sampled_seqs) == len(seqs):
            logits = self.decode_graphs.logits(inputs.input_ids, inputs.positions,
                                               inputs.metadata, ids=ids)
        if logits is None:
            input_ids, positions, attn_metadata, logits_indices = to_device(inputs, self.device)
            if ids is not None:
                input_ids[:ids.shape[0]].copy_(ids)
            with set_forward_context(attn_metadata):
                hidden = self.model(input_ids, positions)
            if self.routing_recorder is not None:
                self.routing_recorder.end_step([s.req_id for s in seqs
                                                for _ in range(s.num_tokens)])
            prompt_lps = self._prompt_logprobs(seqs, hidden)
            if not sampled_seqs:
                return PendingStep.done(RunnerOutput(sampled={}, prompt_logprobs=prompt_lps))
            logits = self.model.compute_logits(hidden[logits_indices])
        else:
            prompt_lps = {}   # decode-only steps cover no prompt position that needs one
        metadata = self._metadata(sampled_seqs)
        token_ids, raw = self.sampler.sample(logits, metadata, token_masks)
        return PendingStep(req_ids=metadata.req_ids, token_ids=token_ids, raw_logprobs=raw,
                           num_logprobs=metadata.num_logprobs, prompt_logprobs=prompt_lps,
                           host_tokens=None if raw is not None
                           else self._platform.download(token_ids),
                           on_error=self._invalidate_caches)

    def _pending_ids(self, seqs: list[ScheduledSequence], previous: PendingStep | None
                     ) -> torch.Tensor | None:
        """The input tokens [n] of a step's leading ``pending_token`` decodes (scheduled ahead)
        from ``previous``'s device tokens; None for a step with none."""
        n = sum(s.pending_token for s in seqs)
        if not n:
            return None
        if not all(s.pending_token for s in seqs[:n]) or previous is None:
            raise RuntimeError(f"{n} of {len(seqs)} sequences take their token from the step "
                               f"in flight ({'none' if previous is None else 'given'}): they "
                               "lead a step scheduled ahead, which follows one")
        return previous.tokens_for([s.req_id for s in seqs[:n]])

    def _metadata(self, sampled_seqs: list[ScheduledSequence]) -> SamplingMetadata:
        """The last step's sampling metadata advanced to ``sampled_seqs`` where it can be, else
        built (``build()`` creates the generator of a seeded request on its first sampled
        step)."""
        metadata = self._sampling_metadata
        if metadata is not None:
            metadata = metadata.advance(sampled_seqs, self.eos_token_id)
        if metadata is None:
            metadata = SamplingMetadata.build(sampled_seqs, self.generators, self.device,
                                              eos_token_id=self.eos_token_id)
        self._sampling_metadata = metadata
        return metadata

    def _prompt_logprobs(self, seqs: list[ScheduledSequence], hidden: torch.Tensor
                         ) -> dict[str, list[tuple[int, SampledToken]]]:
        """For requests asking for prompt logprobs: every position q of this step's chunk
        with q + 1 < prompt length gives the logprob of prompt token q + 1 (its logits row is
        the hidden row of q, computed in this same forward)."""
        rows: list[int] = []
        owners: list[tuple[str, int]] = []          # (req_id, prompt index of the target)
        targets: list[int] = []
        ks: list[int] = []
        offset = 0
        for s in seqs:
            k = s.sampling_params.prompt_logprobs
            n_prompt = len(s.prompt_token_ids)
            if k is not None:
                for q in range(s.start_pos, min(s.start_pos + s.num_tokens, n_prompt - 1)):
                    rows.append(offset + q - s.start_pos)
                    owners.append((s.req_id, q + 1))
                    targets.append(s.prompt_token_ids[q + 1])
                    ks.append(k)
            offset += s.num_tokens
        if not rows:
            return {}
        dev = hidden.device
        entries: list[SampledToken] = []
        # In row chunks: a whole chunk's [rows, V] float32 logits and log-softmax would take
        # gigabytes at long prompts (12 GB at 8192 rows of a 152k vocabulary).
        for r0 in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            r1 = r0 + PROMPT_LOGPROB_ROWS
            logits = self.model.compute_logits(hidden[torch.tensor(rows[r0:r1], device=dev)])
            entries += prompt_logprobs(logits, torch.tensor(targets[r0:r1], device=dev),
                                       ks[r0:r1])
        out: dict[str, list[tuple[int, SampledToken]]] = {}
        for (req_id, index), entry in zip(owners, entries):
            out.setdefault(req_id, []).append((index, entry))
        return out

    def _prepare_inputs(self, seqs: list[ScheduledSequence]) -> StepInputs:
        """The step's inputs on the host (``step_inputs.py``); decode graphs stage them into
        their own buffers, an eager step moves them with ``to_device``."""
        return prepare_inputs(seqs, self.block_size, bool(self.state_layers))

    # ---- expert cache ----------------------------------------------------------------------
    def _attach_routing_recorder(self):
        path = self.config.moe_cache_config.routing_trace_path
        if not path or not self.moe_layers:
            return None
        from vllm.model_executor.layers.fused_moe.expert_cache.trace import RoutingTraceRecorder
        first = self.moe_layers[0]
        recorder = RoutingTraceRecorder(
            first.num_experts, first.top_k, model=self.config.model_config.model,
            record_scores=self.config.moe_cache_config.routing_trace_scores)
        for layer in self.moe_layers:
            layer.routing_observer = recorder.observe
        return recorder

    def _wire_prefetch(self) -> int:
        """``moe_expert_prefetch``: hook each MoE layer to prefetch the next one's experts."""
        mc = self.config.moe_cache_config
        if mc.prefetch == "off":
            return 0
        if not any(m.expert_cache is not None for m in self.moe_layers):
            logger.warning("moe_expert_prefetch=%r ignored: no MoE layer has an expert cache",
                           mc.prefetch)
            return 0
        from vllm.model_executor.layers.fused_moe.next_layer_prefetch import (
            wire_next_layer_prefetch)
        pairs = wire_next_layer_prefetch(self.model)
        logger.info("expert prefetch: next-layer, %d MoE layers predicted by the one before",
                    pairs)
        return pairs

    def _log_moe_cache_config(self) -> None:
        mc = self.config.moe_cache_config
        if mc.enabled and not self.moe_layers:
            logger.warning("moe_expert_cache_size=%d ignored: the model has no MoE layers",
                           mc.cache_size)
        elif mc.enabled:
            logger.info(self.describe_moe_cache())

    def describe_moe_cache(self) -> str:
        """One line: slots, policy and memory of the expert cache (or why it is off)."""
        mc = self.config.moe_cache_config
        caches = [m.expert_cache for m in self.moe_layers if m.expert_cache is not None]
        if not caches:
            if mc.enabled and self.moe_layers:
                return (f"expert cache: off: moe_expert_cache_size={mc.cache_size} >= num_experts="
                        f"{self.moe_layers[0].num_experts}, every expert fits on the device")
            return (f"expert cache: off ({len(self.moe_layers)} MoE layers, all experts resident "
                    "on the device)")
        per_expert = sum(c.store.bytes_per_expert for c in caches)   # summed over layers
        slot_bytes = caches[0].num_slots * per_expert
        host_bytes = caches[0].num_experts * per_expert
        pinned = "pinned" if all(c.store.pinned for c in caches) else "pageable"
        return (f"expert cache: {caches[0].num_slots} of {caches[0].num_experts} experts per layer "
                f"x {len(caches)} layers, policy {caches[0].policy_name} (requested {mc.policy}); "
                f"device slots {slot_bytes / 2**20:.1f} MiB on {self.device}, host store "
                f"{host_bytes / 2**20:.1f} MiB ({pinned})")

    def save_routing_trace(self) -> str | None:
        """Write the recorded routing (shared trace format) if a path was configured."""
        if self.routing_recorder is None or self.routing_recorder.num_tokens == 0:
            return None
        path = self.config.moe_cache_config.routing_trace_path
        self.routing_recorder.save(path)
        logger.info("routing trace of %d tokens written to %s", self.routing_recorder.num_tokens,
                    path)
        return path

    def moe_cache_stats(self) -> list[dict] | None:
        """Per-MoE-layer cache stats (reads device counters), or None when no layer is cached."""
        caches = [m.expert_cache for m in self.moe_layers if m.expert_cache is not None]
        return [c.stats() for c in caches] if caches else None

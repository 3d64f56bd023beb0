"""Routing traces: the shared ``.npz`` format and a recorder the engine attaches to every FusedMoE.

Format (numpy ``.npz``):
  experts  uint8 [T, L, K] (uint16 when E > 256): expert ids of token t at MoE layer l (model order)
  offsets  int64 [S+1]: sequence i is experts[offsets[i]:offsets[i+1]], tokens in order
  meta     0-d str: JSON with model, num_experts, top_k, num_layers, phase, source
  scores   optional float16 [T, L, E]: the router's softmax over all experts of token t at layer l
           (what a policy could use beyond the ids: an expert just below the top-k is a likely
           next pick); traces without it are read as before
"""
from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

META_KEYS = ("model", "num_experts", "top_k", "num_layers", "phase", "source")


@dataclass
class RoutingTrace:
    experts: np.ndarray           # [T, L, K] uint8/uint16
    offsets: np.ndarray           # [S+1] int64
    meta: dict = field(default_factory=dict)
    scores: np.ndarray | None = None   # [T, L, E] float16 router probabilities, optional

    def __post_init__(self) -> None:
        if self.experts.ndim != 3:
            raise ValueError(f"trace experts must be [T, L, K], got shape {self.experts.shape}")
        if self.scores is not None and (self.scores.ndim != 3 or self.scores.shape[:2]
                                        != self.experts.shape[:2]):
            raise ValueError(f"trace scores must be [T, L, E] with T, L of experts "
                             f"{self.experts.shape[:2]}, got shape {self.scores.shape}")
        off = self.offsets
        if off.ndim != 1 or off.size < 1 or off[0] != 0 or off[-1] != len(self.experts) \
                or np.any(np.diff(off) < 0):
            raise ValueError(f"trace offsets must rise from 0 to T={len(self.experts)}, got "
                             f"{off[:4].tolist()}...{off[-2:].tolist()}")

    @property
    def num_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    @property
    def num_experts(self) -> int:
        return int(self.meta.get("num_experts", int(self.experts.max(initial=0)) + 1))

    def _rows(self, index) -> np.ndarray | None:
        return None if self.scores is None else self.scores[index]

    @property
    def num_sequences(self) -> int:
        return len(self.offsets) - 1

    def truncated(self, max_tokens: int) -> "RoutingTrace":
        """The first ``max_tokens`` tokens (the last sequence may be cut short)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} is invalid: must be >= 1")
        off = np.minimum(self.offsets, max_tokens)
        off = np.concatenate([off[:1], off[1:][off[1:] > off[:-1]]])
        return RoutingTrace(self.experts[:max_tokens], off.astype(np.int64), dict(self.meta),
                            self._rows(slice(0, max_tokens)))

    def subset(self, seq_indices: Sequence[int]) -> "RoutingTrace":
        """Only the given sequences, in the given order (e.g. the odd-indexed held-out half)."""
        rows = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1])
                               for i in seq_indices] or [np.zeros(0, np.int64)]).astype(np.int64)
        lens = [int(self.offsets[i + 1] - self.offsets[i]) for i in seq_indices]
        off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        return RoutingTrace(self.experts[rows], off, dict(self.meta), self._rows(rows))


def save_trace(path: str, trace: RoutingTrace) -> None:
    e_max = int(trace.experts.max(initial=0))
    dtype = np.uint8 if max(e_max, trace.num_experts - 1) < 256 else np.uint16
    meta = dict(trace.meta)
    meta.setdefault("num_layers", trace.num_layers)
    meta.setdefault("top_k", trace.top_k)
    extra = {} if trace.scores is None else {"scores": trace.scores.astype(np.float16)}
    np.savez(path, experts=trace.experts.astype(dtype), offsets=trace.offsets.astype(np.int64),
             meta=np.array(json.dumps(meta)), **extra)


def load_trace(path: str) -> RoutingTrace:
    with np.load(path) as data:
        missing = {"experts", "offsets"} - set(data.files)
        if missing:
            raise ValueError(f"{path}: not a routing trace, missing {sorted(missing)}")
        meta = json.loads(str(data["meta"])) if "meta" in data.files else {}
        scores = data["scores"] if "scores" in data.files else None
        return RoutingTrace(data["experts"], data["offsets"].astype(np.int64), meta, scores)


class RoutingTraceRecorder:
    """Collects every MoE layer's ``topk_ids`` per step, on device, until ``save``.

    Usage: ``layer.routing_observer = recorder.observe`` for each FusedMoE; call ``end_step`` after
    each forward (optionally with the sequence key of every token); ``start_sequence`` marks a new
    sequence when steps carry no keys. Nothing is copied to the host before ``save``.
    """

    def __init__(self, num_experts: int, top_k: int, model: str = "", phase: str = "mixed",
                 source: str = "vllm RoutingTraceRecorder", record_scores: bool = False):
        self.meta = {"model": model, "num_experts": num_experts, "top_k": top_k,
                     "phase": phase, "source": source}
        self.record_scores = record_scores
        """Also keep the router's softmax over all experts ([T, E] per layer, float16)."""
        self._pending: dict[int, torch.Tensor] = {}    # layer_index -> [T, K] int32 (device)
        self._pending_scores: dict[int, torch.Tensor] = {}   # layer_index -> [T, E] float16
        self._score_chunks: list[torch.Tensor] = []          # each [T_step, L, E] float16
        self._layers: tuple[int, ...] | None = None     # MoE layer indices, model order
        self._chunks: list[torch.Tensor] = []           # each [T_step, L, K] int32 (device)
        self._keys: list[Hashable] = []                 # sequence key per recorded token
        self._seq = 0

    def observe(self, layer_index: int, topk_ids: torch.Tensor,
                router_logits: torch.Tensor | None = None) -> None:
        """FusedMoE.routing_observer hook: topk_ids [T, K] (and the router logits [T, E]) for
        this layer in the current step."""
        if topk_ids.dim() != 2 or topk_ids.shape[1] != self.meta["top_k"]:
            raise ValueError(f"layer {layer_index}: topk_ids must be [T, {self.meta['top_k']}], "
                             f"got {tuple(topk_ids.shape)}")
        if layer_index in self._pending:
            raise ValueError(f"layer {layer_index} observed twice in one step; call end_step()")
        self._pending[layer_index] = topk_ids.detach().to(torch.int32)
        if self.record_scores:
            if router_logits is None:
                raise ValueError(f"layer {layer_index}: record_scores needs the router logits")
            probs = router_logits.detach().float().softmax(dim=-1)
            self._pending_scores[layer_index] = probs.to(torch.float16)

    def start_sequence(self) -> None:
        """Tokens of later un-keyed steps belong to a new sequence."""
        self._seq += 1

    def end_step(self, token_seq_keys: Sequence[Hashable] | None = None) -> None:
        """Close the step. token_seq_keys: one sequence key per token of the step (host values
        from the scheduler); None: all tokens belong to the current sequence."""
        if not self._pending:
            return
        layers = tuple(sorted(self._pending))
        if self._layers is None:
            self._layers = layers
        elif layers != self._layers:
            raise ValueError(f"step observed MoE layers {layers}, earlier steps {self._layers}")
        ids = [self._pending[i] for i in layers]
        num_tokens = ids[0].shape[0]
        if any(t.shape[0] != num_tokens for t in ids):
            raise ValueError(f"layers saw different token counts {[t.shape[0] for t in ids]}")
        if token_seq_keys is not None and len(token_seq_keys) != num_tokens:
            raise ValueError(f"token_seq_keys has {len(token_seq_keys)} keys for "
                             f"{num_tokens} tokens")
        self._chunks.append(torch.stack(ids, dim=1))                     # [T, L, K]
        if self.record_scores:
            self._score_chunks.append(torch.stack([self._pending_scores[i] for i in layers],
                                                  dim=1))                # [T, L, E]
            self._pending_scores = {}
        keys = token_seq_keys if token_seq_keys is not None else [("_seq", self._seq)] * num_tokens
        self._keys.extend(keys)
        self._pending = {}

    @property
    def num_tokens(self) -> int:
        return len(self._keys)

    def to_trace(self) -> RoutingTrace:
        """Group tokens by sequence (in order of first appearance), one host copy."""
        self.end_step()
        if not self._chunks:
            raise ValueError("nothing recorded: no MoE layer was observed")
        experts = torch.cat(self._chunks).cpu().numpy()                  # [T, L, K]
        first: dict[Hashable, int] = {}
        for k in self._keys:
            first.setdefault(k, len(first))
        seq_of_token = np.array([first[k] for k in self._keys])
        order = np.argsort(seq_of_token, kind="stable")
        counts = np.bincount(seq_of_token, minlength=len(first))
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        meta = dict(self.meta, num_layers=len(self._layers))
        scores = torch.cat(self._score_chunks).cpu().numpy()[order] if self._score_chunks else None
        return RoutingTrace(experts[order], offsets, meta, scores)

    def save(self, path: str) -> RoutingTrace:
        trace = self.to_trace()
        save_trace(path, trace)
        return trace


def interleave(offsets: np.ndarray, batch: int) -> np.ndarray:
    """[S, batch] token indices per step, -1 = idle lane: ``batch`` lanes each run one sequence
    token by token; a lane that finishes takes the next unstarted sequence (continuous batching)."""
    if batch < 1:
        raise ValueError(f"batch={batch} is invalid: must be >= 1")
    starts, ends = offsets[:-1], offsets[1:]
    nxt, pos, end = 0, np.full(batch, -1), np.full(batch, -1)
    steps = []
    while True:
        for lane in range(batch):
            while pos[lane] >= end[lane] and nxt < len(starts):   # lane idle: take a sequence
                pos[lane], end[lane] = starts[nxt], ends[nxt]
                nxt += 1
        active = pos < end
        if not active.any():
            break
        steps.append(np.where(active, pos, -1))
        pos = np.where(active, pos + 1, pos)
    return np.array(steps, dtype=np.int64).reshape(-1, batch)


def step_masks(trace: RoutingTrace, batch: int) -> np.ndarray:
    """[S, L, E] bool: experts each layer needs at each step (union over the step's tokens)."""
    tokens = interleave(trace.offsets, batch)                             # [S, B]
    num_steps, num_experts = len(tokens), trace.num_experts
    masks = np.zeros((num_steps, trace.num_layers, num_experts), dtype=bool)
    step_of, lane_tok = np.nonzero(tokens >= 0)
    ids = trace.experts[tokens[step_of, lane_tok]].astype(np.int64)       # [n, L, K]
    layer = np.arange(trace.num_layers)[None, :, None]
    masks[step_of[:, None, None], layer, ids] = True
    return masks

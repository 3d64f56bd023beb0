"""Misses computed on the CPU from the host store (``moe_expert_cpu_compute``, off by default).

Where the link is slow (PCIe 4 x4 laptops, WSL), running a missing expert's few tokens on the
CPU, which reads the expert from RAM, can be cheaper than copying the expert to the device.
Per step and cached layer, with a mode other than "off":
  1. the routing and the layer's residency are read on the host (one synchronisation: a decode
     graph runs this split, and step 4's pairs, eagerly between its pieces, ``step``);
  2. each *missing* expert (needed, not resident) goes to the CPU in mode "always", and in
     "auto" while the CPU time spent on it since it was last copied, this step's included,
     stays under one copy's (``rent_or_buy``, ski rental over ``HostCostModel``); else it is
     copied as usual. Where the copies and the CPU run side by side (a GPU: its link and the
     host's cores), "auto" also moves to the CPU the least used of the misses it would copy
     while that shortens the step (``balance``: the step waits for the longer of the two);
  3. its pairs leave the device's ids (-1), so the residency step, the copies and the policy
     see only the rest: a miss computed on the CPU is not loaded, and the cache's contents
     change only through the misses that are copied (and prefetch);
  4. the rows of the step's inputs that have a CPU pair go to the host while the device is
     idle, the device's waves are enqueued, and the CPU computes its pairs meanwhile
     (``compute``); only those pairs come back, written into the layer's [T, top_k, H] pairs
     (where the waves, which skip them, left zeros) before its k-order combine.
On the device the pairs come from another kernel than the CPU's, so outputs may differ by
rounding; where both sides run the same kernel (CPU device: the layer's own) they are bitwise
equal to the uncached layer's.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from vllm.config import MOE_CPU_COMPUTE_MODES
from vllm.model_executor.forward_context import PAD_SLOT_ID
from vllm.model_executor.graph_break import break_graph, capturing_in_pieces
from vllm.model_executor.layers.fused_moe.expert_cache.copy import CopyMisses
from vllm.model_executor.layers.fused_moe.expert_cache.residency import LoadPlan
from vllm.model_executor.layers.fused_moe.modular_kernel import MoEExperts
from vllm.platforms import platform_for


USE_HALF_LIFE = 30.0
"""Steps over which a layer's per-expert use counts (``HostMissCompute.use``) halve. They order
the misses ``balance`` moves to the CPU, least used first: the copies skipped are those least
likely to have served a later hit. 30 is ``lrfu``'s half-life, tuned on the DeepSeek-V2-Lite
trace (docs/expert-cache-policies.md): a memory of tens of steps."""


EARLY_READ_BYTES = 1 << 18
"""Steps whose inputs (x and the top-k weights, [T, H + top_k]) take at most this many bytes
(decode: a few rows) send them to the host with the routing's read, whether or not a pair goes
to the CPU: one device round trip per layer instead of two."""


@dataclass(frozen=True)
class HostCostModel:
    """Seconds to serve one missing expert: copy it (``copy_seconds``), or run its ``t`` tokens
    on the CPU (``cpu_fixed + cpu_per_token * t``: reading the weights, then the FLOPs).
    ``concurrent``: whether the copies run while the CPU computes (a GPU's link beside the
    host's cores; not a CPU device, whose copies take the same cores)."""
    copy_seconds: float
    cpu_fixed: float
    cpu_per_token: float
    concurrent: bool = False

    def cpu_seconds(self, tokens) -> np.ndarray:
        """tokens [E] (pairs per expert this step) -> [E] float64 seconds on the CPU."""
        return self.cpu_fixed + self.cpu_per_token * np.asarray(tokens, dtype=np.float64)


def rent_or_buy(spent, cpu_seconds, tokens, copy_seconds: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """Ski rental per missing expert: compute on the CPU ("rent") while what the CPU has spent
    on it since it was last loaded, this step included, stays under one copy ("buy"); then
    copy it. An expert needed once is never copied; one that keeps missing is copied once the
    CPU has spent a copy's worth on it (at most twice the cost of knowing the future).
    spent [E] float64, cpu_seconds [E], tokens [E] (0: not missing) -> (rent [E] bool, the new
    spent: grown where rented, 0 where bought, kept elsewhere). Host arrays (numpy, or
    anything ``np.asarray`` takes): [E] is small, and the step waits on this decision."""
    spent, cpu = np.asarray(spent, dtype=np.float64), np.asarray(cpu_seconds, dtype=np.float64)
    missing = np.asarray(tokens) > 0
    rent = missing & (spent + cpu < copy_seconds)
    return rent, np.where(rent, spent + cpu, np.where(missing, 0.0, spent))


def balance(buy, use, cpu_seconds, copy_seconds: float, cpu_busy: float) -> np.ndarray:
    """Which of the misses to be copied (``buy`` [E] bool) the CPU takes instead, when the copies
    and the CPU run side by side and the step waits for the longer: (copies left) x
    ``copy_seconds`` against ``cpu_busy`` (the CPU's rentals so far) plus the CPU time
    (``cpu_seconds`` [E]) of those taken. Candidates least used first (``use`` [E]; ties: lower
    id), each taken when that makes the wait strictly shorter, i.e. when the CPU's time with it
    stays under the current wait (a tie keeps the copy: it also serves the expert's later
    uses); one too slow for the CPU is copied and the next is tried. -> [E] bool (numpy)."""
    buy = np.asarray(buy, dtype=bool)
    moved = np.zeros_like(buy)
    ids = np.flatnonzero(buy)                                           # ascending
    order = ids[np.argsort(np.asarray(use)[ids], kind="stable")].tolist()
    seconds = np.asarray(cpu_seconds, dtype=np.float64)
    copies, cpu = len(order), float(cpu_busy)
    for e in order:
        # Taking e: max((copies - 1) x copy, cpu + seconds[e]) against max(copies x copy, cpu).
        if cpu + seconds[e] < max(copies * copy_seconds, cpu):
            cpu += seconds[e]
            copies -= 1
            moved[e] = True
    return moved


def _best_seconds(fn, repeats: int = 3) -> float:
    """Best of ``repeats`` calls ``fn(r)``, each on another expert, so no call finds the last
    one's weights in the CPU caches (a real miss reads its expert from RAM)."""
    best = float("inf")
    for r in range(repeats):
        start = time.perf_counter()
        fn(r)
        best = min(best, time.perf_counter() - start)
    return best


def measure_cost_model(store_tensors: dict[str, torch.Tensor], slots: dict[str, torch.Tensor],
                       experts: MoEExperts, hidden_size: int, dtype: torch.dtype,
                       probe_tokens: int = 8, copy: CopyMisses | None = None) -> HostCostModel:
    """Times one expert's copy into slot 0 (waiting for the device) and the CPU on 1 and
    ``probe_tokens`` tokens of an expert, the best of 3 experts each. ``copy``: the layer's copy
    engine, so the time is that of the path misses take (else a ``copy_`` per tensor).
    Overwrites slot 0: call only while every slot is empty (``CachedWeightProvider.
    enable_host_compute`` checks)."""
    device = next(iter(slots.values())).device
    num_experts = next(iter(store_tensors.values())).shape[0]
    plans = [LoadPlan(torch.zeros(1, dtype=torch.int64, device=device),
                      torch.full((1,), r % num_experts, dtype=torch.int64, device=device),
                      torch.ones(1, dtype=torch.bool, device=device)) for r in range(3)]

    def wait():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def copy_one(r: int):
        if copy is not None:
            copy(slots, plans[r])
        else:
            for n, t in store_tensors.items():
                slots[n][0].copy_(t[r % num_experts], non_blocking=True)
        wait()

    wait()   # the clock starts on an idle device, not behind the slots' zero fills
    def cpu(tokens: int, first: int):
        x = torch.randn(tokens, hidden_size, device="cpu").to(dtype)
        w = torch.ones(tokens, 1, dtype=dtype, device="cpu")
        out = torch.zeros(tokens, 1, hidden_size, dtype=dtype, device="cpu")

        def run(r: int):
            ids = torch.full((tokens, 1), (first + r) % num_experts, dtype=torch.int64)
            experts.apply_pairs(store_tensors, x, w, ids, out)
        return run

    copy_seconds = _best_seconds(copy_one)
    one, many = _best_seconds(cpu(1, 3)), _best_seconds(cpu(probe_tokens, 6))
    per_token = max(0.0, (many - one) / (probe_tokens - 1))
    return HostCostModel(copy_seconds, max(0.0, one - per_token), per_token,
                         concurrent=device.type != "cpu")


_COST_MODELS: dict[tuple, HostCostModel] = {}
"""``cost_model_for``'s measurements, by (device, store layout, CPU kernel, copy engine, hidden,
dtype)."""


def cost_model_for(store_tensors: dict[str, torch.Tensor], slots: dict[str, torch.Tensor],
                   experts: MoEExperts, hidden_size: int, dtype: torch.dtype,
                   copy: CopyMisses | None = None) -> HostCostModel:
    """``measure_cost_model`` once per process for each device, store layout (names, kinds:
    tensors or exp12 planes, per-expert shapes and dtypes), CPU kernel, copy engine, hidden
    size and dtype: a model's cached layers share one measurement (taken by the first, while
    its slots are empty), so loading does not repeat it per layer and their decisions rest on
    the same numbers."""
    device = next(iter(slots.values())).device
    key = (str(device), tuple((n, type(t), tuple(t.shape[1:]), t.dtype)
                              for n, t in store_tensors.items()),
           type(experts), type(copy), hidden_size, dtype)
    if key not in _COST_MODELS:
        _COST_MODELS[key] = measure_cost_model(store_tensors, slots, experts, hidden_size, dtype,
                                               copy=copy)
    return _COST_MODELS[key]


@dataclass
class HostSplit:
    """One step's split: ``device_ids`` [T, top_k] on the device (the CPU's pairs -1) and
    ``pair_index`` [P] on the device (the CPU's pairs as flat indices t * top_k + k, ascending);
    on the host, for the R rows that have a CPU pair (ascending), ``host_ids`` [R, top_k] (global
    expert ids, -1 where the device computes), ``x`` [R, H] and ``topk_weights`` [R, top_k] (in
    x's dtype), copied while the device was idle, so ``compute`` never waits for the device."""
    device_ids: torch.Tensor
    pair_index: torch.Tensor
    host_ids: torch.Tensor
    x: torch.Tensor
    topk_weights: torch.Tensor


class HostMissCompute:
    """The CPU side of one cached layer: decides the split, computes its pairs, counts them."""

    def __init__(self, mode: str, experts: MoEExperts, store_tensors: dict[str, torch.Tensor],
                 cost: HostCostModel | None):
        if mode not in MOE_CPU_COMPUTE_MODES[1:]:
            raise ValueError(f"moe_expert_cpu_compute={mode!r} is invalid here: must be one of "
                             f"{list(MOE_CPU_COMPUTE_MODES[1:])}")
        if mode == "auto" and cost is None:
            raise ValueError("moe_expert_cpu_compute='auto' needs a cost model")
        self.mode, self.experts, self.store_tensors, self.cost = mode, experts, store_tensors, cost
        self.pairs = 0
        """Pairs computed on the CPU so far."""
        self.expert_calls = 0
        """(step, expert) calls computed on the CPU so far: each saved one expert copy."""
        self.spent: np.ndarray | None = None
        """[E] float64 seconds of CPU work per expert since it was last copied (mode "auto")."""
        self.use: np.ndarray | None = None
        """[E] float64 steps that used each expert, halved every ``USE_HALF_LIFE`` steps (mode
        "auto"): ``balance``'s order."""

    def host_pairs(self, topk_ids: torch.Tensor, slot_of_expert: torch.Tensor,
                   row_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """topk_ids [T, top_k] (device), slot_of_expert [E] (the residency before this step),
        row_slots [T] or None (rows whose KV slot is PAD_SLOT_ID are a decode graph's padding)
        -> (ids [T, top_k] on the host, [T, top_k] bool: the pairs the CPU computes). One read
        of the device."""
        T, K = topk_ids.shape
        parts = [topk_ids.reshape(-1), slot_of_expert]
        if row_slots is not None:
            parts.append(row_slots.reshape(-1))
        both = torch.cat(parts).to("cpu")                                     # the sync
        ids = both[:T * K].view(T, K)
        # numpy from here: a few [E] and [T, K] operations, each far cheaper than a torch op.
        num_experts = slot_of_expert.shape[0]
        flat, resident = ids.numpy(), both[T * K:T * K + num_experts].numpy() >= 0
        known = (flat >= 0) & (flat < num_experts)          # others route nowhere, as the steps
        if row_slots is not None:                           # and padding rows, as ``prepare``
            known &= (both[T * K + num_experts:].numpy() != PAD_SLOT_ID)[:, None]
        clamped = flat.clip(0, num_experts - 1)
        miss = known & ~resident[clamped]
        if self.mode == "auto":
            if self.spent is None:
                self.spent = np.zeros(num_experts)
                self.use = np.zeros(num_experts)
            # A resident expert was copied since it last ran on the CPU (as a miss or by
            # prefetch): its next rental starts from nothing.
            self.spent[resident] = 0.0
            if miss.any():
                miss &= self._rent(flat[miss], num_experts)[clamped]
            used = np.bincount(flat[known], minlength=num_experts) > 0
            self.use *= 0.5 ** (1.0 / USE_HALF_LIFE)
            self.use += used
        return ids, torch.from_numpy(miss)

    def _rent(self, missing_ids: np.ndarray, num_experts: int) -> np.ndarray:
        """Mode "auto": [E] bool, the missing experts the CPU computes this step (ski rental,
        then ``balance`` where the copies run beside the CPU); updates ``spent``."""
        cost = self.cost
        tokens = np.bincount(missing_ids, minlength=num_experts)        # [E] pairs per miss
        cpu = cost.cpu_seconds(tokens)
        rent, spent = rent_or_buy(self.spent, cpu, tokens, cost.copy_seconds)
        if cost.concurrent:
            moved = balance((tokens > 0) & ~rent, self.use, cpu, cost.copy_seconds,
                            float(cpu[rent].sum()))
            rent |= moved
            spent = np.where(moved, self.spent + cpu, spent)
        self.spent = spent
        return rent

    def split(self, topk_ids: torch.Tensor, slot_of_expert: torch.Tensor, x: torch.Tensor,
              topk_weights: torch.Tensor, row_slots: torch.Tensor | None = None
              ) -> HostSplit | None:
        """The step's split (``host_pairs``), or None when the device computes every pair.
        x [T, H] and topk_weights [T, top_k] are the device's; row_slots as ``host_pairs``'s (a
        decode graph runs this split eagerly between its pieces, padding rows included: they
        stay on the device, which routes them nowhere). One read of the device for a small
        step (its inputs come with the routing: ``EARLY_READ_BYTES``), else two (the routing,
        then the CPU's rows of the inputs); one upload (the device's ids and pairs, and the
        CPU's rows if read later)."""
        T, K = topk_ids.shape
        early = None
        if T * (x.shape[1] + K) * x.element_size() <= EARLY_READ_BYTES:
            # Queued before host_pairs' blocking read on the same stream, so it has landed when
            # that read returns.
            early = torch.cat([x, topk_weights.to(x.dtype)], 1).to("cpu", non_blocking=True)
        ids, miss = self.host_pairs(topk_ids, slot_of_expert, row_slots)
        flat, miss = ids.numpy(), miss.numpy()                        # host [T, K]
        if not miss.any():
            return None
        self.pairs += int(miss.sum())
        self.expert_calls += len(np.unique(flat[miss]))
        rows = np.flatnonzero(miss.any(1))                            # [R] ascending
        pair_index = np.flatnonzero(miss)                             # [P] ascending
        dev = topk_ids.device
        sent = [np.where(miss, -1, flat).reshape(-1), pair_index] + ([rows] if early is None
                                                                     else [])
        up = platform_for(dev).upload(torch.from_numpy(np.concatenate(sent)), dev)
        device_ids = up[:T * K].view(T, K).to(topk_ids.dtype)
        P = pair_index.size
        if early is not None:
            inputs = early[torch.from_numpy(rows)]
        else:
            # The device is idle here (the router's ids were just read), so this read waits
            # only for the gather; the device's waves are enqueued after it.
            rows_dev = up[T * K + P:]
            inputs = torch.cat([x.index_select(0, rows_dev),
                                topk_weights.index_select(0, rows_dev).to(x.dtype)], 1).to("cpu")
        H = x.shape[-1]
        return HostSplit(device_ids, up[T * K:T * K + P],
                         torch.from_numpy(np.where(miss[rows], flat[rows], -1)),
                         inputs[:, :H].contiguous(), inputs[:, H:].contiguous())

    def step(self, topk_ids: torch.Tensor, slot_of_expert: torch.Tensor, x: torch.Tensor,
             topk_weights: torch.Tensor, row_slots: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, Callable[[torch.Tensor], None] | None]:
        """A step's (device ids [T, top_k], the layer's ``host_pairs`` or None): ``split`` now,
        ``compute`` when the layer calls ``host_pairs``. While a decode graph is captured in
        pieces (``graph_break``) both become breaks that run eagerly at every replay, the split
        before the device's waves (captured between them: the ids come through the break)
        and the CPU's pairs after them, written in place into the layer's pairs."""
        if not capturing_in_pieces():
            split = self.split(topk_ids, slot_of_expert, x, topk_weights, row_slots)
            if split is None:
                return topk_ids, None
            return split.device_ids, partial(self.compute, split)
        held: list[HostSplit | None] = [None]          # this replay's split, for its pairs

        def decide() -> torch.Tensor:
            held[0] = self.split(topk_ids, slot_of_expert, x, topk_weights, row_slots)
            return topk_ids if held[0] is None else held[0].device_ids

        def host_pairs(out: torch.Tensor) -> None:
            def compute() -> None:
                if held[0] is not None:
                    self.compute(held[0], out)
            break_graph(compute, None)
        return break_graph(decide, topk_ids), host_pairs

    def compute(self, split: HostSplit, out: torch.Tensor) -> None:
        """Writes the pairs ``split`` gives the CPU into out [T, top_k, H] (the device's, where
        the waves left them 0): computed from the host store while the device runs its waves,
        then only those P rows go back, asynchronously through pinned memory where allowed."""
        R, K = split.host_ids.shape
        rows = torch.zeros(R, K, split.x.shape[-1], dtype=split.x.dtype, device="cpu")
        self.experts.apply_pairs(self.store_tensors, split.x, split.topk_weights,
                                 split.host_ids, rows)
        pairs = rows[split.host_ids >= 0]                              # [P, H], ascending
        out.view(-1, out.shape[-1]).index_copy_(0, split.pair_index,
                                                platform_for(out.device).upload(pairs, out.device))

    def stats(self) -> dict[str, int]:
        return {"cpu_pairs": self.pairs, "cpu_expert_calls": self.expert_calls}

    def reset_stats(self) -> None:
        self.pairs = self.expert_calls = 0

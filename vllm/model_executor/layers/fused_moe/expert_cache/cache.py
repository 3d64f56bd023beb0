"""ExpertCache: one MoE layer's host store, device slots, residency and the cached forward.

Forward contract (bitwise equal to the uncached ``quant_method.apply``):
  needed experts = those in topk_ids, split into W = ceil(min(E, T*K) / N) waves of at most N
  (static in the shapes); per wave: Residency.plan -> copy the misses -> remap topk_ids to slot ids
  with pairs of other waves set to -1 -> ``apply_pairs`` into one shared out [T, K, H]; finally
  ``combine_pairs(out)``, the same reduction the uncached ``apply`` does. Every pair is computed
  exactly once, by the same expert weights, over the same tokens in the same order.

No host synchronisation in the forward on CPU (or on CUDA with a registered copy kernel): all
bookkeeping is fixed-shape device tensor code, and counters are read only by ``stats()``.
Compiling it with ``torch.compile(fullgraph=True)`` needs
``torch._dynamo.config.capture_dynamic_output_shape_ops = True`` (the CPU copy uses ``nonzero``,
and so does the torch reference kernel); the compiling caller sets it, not this module, since
it is process-global.

The cache is deliberately not an ``nn.Module``: ``layer.to(...)`` / ``model.to(...)`` must never
move the host store onto the device.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from vllm.config import MoECacheConfig
from vllm.logger import init_logger, log_once
from vllm.model_executor.layers.fused_moe.backend import combine_pairs
from vllm.model_executor.layers.scratch import scratch
from vllm.model_executor.layers.fused_moe.expert_cache import policy as policy_mod
from vllm.model_executor.layers.fused_moe.expert_cache.copy import copy_misses
from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency, split_waves
from vllm.model_executor.layers.fused_moe.expert_cache.slots import allocate_slots, install_slots
from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore

logger = init_logger(__name__)

CPU_NO_SAVING_MSG = ("Expert cache on a CPU device: the host store and the slots share the same RAM, "
                     "so the cache saves no memory here; results are still exact.")


def resolve_policy_name(name: str) -> str:
    """"auto" -> the policy module's DEFAULT_POLICY ("lru" if it defines none)."""
    return getattr(policy_mod, "DEFAULT_POLICY", "lru") if name == "auto" else name


class ExpertCache:
    def __init__(self, store: HostStore, residency: Residency, names: tuple[str, ...],
                 policy_name: str, device: torch.device):
        self.store = store
        self.residency = residency
        self.names = names
        """The layer's expert-indexed tensor names; the layer's params of these names are the slots."""
        self.policy_name = policy_name
        self.device = device
        self.non_blocking = store.pinned and device.type == "cuda"
        i64 = dict(dtype=torch.int64, device=device)
        self._experts_copied = torch.zeros((), **i64)   # counted from the plans' valid masks
        self._waves = torch.zeros((), **i64)            # waves run (including empty ones)

    @property
    def num_experts(self) -> int:
        return self.residency.num_experts

    @property
    def num_slots(self) -> int:
        return self.residency.num_slots

    @classmethod
    def from_layer(cls, layer: nn.Module, config: MoECacheConfig, device: torch.device | str,
                   pin: bool | None = None) -> "ExpertCache":
        """Move a loaded layer's experts into a host store and give the layer N device slots.

        layer: a FusedMoE whose expert params ([E, ...], named by its quant method's
        ``expert_tensor_names()``) are loaded, ideally in host memory, and not yet processed.
        Each expert goes through ``quant_method.process_expert`` into the store; then the
        layer's expert params are replaced by zeroed slot tensors [N, ...] on ``device``.
        pin: page-lock the store; None = only when ``device`` is CUDA.
        """
        device = torch.device(device)
        qm = layer.quant_method
        names = tuple(qm.expert_tensor_names())
        if device.type == "cpu":
            log_once(logger, logging.INFO, CPU_NO_SAVING_MSG)
        pin = device.type == "cuda" if pin is None else pin
        store = HostStore.from_layer(layer, names, qm.process_expert, pin=pin)
        slots = allocate_slots(store, config.cache_size, device)
        install_slots(layer, slots)
        policy_name = resolve_policy_name(config.policy)
        residency = Residency(store.num_experts, config.cache_size,
                              policy_mod.get_policy(policy_name), device)
        return cls(store, residency, names, policy_name, device)

    def forward(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, K], topk_ids [T, K] global expert ids -> [T, H]."""
        T, K = topk_ids.shape
        if x.shape[0] != T or topk_weights.shape != topk_ids.shape:
            raise ValueError(f"shape mismatch: x {tuple(x.shape)}, topk_weights "
                             f"{tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}; "
                             "need x [T, H] and topk_* [T, K]")
        res = self.residency
        E = self.num_experts
        # Negative ids (skipped pairs, as in apply_pairs' contract) go to a dump entry E.
        valid = topk_ids >= 0                                                # [T, K]
        ids = torch.where(valid, topk_ids, E)                                # [T, K] in [0, E]
        needed = torch.zeros(E + 1, dtype=torch.bool, device=topk_ids.device)
        needed = needed.index_fill_(0, ids.reshape(-1), True)[:E]            # [E]
        # Wave masks are fixed against the residency before any wave is planned.
        waves = split_waves(needed, res.slot_of_expert, self.num_slots, T * K)
        slots = {n: getattr(layer, n) for n in self.names}   # the layer's params are the slots
        out = scratch("moe.pairs", (T, K, x.shape[-1]), x.dtype, x.device).zero_()  # [T, K, H]
        for wave in waves:                                                   # static count W
            plan = res.plan(wave)
            copy_misses(self.store, slots, plan, self.non_blocking)
            self._experts_copied.add_(plan.valid.sum())
            in_wave = wave[ids.clamp(max=E - 1)] & valid                     # [T, K] bool
            slot_ids = torch.where(in_wave, res.remap(ids.clamp(max=E - 1)), -1)  # [T, K] slots
            layer.quant_method.apply_pairs(layer, x, topk_weights, slot_ids, out)
        self._waves.add_(len(waves))
        return combine_pairs(out)

    def stats(self) -> dict[str, int | float]:
        """Cumulative counters as Python numbers (the cache's only host sync)."""
        r = self.residency
        hits, misses, evictions, copied, waves = torch.stack(
            [r.hits, r.misses, r.evictions, self._experts_copied, self._waves]).tolist()
        return {"hits": hits, "misses": misses, "evictions": evictions,
                "experts_copied": copied,
                "bytes_copied": copied * self.store.bytes_per_expert,
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "waves": waves}

    def reset_stats(self) -> None:
        """Zero the counters (residency and policy state are kept)."""
        for t in (self.residency.hits, self.residency.misses, self.residency.evictions,
                  self._experts_copied, self._waves):
            t.zero_()

"""Weight providers: where a FusedMoE's expert tensors live, and the one seam to its kernels.

Per step the layer asks its provider ``prepare(topk_ids)`` -> the waves of ids the expert kernel
runs on, and ``slot_weights()`` -> the tensors those ids index, and hands both to
``quant_method.apply``; it knows nothing else of the provider.

``IdentityProvider`` (no cache): all E experts on the compute device; the ids go through
unchanged as one wave.

``CachedWeightProvider`` (``moe_expert_cache_size`` N < E): the one owner of the layer's host
store (every expert-indexed tensor the quant method declares, run through its
``prepare_expert``), the N device slots of each, the residency and policy state, the copy engine
and the counters. Its plan contract (bitwise equal to the uncached ``apply``):
  needed experts = those in topk_ids, split into W = ceil(min(E, T*K) / N) waves of at most N
  (static in the shapes); iterating the plan runs, per wave: ``Residency.plan`` -> copy the
  misses -> remap topk_ids to slot ids with pairs of other waves set to -1, and yields them.
  Every pair is computed exactly once, by the same expert weights, over the same tokens in the
  same order, and the layer reduces all waves with the uncached reduction.
No host synchronisation on CPU (or on CUDA with a registered copy kernel): all bookkeeping is
fixed-shape device tensor code, and counters are read only by ``stats()``. Compiling it with
``torch.compile(fullgraph=True)`` needs ``torch._dynamo.config.capture_dynamic_output_shape_ops
= True`` (the CPU copy uses ``nonzero``, and so does the torch reference kernel); the compiling
caller sets it, since it is process-global.

Providers are deliberately not ``nn.Module``s: ``model.to(...)`` must never move the host store
onto the device.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from vllm.config import MoECacheConfig
from vllm.logger import init_logger, log_once
from vllm.model_executor.layers.fused_moe.expert_cache.copy import select_copy
from vllm.model_executor.layers.fused_moe.expert_cache.policy import DEFAULT_POLICY, get_policy
from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency, split_waves
from vllm.model_executor.layers.fused_moe.expert_cache.slots import allocate_slots, as_parameter
from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore, ProcessExpert
from vllm.platforms import platform_for

logger = init_logger(__name__)

CPU_NO_SAVING_MSG = ("Expert cache on a CPU device: the host store and the slots share the same RAM, "
                     "so the cache saves no memory here; results are still exact.")


def cache_enabled(config: MoECacheConfig | None, num_experts: int) -> bool:
    """A layer is cached when 0 < N < E (N >= E: every expert fits, the cache would be waste)."""
    return config is not None and 0 < config.cache_size < num_experts


def resolve_policy_name(name: str) -> str:
    """"auto" -> the measured default policy."""
    return DEFAULT_POLICY if name == "auto" else name


class WeightProvider:
    """What a FusedMoE asks of the place its experts live."""

    cached: bool = False
    names: tuple[str, ...] = ()
    """The layer's expert-indexed tensor names (keys of ``slot_weights()``)."""

    def prepare(self, topk_ids: torch.Tensor) -> "Iterator[torch.Tensor] | tuple[torch.Tensor]":
        """topk_ids [T, K] expert ids (-1 = skip) -> waves of ids [T, K] into ``slot_weights()``."""
        raise NotImplementedError

    def slot_weights(self) -> dict[str, torch.Tensor]:
        """name -> [G, ...] device tensor the kernel reads (G = E experts, or N slots)."""
        raise NotImplementedError


class IdentityProvider(WeightProvider):
    """Every expert resident: slot e is expert e, one wave."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self._weights = {n: as_parameter(t) for n, t in weights.items()}
        self.names = tuple(weights)

    def prepare(self, topk_ids):
        return (topk_ids,)

    def slot_weights(self):
        return self._weights


class ExpertPlan:
    """One step's waves (a static count). Iterate once, in order, running the kernel of a wave
    before asking for the next: a later wave's copies may overwrite slots an earlier wave read
    (on a device, stream order keeps that safe)."""

    def __init__(self, provider: "CachedWeightProvider", waves: list[torch.Tensor],
                 ids: torch.Tensor, valid: torch.Tensor):
        self.provider, self.waves = provider, waves   # waves: each [E] bool, <= N experts
        self.ids, self.valid = ids, valid             # [T, K] in [0, E), [T, K] bool

    def __len__(self) -> int:
        return len(self.waves)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for wave in self.waves:
            yield self.provider.load_wave(wave, self.ids, self.valid)


class CachedWeightProvider(WeightProvider):
    cached = True

    def __init__(self, store: HostStore, slots: dict[str, torch.Tensor], residency: Residency,
                 policy_name: str):
        if list(slots) != list(store.tensors):
            raise ValueError(f"slots {list(slots)} and store {list(store.tensors)} must name the "
                             "same tensors in the same order")
        self.store, self.slots, self.residency = store, slots, residency
        self.names = tuple(slots)
        self.policy_name = policy_name
        self.device = next(iter(slots.values())).device
        store_device = next(iter(store.tensors.values())).device
        self.non_blocking = store.pinned and self.device != store_device
        self._copy = select_copy(store, self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        self._experts_copied = torch.zeros((), **i64)   # counted from the plans' valid masks
        self._waves = torch.zeros((), **i64)            # waves run (including empty ones)

    @classmethod
    def from_experts(cls, weights: dict[str, torch.Tensor], prepare_expert: ProcessExpert,
                     config: MoECacheConfig, device: torch.device | str,
                     pin: bool | None = None, name: str = "") -> "CachedWeightProvider":
        """Take a loaded layer's expert tensors (name -> [E, ...], ideally in host memory, not yet
        processed): each expert goes through ``prepare_expert`` into the host store, and N
        zeroed slots per tensor are allocated on ``device`` (the only expert-sized device
        memory). pin: page-lock the store; None = where the platform supports it."""
        device = torch.device(device)
        platform = platform_for(device)
        if platform.device_type == "cpu":
            log_once(logger, logging.INFO, CPU_NO_SAVING_MSG)
        pin = platform.is_pin_memory_available() if pin is None else pin
        store = HostStore.from_experts(weights, prepare_expert, pin=pin, name=name)
        slots = allocate_slots(store, config.cache_size, device)
        policy_name = resolve_policy_name(config.policy)
        residency = Residency(store.num_experts, config.cache_size, get_policy(policy_name),
                              device)
        return cls(store, slots, residency, policy_name)

    @property
    def num_experts(self) -> int:
        return self.residency.num_experts

    @property
    def num_slots(self) -> int:
        return self.residency.num_slots

    def slot_weights(self) -> dict[str, torch.Tensor]:
        return self.slots

    def prepare(self, topk_ids: torch.Tensor) -> ExpertPlan:
        T, K = topk_ids.shape
        E = self.num_experts
        # Negative ids (skipped pairs, as in apply_pairs' contract) go to a dump entry E.
        valid = topk_ids >= 0                                                # [T, K]
        ids = torch.where(valid, topk_ids, E)                                # [T, K] in [0, E]
        needed = torch.zeros(E + 1, dtype=torch.bool, device=topk_ids.device)
        needed = needed.index_fill_(0, ids.reshape(-1), True)[:E]            # [E]
        # Wave masks are fixed against the residency before any wave is planned.
        waves = split_waves(needed, self.residency.slot_of_expert, self.num_slots, T * K)
        self._waves.add_(len(waves))
        return ExpertPlan(self, waves, ids.clamp(max=E - 1), valid)

    def load_wave(self, wave: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor
                  ) -> torch.Tensor:
        """Make wave [E] bool resident, copy its misses; -> slot ids [T, K], -1 outside it."""
        plan = self.residency.plan(wave)
        self._copy(self.slots, plan)
        self._experts_copied.add_(plan.valid.sum())
        in_wave = wave[ids] & valid                                          # [T, K] bool
        return torch.where(in_wave, self.residency.remap(ids), -1)          # [T, K] slots

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


def make_weight_provider(weights: dict[str, torch.Tensor], quant_method, config: MoECacheConfig |
                         None, device: torch.device, name: str = "") -> WeightProvider:
    """The provider a loaded layer gets: cached when ``cache_enabled``, else every expert
    processed in place on the compute device. ``quant_method``: the layer's
    ``FusedMoEMethodBase`` (its ``prepare_expert`` / ``process_weights``)."""
    num_experts = next(iter(weights.values())).shape[0]
    if cache_enabled(config, num_experts):
        return CachedWeightProvider.from_experts(weights, quant_method.prepare_expert, config,
                                                 device, name=name)
    return IdentityProvider(quant_method.process_weights(weights))

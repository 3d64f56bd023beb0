"""Weight providers: where a FusedMoE's expert tensors live, and the one seam to its kernels.

Per step the layer asks its provider ``prepare(topk_ids)`` -> the waves of ids the expert kernel
runs on, and ``slot_weights()`` -> the tensors those ids index, and hands both to
``quant_method.apply``; it knows nothing else of the provider.

``IdentityProvider`` (no cache): all E experts on the compute device; the ids go through
unchanged as one wave.

``CachedWeightProvider`` (``moe_expert_cache_size`` N < E): the one owner of the layer's host
store (every expert-indexed tensor the quant method declares, run through its
``prepare_expert``), the N device slots of each, the residency and policy state, the residency
step, the copy engine and the counters. Its plan contract (bitwise equal to the uncached
``apply``): needed experts = those in topk_ids (minus padding rows of a graph replay), split
into W = ceil(min(E, T*K) / N) waves of at most N (static in the shapes); iterating the plan
(``expert_plan.py``) runs, per wave, the residency step (``residency_step.py``: where the
platform has a fused kernel, one call plans all W waves before the first) -> copy the misses ->
yield the wave's slot ids (pairs of other waves -1); with ``overlap`` and a side stream, the
copy runs on the side stream and the wave is yielded as its hit pairs, then (after the join)
its miss pairs (``overlap.py``). Every pair is computed exactly once, by the same expert
weights, over the same tokens in the same order, and the layer reduces all waves with the
uncached reduction. A wave with no expert
changes nothing; where the state is host memory (CPU) an eager step stops after its last
non-empty wave, while a CPU graph records all W (an empty wave's nodes return at once).
No host synchronisation on CPU (or on CUDA with the fused step and a copy kernel): all
bookkeeping is fixed-shape device code, and counters are read only by ``stats()``. Under
``torch.compile`` the reference step and torch copy run (a C call cannot be traced); compiling
with ``fullgraph=True`` needs ``torch._dynamo.config.capture_dynamic_output_shape_ops = True``
(the CPU copy uses ``nonzero``, and so does the torch reference kernel); the compiling caller
sets it, since it is process-global.

``prefetch(predicted_ids)`` (``prefetch.py``) loads predicted experts between two real steps
without touching the policy or the hit/miss counters; the plan contract above is unchanged by it
(the real step plans from whatever residency it finds).

Providers are deliberately not ``nn.Module``s: ``model.to(...)`` must never move the host store
onto the device.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from functools import partial

import torch

from vllm.config import MoECacheConfig
from vllm.logger import init_logger, log_once
from vllm.model_executor.layers.fused_moe.expert_cache.compressed_copy import Exp12Copy
from vllm.model_executor.layers.fused_moe.expert_cache.copy import select_copy
from vllm.model_executor.layers.fused_moe.expert_cache.expert_plan import ExpertPlan
from vllm.model_executor.layers.fused_moe.expert_cache.host_compute import (
    HostCostModel, HostMissCompute, cost_model_for)
from vllm.model_executor.layers.fused_moe.expert_cache.host_experts import host_experts
from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import Exp12
from vllm.model_executor.layers.fused_moe.expert_cache.policy import DEFAULT_POLICY, get_policy
from vllm.model_executor.layers.fused_moe.expert_cache.prefetch import (PrefetchState,
                                                                        wanted_experts)
from vllm.model_executor.layers.fused_moe.expert_cache.residency import (LoadPlan, Residency,
                                                                         num_waves)
from vllm.model_executor.layers.fused_moe.expert_cache.residency_step import (
    ReferenceStep, ResidencyStep, select_residency_step)
from vllm.model_executor.layers.fused_moe.expert_cache.slots import allocate_slots, as_parameter
from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore, ProcessExpert
from vllm.model_executor.layers.fused_moe.modular_kernel import WaveIds
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

    def prepare(self, topk_ids: torch.Tensor, row_slots: torch.Tensor | None = None
                ) -> "Iterator[WaveIds] | tuple[WaveIds]":
        """topk_ids [T, K] expert ids (-1 = skip) -> waves of ids [T, K] into ``slot_weights()``
        with their bounds (``WaveIds``).
        row_slots [T] int64 or None: the step's KV slot per row; a cache routes rows whose slot
        is PAD_SLOT_ID (decode-graph padding) nowhere."""
        raise NotImplementedError

    def slot_weights(self) -> dict[str, torch.Tensor]:
        """name -> [G, ...] device tensor the kernel reads (G = E experts, or N slots)."""
        raise NotImplementedError

    reads_on_host = False
    """Whether a step reads the device on the host (``moe_expert_cpu_compute``): a decode graph
    runs that part eagerly between its pieces (``graph_break``)."""

    def host_step(self, topk_ids: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                  row_slots: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, Callable[[torch.Tensor], None] | None]:
        """(the ids [T, K] the device computes, the layer's ``host_pairs`` or None): the pairs
        the CPU computes from host memory leave the device's ids (``HostMissCompute.step``,
        a host read); only a cache with ``moe_expert_cpu_compute`` has any. x [T, H];
        row_slots [T] (``prepare``'s: rows whose slot is PAD_SLOT_ID are graph padding and
        route nowhere)."""
        return topk_ids, None


class IdentityProvider(WeightProvider):
    """Every expert resident: slot e is expert e, one wave."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self._weights = {n: as_parameter(t) for n, t in weights.items()}
        self.names = tuple(weights)

    def prepare(self, topk_ids, row_slots=None):
        return (WaveIds(topk_ids),)

    def slot_weights(self):
        return self._weights


class CachedWeightProvider(WeightProvider):
    cached = True

    def __init__(self, store: HostStore, slots: dict[str, torch.Tensor], residency: Residency,
                 policy_name: str, overlap: bool = False):
        if list(slots) != list(store.tensors):
            raise ValueError(f"slots {list(slots)} and store {list(store.tensors)} must name the "
                             "same tensors in the same order")
        self.store, self.slots, self.residency = store, slots, residency
        self.names = tuple(slots)
        self.policy_name = policy_name
        self.device = next(iter(slots.values())).device
        store_device = next(iter(store.tensors.values())).device
        self.non_blocking = store.pinned and self.device != store_device
        self.copy = select_copy(store, self.device)
        self.step: ResidencyStep = select_residency_step(residency, self.device)
        self.side_stream = platform_for(self.device).side_stream(self.device) if overlap \
            else None
        """Where the misses are copied while the hits compute (``overlap.py``), or None."""
        if overlap and self.side_stream is None:
            log_once(logger, logging.INFO, f"moe_expert_overlap: {self.device.type} has no side "
                     "stream; misses are copied before the wave's kernels (no overlap)")
        self.prefetch_state: PrefetchState | None = None
        """Made by ``enable_prefetch`` (the wiring, or the first ``prefetch``): without
        prefetch the layer holds none of its [E] tensors."""
        self._settled = False
        """A prefetch settled the last real step since it ran (``prepare`` need not)."""
        self._prefetch_in_flight: LoadPlan | None = None
        """The plan of a prefetch copy forked onto the side stream (kept alive until the next
        plan joins the side stream, first thing)."""
        self.host_compute: HostMissCompute | None = None
        """Set by ``enable_host_compute`` (``moe_expert_cpu_compute``): misses on the CPU."""

    @property
    def cpu_graph_safe(self) -> bool:
        """Whether a CPU graph can record this layer's cached step (fused C step and C copy; the
        overlap split is torch ops, which CPU graphs do not record)."""
        return self.step.cpu_graph_node and getattr(self.copy, "cpu_graph_node", False) and \
            self.side_stream is None and self.host_compute is None

    def cuda_graph_refusal(self) -> str | None:
        """Why a decode graph (``worker/cuda_graphs.py``) cannot capture this layer's cached
        step, or None: ``capture_refusal``, except where the step reads on the host
        (``reads_on_host``): a graph never refuses such a layer, it runs the host's part, or
        the whole layer where the rest cannot be captured, between its pieces."""
        return None if self.reads_on_host else self.capture_refusal()

    def capture_refusal(self) -> str | None:
        """Why a graph cannot capture this layer's residency step and copies, or None. They
        need the platform's fused residency step (one launch per layer, no host read; the
        reference is refused: ~40 launches per wave) and a ``sync_free`` copy engine (a copy
        kernel; not the torch fallback, which reads the plan on the host)."""
        if self.step.name == "reference":
            return (f"its residency step is the tensor-op reference (the {self.device.type} "
                    "platform has no fused residency step kernel, e.g. triton is missing, or "
                    f"policy {self.policy_name!r} has no kernel_code)")
        if not getattr(self.copy, "sync_free", False):
            return ("its expert copy reads the load plan on the host (no device copy kernel: "
                    "a CUDA build's vllm._C expert_gather or the Triton one, which needs the "
                    "'triton' package and a pinned store; or register_cuda_copy_kernel)")
        return None

    def join_prefetch(self) -> None:
        """The current stream waits for the prefetch copy forked onto the side stream, if one is
        in flight (its plan is then free to go)."""
        if self._prefetch_in_flight is not None:
            self.side_stream.join("prefetch")
            self._prefetch_in_flight = None

    def invalidate(self) -> None:
        """A step through this layer failed (an exception from any layer: the engine goes on
        serving): no slot is trusted any more (``Residency.invalidate``). A prefetch in flight
        stays joined by the next plan."""
        self.residency.invalidate()
        self._settled = False

    def forget_capture(self) -> None:
        """A graph capture through this layer failed: its recorded work never ran, so forget the
        prefetch it forked and let the next real step settle (``settle`` is idempotent)."""
        self._prefetch_in_flight = None
        self._settled = False

    def step_for_this_call(self) -> ResidencyStep:
        """The selected step, or the reference while torch.compile traces (it cannot trace a
        kernel called through ctypes or a Triton launcher's Python)."""
        if torch.compiler.is_compiling() and self.step.name != "reference":
            return ReferenceStep(on_host=False)
        return self.step

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
        store = HostStore.from_experts(
            weights, prepare_expert, partial(platform.empty_pinned, device=device) if pin else None,
            name=name)
        slots = allocate_slots(store, config.cache_size, device)
        policy_name = resolve_policy_name(config.policy)
        residency = Residency(store.num_experts, config.cache_size, get_policy(policy_name),
                              device)
        return cls(store, slots, residency, policy_name, overlap=config.overlap)

    @property
    def num_experts(self) -> int:
        return self.residency.num_experts

    @property
    def num_slots(self) -> int:
        return self.residency.num_slots

    def slot_weights(self) -> dict[str, torch.Tensor]:
        return self.slots

    def prepare(self, topk_ids: torch.Tensor, row_slots: torch.Tensor | None = None
                ) -> ExpertPlan:
        T, K = topk_ids.shape
        if self.prefetching and not self._settled:
            # Account for the previous real step before this one overwrites its needed set
            # (a prefetch since then already did).
            self.prefetch_state.settle(self.residency)
        self._settled = False
        return ExpertPlan(self, topk_ids, row_slots, num_waves(self.num_experts, T * K,
                                                               self.num_slots))

    def enable_host_compute(self, mode: str, quant_method, hidden_size: int, dtype: torch.dtype,
                            cost: HostCostModel | None = None, planes: bool = False) -> None:
        """Compute misses on the CPU from the host store (``host_compute.py``); mode "auto"
        measures its cost model here unless given one. With link compression the CPU reads the
        exp12 planes where the bf16 store was released, or wherever ``planes``
        (``Exp12Copy.host_weights``). ValueError where the backend's layout cannot be computed
        on the CPU."""
        tensors = self.copy.host_weights(self.store, planes) \
            if isinstance(self.copy, Exp12Copy) else self.store.tensors
        experts = host_experts(quant_method, self.device,
                               planes=any(isinstance(t, Exp12) for t in tensors.values()))
        if mode == "auto" and cost is None:
            if bool((self.residency.expert_of_slot >= 0).any()):
                raise ValueError("moe_expert_cpu_compute='auto' measures its cost model in an "
                                 "empty slot: enable it before the first step")
            cost = cost_model_for(tensors, self.slots, experts, hidden_size, dtype,
                                  copy=self.copy)
            log_once(logger, logging.INFO, f"moe_expert_cpu_compute='auto': {cost} (a missing "
                     "expert runs on the CPU until the CPU has spent one copy's time on it, "
                     "then it is copied" + ("; and the least used misses while the CPU beside "
                                            "the copies shortens the step)" if cost.concurrent
                                            else ")"))
        self.host_compute = HostMissCompute(mode, experts, tensors, cost)

    def enable_link_compression(self, copy: Exp12Copy | None = None,
                                release_store: bool = False) -> None:
        """Misses move as exp12 planes, decoded exactly into the slots (``compressed_copy.py``).
        ``copy``: one built over this layer's store (shared planes); ``release_store``: free the
        encoded bf16 tensors (``Exp12Copy.release``; CPU compute enabled after this reads the
        planes). ValueError where it cannot."""
        if release_store and self.host_compute is not None:
            raise ValueError("the bf16 store cannot be released: moe_expert_cpu_compute, "
                             "enabled before link compression, reads it")
        self.copy = copy = copy or Exp12Copy.for_store(self.store, self.device)
        if release_store:
            copy.release(self.store)

    @property
    def reads_on_host(self) -> bool:
        return self.host_compute is not None

    def host_step(self, topk_ids: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                  row_slots: torch.Tensor | None = None):
        if self.host_compute is None:
            return topk_ids, None
        return self.host_compute.step(topk_ids, self.residency.slot_of_expert, x, topk_weights,
                                      row_slots)

    @property
    def prefetching(self) -> bool:
        """Whether a prefetcher feeds this layer: ``stats`` then has the ``prefetch_*`` keys."""
        return self.prefetch_state is not None

    def enable_prefetch(self) -> None:
        if self.prefetch_state is None:
            self.prefetch_state = PrefetchState(self.num_experts, self.device)

    def prefetch(self, topk_ids: torch.Tensor, row_slots: torch.Tensor | None = None) -> None:
        """Load experts a predictor expects this layer's next step to need: predicted ids
        [T, K] (negative: none), at most N experts, most-predicted first (``prefetch.py``).
        Call between two real steps of this layer, at most once per step; outputs stay
        bitwise equal (the real step's plan decides), only hits and copies change."""
        res = self.residency
        # A second prefetch before ``prepare``: the first's copy is joined first, so its plan is
        # not dropped (and freed on the current stream) while the side stream may still read it.
        self.join_prefetch()
        self.enable_prefetch()
        self.prefetch_state.settle(res)
        wanted = wanted_experts(topk_ids, self.num_experts, self.num_slots, row_slots)
        plan = res.load(wanted)
        if self.side_stream is not None:
            # Forked after this layer's last step (stream order): no kernel still reads the
            # victims; the copy then runs beside the layers in between until ``prepare``.
            # Marked in flight before the copy: one that raises part-way has still forked
            # (the fork records its event regardless), and the next plan must join it.
            self._prefetch_in_flight = plan      # kept alive: the side stream reads it
            with self.side_stream.fork("prefetch"):
                self.copy(self.slots, plan)
        else:
            self.copy(self.slots, plan)
        self.prefetch_state.record(res, wanted, plan)
        self._settled = True

    def stats(self) -> dict[str, int | float | None]:
        """Cumulative counters as Python numbers (the cache's only host sync). Every miss and
        every prefetch load copies one expert: ``experts_copied`` = misses + prefetch loads;
        ``waves`` counts waves that had experts; the ``prefetch_*`` counters (``prefetch.py``)
        only when ``prefetching``."""
        r = self.residency
        hits, misses, evictions, waves = torch.stack(
            [r.hits, r.misses, r.evictions, r.waves]).tolist()
        pf: dict = {}
        if self.prefetching:
            self.prefetch_state.settle(r)
            pf = self.prefetch_state.stats(self.store.bytes_per_expert)
        copied = misses + pf.get("prefetch_loads", 0)
        return {"hits": hits, "misses": misses, "evictions": evictions,
                "experts_copied": copied,
                "bytes_copied": copied * self.store.bytes_per_expert,
                # Over the host link: fewer with link compression (the copy's planes).
                "link_bytes_copied": copied * getattr(self.copy, "bytes_per_expert",
                                                      self.store.bytes_per_expert),
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                "waves": waves, **pf,
                **(self.host_compute.stats() if self.host_compute is not None else {})}

    def reset_stats(self) -> None:
        """Zero the counters (residency, policy state, the clock and prefetch flags are kept)."""
        pf = [self.prefetch_state.counters] if self.prefetching else []
        for t in (self.residency.hits, self.residency.misses, self.residency.evictions,
                  self.residency.waves, *pf):
            t.zero_()
        if self.host_compute is not None:
            self.host_compute.reset_stats()


def make_weight_provider(weights: dict[str, torch.Tensor], quant_method, config: MoECacheConfig |
                         None, device: torch.device, name: str = "", hidden_size: int = 0,
                         dtype: torch.dtype = torch.float32) -> WeightProvider:
    """The provider a loaded layer gets: cached when ``cache_enabled``, else every expert
    processed in place on the compute device. ``quant_method``: the layer's
    ``FusedMoEMethodBase`` (its ``prepare_expert`` / ``process_weights``); ``hidden_size`` and
    the activation ``dtype`` size the probes of ``moe_expert_cpu_compute='auto'``."""
    num_experts = next(iter(weights.values())).shape[0]
    if cache_enabled(config, num_experts):
        provider = CachedWeightProvider.from_experts(weights, quant_method.prepare_expert,
                                                     config, device, name=name)
        if config.link_compression != "off":
            try:
                provider.enable_link_compression(release_store=True)
            except ValueError as e:
                raise ValueError(f"{name}: moe_expert_link_compression="
                                 f"{config.link_compression!r}: {e}") from None
        if config.cpu_compute != "off":
            try:
                provider.enable_host_compute(config.cpu_compute, quant_method, hidden_size,
                                             dtype)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        return provider
    return IdentityProvider(quant_method.process_weights(weights))

"""benchmark_expert_offload.py's designs: the providers each one runs on, the per-layer step,
and the counters it reports (the module docstring there describes each design).

``ours+cpu``: ours with ``moe_expert_cpu_compute="auto"`` (``expert_cache/host_compute.py``): a
missing expert's pairs run on the CPU from the host store while what the CPU has spent on that
expert since it was last copied stays under one copy's time (ski rental over the cost model,
measured once on layer 0's provider and shared); else it is copied, but on a GPU (copies beside
the CPU) the least used of those misses go to the CPU too while that shortens the step
(``balance``). One host read of the routing
per step and layer (eager only, as in the engine). Where the device is the CPU both sides run
the same kernel, so its outputs equal the others' bit for bit; on CUDA they may differ by
rounding (another kernel computes those pairs). Its hit rate counts only the experts that went
through the cache (CPU-computed pairs are neither hits nor misses; ``cpu_pairs`` counts them),
and its bound is not a bound for it: the CPU's work moves no bytes over the link.
"""
from __future__ import annotations

import argparse
import weakref

import torch
from offload_bounds import measure_copy_engine

from vllm.model_executor.layers.fused_moe.expert_cache.baseline import SyncLFRUProvider
from vllm.model_executor.layers.fused_moe.expert_cache.compressed_copy import (
    Exp12Copy, link_compression_refusal)
from vllm.model_executor.layers.fused_moe.expert_cache.policy import get_policy
from vllm.model_executor.layers.fused_moe.expert_cache.provider import (CachedWeightProvider,
                                                                        IdentityProvider,
                                                                        resolve_policy_name)
from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency
from vllm.model_executor.layers.fused_moe.expert_cache.slots import allocate_slots

FEATURES = ("overlap", "prefetch", "cpu", "exp12")
"""What ``ours`` can add, in the order a design's name lists them: ``ours+prefetch+exp12``."""
DESIGNS = ("resident", "sync-lfru", "uva", "ours", "ours+overlap", "ours+prefetch", "ours+cpu",
           "ours+exp12", "ours+prefetch+exp12", "ours+cpu+exp12")
"""``--designs all``; any other combination of ``ours`` and ``FEATURES`` runs when named."""
_PREFETCH_FIELDS = ("prefetch_loads", "prefetch_used", "prefetch_wasted", "prefetch_recalled",
                    "prefetch_needed", "prefetch_bytes", "prefetch_wasted_bytes")


def features(design: str) -> frozenset[str]:
    """What ``design`` adds to ours (``FEATURES``); empty for ours and the other designs."""
    return frozenset(design.split("+")[1:]) if design.startswith("ours") else frozenset()


def cached(design: str) -> bool:
    """Whether ``design`` has slots (its rows run at each ``--capacity``)."""
    return design == "sync-lfru" or design.startswith("ours")


def design_name(name: str) -> str:
    """``name`` checked (argparse's ``type``): one of ``DESIGNS``, or ours with features joined
    by "+" in ``FEATURES`` order, each at most once."""
    parts = name.split("+")
    if name in DESIGNS or (parts[0] == "ours" and len(set(parts[1:])) == len(parts) - 1 and
                           parts[1:] == [f for f in FEATURES if f in parts[1:]]):
        return name
    raise ValueError(f"design {name!r} is invalid: must be one of {list(DESIGNS)}, or 'ours' "
                     f"followed by any of {list(FEATURES)}, each once, in that order, joined "
                     "by '+'")


def design_arg(name: str) -> str:
    """``--designs``' argparse ``type``: "all" or a ``design_name``."""
    try:
        return name if name == "all" else design_name(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def design_refusal(s, design: str) -> str | None:
    """Why ``design`` cannot run on this setup (a ``Setup``), or None. uva on CUDA needs the
    Triton MoE backend (which reads pinned host weights in place) and a pinned store;
    ours+exp12 a platform with an exp12 copy kernel (CUDA with triton)."""
    if "exp12" in features(design):
        return link_compression_refusal(s.store, s.device)
    if design != "uva" or s.device.type != "cuda":
        return None
    if s.qm.kernel.name != "triton" or not s.store.pinned:
        return (f"uva on CUDA needs the triton MoE backend and a pinned store (backend "
                f"{s.qm.kernel.name!r}, pinned {s.store.pinned})")
    return None


def make_providers(s, design: str, capacity: int | None, policy: str) -> list:
    """One provider per layer of the trace for ``design`` (``s``: the run's ``Setup``)."""
    L = s.trace.num_layers
    if design == "resident":
        weights = {n: t.to(s.device) for n, t in s.store.tensors.items()}
        return [IdentityProvider(weights)] * L
    if design == "uva":
        return [IdentityProvider(s.store.tensors)] * L
    if design == "sync-lfru":
        return [SyncLFRUProvider(s.store, allocate_slots(s.store, capacity, s.device))
                for _ in range(L)]
    name, f = resolve_policy_name(policy), features(design)
    out = [CachedWeightProvider(s.store, allocate_slots(s.store, capacity, s.device),
                                Residency(s.trace.num_experts, capacity, get_policy(name),
                                          s.device), name, overlap="overlap" in f)
           for _ in range(L)]
    for p in out[:1] if "prefetch" in f else ():
        p.enable_prefetch()        # layer 0 (nothing predicts it) reports its zeros too
    if "exp12" in f:              # before cpu: its cost model times the exp12 copy
        for p in out:                         # encoded once per run: the layers share the store
            p.enable_link_compression(exp12_copy(s))
    if "cpu" in f:
        # Measures the cost model unless the run gives one (--cpu-cost). With exp12 the CPU
        # reads the planes, as the engine's does (the store stays: the designs share it).
        out[0].enable_host_compute("auto", s.qm, s.hidden, s.dtype, cost=s.cpu_cost,
                                   planes="exp12" in f)
        for p in out[1:]:
            p.enable_host_compute("auto", s.qm, s.hidden, s.dtype, cost=out[0].host_compute.cost,
                                  planes="exp12" in f)
    return out


def exp12_copy(s) -> Exp12Copy:
    """The run's exp12 copy engine (``s.exp12``), its planes encoded on first use."""
    if s.exp12 is None:
        s.exp12 = Exp12Copy.for_store(s.store, s.device)
    return s.exp12


def exp12_copy_speed(s) -> dict[str, float]:
    """The exp12 copy on a full plan: slot bytes per second (``exp12_copy_gbps``) and the
    planes' bytes, what crosses the link, per second (``exp12_link_gbps``: beside the DMA
    bandwidth, whether the decode keeps up with the link)."""
    gbps = measure_copy_engine(s.store, s.device, engine=exp12_copy(s))[0] / 1e9
    return {"exp12_copy_gbps": gbps,
            "exp12_link_gbps": gbps * s.exp12.bytes_per_expert / s.store.bytes_per_expert}


def upload_steps(setup, steps: list[torch.Tensor], pred: torch.Tensor | None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor]]:
    """(per step the device ids [b, L, K], the device predictions or None, the host ids): the
    routing uploaded before the timing, so the timed loop does no host-to-device copy of it."""
    host = [setup.ids[tokens] for tokens in steps]
    ids = [h.to(setup.device) for h in host]
    p_ids = [pred[tokens].to(setup.device) if pred is not None else None for tokens in steps]
    return ids, p_ids, host


def layer_step(provider, qm, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
               ) -> torch.Tensor:
    """One layer: h + experts(h) for routing ids [b, K] and weights w [b, K], as the engine's
    FusedMoE runs it (CPU-computed pairs split off first where the provider has them)."""
    host_pairs = None
    if getattr(provider, "host_compute", None) is not None:                    # +cpu designs
        ids, host_pairs = provider.host_step(ids, h, w)
    waves = provider.prepare(ids)
    return h + qm.apply(provider.slot_weights(), h, w, waves, host_pairs=host_pairs)


def run_layers(providers: list, qm, w_row: torch.Tensor, ids: torch.Tensor,
               pred: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
    """One step through every layer: routing ids [b, L, K], next-layer predictions [b, L, K]
    (+prefetch designs: layer l + 1's are prefetched before layer l runs) or None, layer 0's input
    h [b, H], one row of top-k weights w_row [K] -> the last layer's h [b, H]."""
    w = w_row.expand(ids.shape[0], -1)
    L = len(providers)
    for l in range(L):
        if pred is not None and l + 1 < L:
            providers[l + 1].prefetch(pred[:, l + 1])
        h = layer_step(providers[l], qm, h, ids[:, l], w)
    return h


def model_wait_seconds(providers: list, cost) -> list[float]:
    """``--cpu-cost``: wrap each ours+cpu layer's split (``HostMissCompute.host_pairs``) to add
    up, per layer and step, what ``balance`` minimises: max(experts copied x the copy's
    seconds, the CPU's seconds for the experts it computes), in the given cost model. Compute,
    the rows' transfers and the host read are left out: a model, not a timing (one more host
    read per call). Returns the one-element total. The wrappers hold their methods weakly
    (``_wrap``): no reference cycle keeps a run's providers, and the pinned store they read,
    alive after it (freed later by a garbage collection, that can fall in a later run's
    CUDA graph capture)."""
    total = [0.0]
    for p in providers:
        hc = p.host_compute

        def host_pairs(_, inner, topk_ids, slot_of_expert, row_slots=None):
            ids, on_cpu = inner(topk_ids, slot_of_expert, row_slots)
            resident = slot_of_expert.cpu() >= 0
            E = resident.numel()
            known = (ids >= 0) & (ids < E)
            needed = torch.bincount(ids[known], minlength=E) > 0
            rented = torch.bincount(ids[on_cpu], minlength=E)              # [E] CPU pairs
            copied = int((needed & ~resident & (rented == 0)).sum())
            counts = rented.numpy()
            cpu = float(cost.cpu_seconds(counts)[counts > 0].sum())
            total[0] += max(copied * cost.copy_seconds, cpu)
            return ids, on_cpu
        _wrap(hc, "host_pairs", host_pairs)
    return total


def _wrap(obj, name: str, wrapper) -> None:
    """``obj.name = wrapper(obj, what obj.name was, *args)``, ``obj`` held weakly (a bound
    method of it re-bound per call): a strong hold in the closure set on ``obj`` would be a
    reference cycle through ``obj``."""
    inner, ref = getattr(obj, name), weakref.ref(obj)
    func = inner.__func__ if getattr(inner, "__self__", None) is obj else None
    if func is not None:
        inner = None                            # the closure keeps no bound method of obj

    def call(*args, **kwargs):
        o = ref()
        return wrapper(o, inner if func is None else func.__get__(o), *args, **kwargs)
    setattr(obj, name, call)


def count_copies(providers: list, bytes_per_expert: int) -> list[int]:
    """Wrap each provider's copy path to count the bytes it moves (one host read per wave: for
    tests, not for timing). Returns the one-element counter. No cycle (``_wrap``)."""
    counted = [0]
    for p in providers:
        if isinstance(p, SyncLFRUProvider):
            def copy_expert(_, inner, slot, e):
                counted[0] += bytes_per_expert
                inner(slot, e)
            _wrap(p, "copy_expert", copy_expert)
        else:
            def copy(p, inner, slots, plan):
                rows = int(plan.valid.sum())
                counted[0] += rows * sum(t[0].numel() * t.element_size()
                                         for t in p.slots.values())
                inner(slots, plan)
            _wrap(p, "copy", copy)
    return counted


def cache_stats(providers: list, design: str) -> dict:
    """The row's cache counters, summed over the layers (prefetch and CPU ones where on)."""
    if not cached(design):
        return {"hit_rate": 1.0, "hits": None, "misses": 0, "bytes_copied": 0}
    stats = [p.stats() for p in providers]
    tot = {k: sum(st[k] for st in stats) for k in ("hits", "misses", "bytes_copied")}
    out = {**tot, "hit_rate": tot["hits"] / max(1, tot["hits"] + tot["misses"])}
    if "prefetch" in features(design):
        pf = {k: sum(st[k] for st in stats) for k in _PREFETCH_FIELDS}
        pf["prefetch_recall"] = pf["prefetch_recalled"] / max(1, pf["prefetch_needed"])
        pf["per_layer_recall"] = [st["prefetch_recall"] for st in stats]
        out["prefetch"] = pf
    if "cpu" in features(design):
        out.update({k: sum(st[k] for st in stats) for k in ("cpu_pairs", "cpu_expert_calls")})
    return out

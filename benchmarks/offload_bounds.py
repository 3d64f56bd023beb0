"""benchmark_expert_offload.py's link accounting: bytes each design moves over the host link,
the measured copy speeds (DMA and the provider's copy engine) and the bound they give."""
from __future__ import annotations

import time

import torch

from vllm.model_executor.layers.fused_moe.expert_cache.copy import select_copy
from vllm.model_executor.layers.fused_moe.expert_cache.residency import LoadPlan
from vllm.model_executor.layers.fused_moe.expert_cache.slots import allocate_slots
from vllm.model_executor.layers.fused_moe.expert_cache.store import HostStore


def device_sync(device: torch.device):
    """A callable that waits for ``device``'s queued work (nothing to wait for on the CPU)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def uva_link_bytes(step_ids: list[torch.Tensor], num_experts: int, bytes_per_expert: int) -> int:
    """The bytes the uva design reads over the link, at least: per step and layer, each distinct
    expert the step's tokens use, once. ``step_ids``: per step, the host ids [b, L, K]."""
    distinct = 0
    for ids in step_ids:
        b, L, K = ids.shape
        used = torch.zeros(L, num_experts, dtype=torch.bool)
        used.scatter_(1, ids.transpose(0, 1).reshape(L, b * K), True)
        distinct += int(used.sum())
    return distinct * bytes_per_expert


def measure_bandwidth(store: HostStore, device: torch.device, min_seconds: float = 0.3) -> float:
    """Bytes per second of DMA copies of expert rows store -> a device slot (CPU: memcpy; CUDA:
    pinned host to device, asynchronous ``copy_`` calls then one synchronisation)."""
    dst = allocate_slots(store, 1, device)
    cuda = device.type == "cuda"
    moved, start, e = 0, time.perf_counter(), 0
    while True:
        for name, src in store.tensors.items():
            dst[name][0].copy_(src[e % store.num_experts], non_blocking=cuda)
        moved += store.bytes_per_expert
        e += 1
        if e % store.num_experts == 0:
            device_sync(device)()
            if time.perf_counter() - start >= min_seconds:
                return moved / (time.perf_counter() - start)


ENGINE_ENTRIES = (1, 2, 4, 8)
"""Valid-entry counts of the partial plans ``measure_copy_engine_by_entries`` times (with E)."""
DECODE_PLAN_LENGTH = 8
"""A batch-1 top-8 decode plan's length: ``ExpertPlan`` hands the copy ``plan.head(min(N,
T*K))``, valid entries first; the partial plans are padded to it (to k when k is more)."""


def entries_plans(num_experts: int, k: int, length: int,
                  device: torch.device) -> list[LoadPlan]:
    """Plans of ``length`` entries, the first ``k`` valid (k experts into slots 0..k-1), the
    rest padding as ``Residency.plan`` leaves it (slots and experts -1, valid False). Plan r
    copies experts r*k .. r*k+k-1 (mod E), so a loop over them reads every expert, never the
    same k rows call after call (a device cache could keep those)."""
    if not 1 <= k <= length <= num_experts:
        raise ValueError(f"a plan of {length} entries, {k} valid, over {num_experts} experts is "
                         f"invalid: need 1 <= valid <= length <= {num_experts}")
    pos = torch.arange(length)
    valid = pos < k
    slots = torch.where(valid, pos, -1).to(device)
    return [LoadPlan(slots, torch.where(valid, (r * k + pos) % num_experts, -1).to(device),
                     valid.to(device)) for r in range(-(-num_experts // k))]


def measure_copy_engine(store: HostStore, device: torch.device, min_seconds: float = 0.3,
                        entries: int | None = None, engine=None) -> tuple[float, str]:
    """(bytes per second, its name) of the provider's copy engine (``select_copy``: on CUDA a
    gather kernel reading the pinned store over UVA, on CPU the C memcpy kernel), one untimed
    call first (a kernel's first compile). ``entries`` None (or E): the full plan, experts
    0..E-1 into slots 0..E-1; k < E: plans of max(k, min(E, ``DECODE_PLAN_LENGTH``)) entries,
    the first k valid (``entries_plans``). Bytes per second = the valid entries' bytes / seconds;
    the device is synchronised after each pass over the plans (ceil(E / k) calls). ``engine``:
    another copy engine to time (e.g. ``Exp12Copy``); its bytes are still the slots'."""
    n = store.num_experts
    k = n if entries is None else entries
    plans = entries_plans(n, k, max(k, min(n, DECODE_PLAN_LENGTH)), device)
    slots = allocate_slots(store, len(plans[0].valid), device)
    engine = engine if engine is not None else select_copy(store, device)
    sync = device_sync(device)
    fn = getattr(engine, "fn", None)
    name = type(engine).__name__ + (f"({fn.__name__})" if fn is not None else "")
    engine(slots, plans[0])
    sync()
    calls, start = 0, time.perf_counter()
    while True:
        for plan in plans:
            engine(slots, plan)
        calls += len(plans)
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return calls * k * store.bytes_per_expert / elapsed, name


def measure_copy_engine_by_entries(store: HostStore, device: torch.device,
                                   min_seconds: float = 0.1) -> dict[str, float]:
    """Per valid-entry count k ("1", "2", "4", "8" up to E, and "E"): bytes per second of the
    copy engine on plans of k valid entries (``measure_copy_engine(entries=k)``). Whether a
    plan with one miss copies at the link's speed (a GPU gather's grid has min(n, 8) rows of
    blocks, each walking every 8th entry: one valid entry keeps one row busy)."""
    n = store.num_experts
    counts = sorted({k for k in ENGINE_ENTRIES if k <= n} | {n})
    return {str(k): measure_copy_engine(store, device, min_seconds, k)[0] for k in counts}


def add_bounds(rows: list[dict], bandwidth: float) -> None:
    """Per ok row: copy_gbps (bytes copied / seconds), link_gbps (link bytes / seconds) and
    bound_s = max(compute, link bytes / bandwidth), compute = the resident row's seconds at the
    same batch (no bound without a resident row)."""
    compute = {r["batch"]: r["seconds"] for r in rows
               if r["design"] == "resident" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        r["copy_gbps"] = r["bytes_copied"] / r["seconds"] / 1e9
        r["link_gbps"] = r["link_bytes"] / r["seconds"] / 1e9
        if r["batch"] in compute:
            r["compute_s"] = compute[r["batch"]]
            r["bound_s"] = max(compute[r["batch"]], r["link_bytes"] / bandwidth)
            r["bound_tok_s"] = r["tokens"] / r["bound_s"]
            r["seconds_over_bound"] = r["seconds"] / r["bound_s"]


def settle_rows(rows: list[dict], bandwidth: float) -> None:
    """In place: each ok row's seconds = the median of its runs so far ("all_seconds"), its
    tok/s, and the bounds (``add_bounds``)."""
    for r in rows:
        if r["status"] == "ok":
            r["seconds"] = sorted(r["all_seconds"])[len(r["all_seconds"]) // 2]
            r["tok_s"] = r["tokens"] / r["seconds"]
    add_bounds(rows, bandwidth)

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


def measure_copy_engine(store: HostStore, device: torch.device,
                        min_seconds: float = 0.3) -> tuple[float, str]:
    """(bytes per second, its name) of the provider's copy engine (``select_copy``: on CUDA a
    gather kernel reading the pinned store over UVA, on CPU the C memcpy kernel) on a full plan:
    experts 0..E-1 into slots 0..E-1, one untimed call first (a kernel's first compile)."""
    n = store.num_experts
    slots = allocate_slots(store, n, device)
    ids = torch.arange(n, device=device)
    plan = LoadPlan(slots=ids, experts=ids.clone(),
                    valid=torch.ones(n, dtype=torch.bool, device=device))
    engine, sync = select_copy(store, device), device_sync(device)
    fn = getattr(engine, "fn", None)
    name = type(engine).__name__ + (f"({fn.__name__})" if fn is not None else "")
    engine(slots, plan)
    sync()
    calls, start = 0, time.perf_counter()
    while True:
        engine(slots, plan)
        calls += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return calls * n * store.bytes_per_expert / elapsed, name


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

"""What one decode step launches: torch.profiler over a few decode steps of a running engine.

Used by ``benchmark_decode.py --profile-steps K``. Per decode step it reports the host-side
launches (CUDA runtime/driver kernel launches, of torch and of Triton alike, and CUDA graph
launches: a replayed step is one graph launch plus what runs outside the graph), the kernels the
GPU ran and their busy time, its copies (memcpy / memset) and their time, the span from the
first device activity to the last (busy time beside it: the device's idle gaps; wall time beside
it: the host's time outside), and the aten ops the host dispatched (on CPU the only column that
is not zero). ``kernels`` names the device's kernels (and copies) by time per step (the largest
``TOP_KERNELS``): beside an uncached row, a cached row's extra kernels (the residency step, the
expert copy) and their microseconds. With a trace path it also writes the Chrome trace. The
issue-17 baseline (H100, eager, before the GPU path): about 1,870 launches per token, the GPU
busy under 5% of the step.
"""
from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

KERNEL_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                   "cuLaunchKernelEx", "cudaLaunchCooperativeKernel")
GRAPH_LAUNCHES = ("cudaGraphLaunch",)
COPIES = ("Memcpy", "Memset")
"""Device events that are copies, not kernels (CUPTI names them "Memcpy HtoD (...)" etc.)."""
GATHER_KERNELS = "expert_gather"
"""The expert cache's miss copies (``vllm._C``'s ``expert_gather_many_kernel``, the Triton
``_expert_gather_kernel`` / ``_expert_gather_many_kernel``): kernels whose names contain it."""
TOP_KERNELS = 24
TOP_GAPS = 8
NAME_CHARS = 100
"""Kernel names are cut to this in the report (C++ template names run to kilobytes); they are
told apart by the whole name."""


def _on_device(event) -> bool:
    """Whether a profiler event is the device's (a kernel or a copy), not the host's."""
    return getattr(event, "device_type", None) == torch.autograd.DeviceType.CUDA


def _device_time_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def summarize(events, steps: int, wall_s: float, bytes_copied: int | None = None) -> dict:
    """Profiler ``key_averages()`` of ``steps`` decode steps -> per-step counts. With the
    expert cache's ``bytes_copied`` over those steps: the miss copies' own speed (bytes over
    the gather kernels' device time), beside the link's, where the wall-time figure also
    counts the compute between copies."""
    count = {"launches": 0, "graph_launches": 0, "torch_ops": 0, "gpu_kernels": 0,
             "gpu_copies": 0}
    gpu_us = copy_us = gather_us = 0.0
    per_kernel: dict[str, list[float]] = {}          # name -> [count, device us]
    for e in events:
        if e.key in KERNEL_LAUNCHES:
            count["launches"] += e.count
        elif e.key in GRAPH_LAUNCHES:
            count["graph_launches"] += e.count
        elif e.key.startswith("aten::"):
            count["torch_ops"] += e.count
        if not _on_device(e):
            continue
        us = _device_time_us(e)
        if e.key.startswith(COPIES):
            count["gpu_copies"] += e.count
            copy_us += us
        else:
            count["gpu_kernels"] += e.count
            gpu_us += us
            gather_us += us if GATHER_KERNELS in e.key else 0.0
        k = per_kernel.setdefault(e.key, [0, 0.0])
        k[0] += e.count
        k[1] += us
    out = {f"{k}_per_step": v / steps for k, v in count.items()}
    out.update(steps=steps, wall_ms_per_step=wall_s * 1e3 / steps,
               gpu_busy_ms_per_step=gpu_us / 1e3 / steps,
               gpu_copy_ms_per_step=copy_us / 1e3 / steps,
               gpu_busy_fraction=(gpu_us / 1e6) / wall_s if wall_s > 0 else None,
               gather_ms_per_step=gather_us / 1e3 / steps,
               kernels=top_kernels(per_kernel, steps))
    if bytes_copied is not None:
        out["bytes_copied"] = bytes_copied
        out["gather_gbps"] = bytes_copied / (gather_us * 1e3) if gather_us > 0 else None
    return out


def top_kernels(per_kernel: dict[str, list[float]], steps: int) -> list[dict]:
    """{name: [count, device us]} -> the ``TOP_KERNELS`` largest by time, per step, with each
    launch's mean microseconds; ties by name, so the order is the same from run to run."""
    rows = sorted(per_kernel.items(), key=lambda kv: (-kv[1][1], kv[0]))[:TOP_KERNELS]
    return [{"name": name[:NAME_CHARS], "per_step": n / steps, "us_per_step": us / steps,
             "us_each": us / n if n else 0.0} for name, (n, us) in rows]


def device_span_ms(events, steps: int) -> float | None:
    """Per step, the time from the first device activity (kernel or copy) to the last, over the
    profiled steps (``prof.events()``): beside the busy time it gives the device's idle gaps
    inside the steps, and beside the wall time the host's share outside them."""
    spans = [(e.time_range.start, e.time_range.end) for e in events
             if _on_device(e)]
    if not spans:
        return None
    return (max(end for _, end in spans) - min(start for start, _ in spans)) / 1e3 / steps


def device_gaps(events, steps: int) -> dict | None:
    """The device's idle time over the profiled steps (``prof.events()``), on one timeline of
    its kernels and copies (streams merged): per step the total, and the ``TOP_GAPS`` longest
    gaps with the activity before and after each. A gap between the last kernel of a step and
    the first of the next is the host's (sampling, scheduling, the graph launch); one between
    two kernels of a replayed step is idle time inside the graph (a wait across streams, a
    launch's latency). None without device events (CPU)."""
    ev = sorted((e.time_range.start, e.time_range.end, getattr(e, "name", "?")) for e in events
                if _on_device(e))
    if not ev:
        return None
    gaps, end, last = [], ev[0][1], ev[0][2]
    for start, stop, name in ev[1:]:
        if start > end:
            gaps.append((start - end, last, name))
        if stop > end:
            end, last = stop, name
    top = sorted(gaps, key=lambda g: (-g[0], g[1], g[2]))[:TOP_GAPS]
    return {"idle_ms_per_step": sum(g[0] for g in gaps) / 1e3 / steps,
            "largest": [{"us": us, "after": a[:NAME_CHARS], "before": b[:NAME_CHARS]}
                        for us, a, b in top]}


def prefilled(engine) -> bool:
    """Whether every request of ``engine`` has its whole prompt computed (decode steps from now)."""
    s = engine.scheduler
    return not s.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens
                                 for r in s.running)


def profile_decode_steps(llm, prompts: list[list[int]], steps: int,
                         trace: str | None = None) -> dict:
    """Prefill ``prompts`` (greedy, ``steps + 1`` new tokens each), then profile ``steps``
    decode steps of the whole batch; the requests finish inside the profile. ``trace``: also
    write the profile's Chrome trace there (a timeline to read in Perfetto)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    engine = llm.llm_engine
    # FINAL_ONLY as the timed decode: no cumulative output built per profiled step.
    sp = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    for i, p in enumerate(prompts):
        engine.add_request(f"profile-{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, sp)
    while engine.has_unfinished_requests() and not prefilled(engine):
        engine.step()
    on_cuda = engine.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    copied = _bytes_copied(llm)                      # a host read, outside the profile
    if on_cuda:
        torch.cuda.synchronize()
    done = 0
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests() and done < steps:
            engine.step()
            done += 1
        if on_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    after = _bytes_copied(llm)                       # before any step past the profiled ones
    while engine.has_unfinished_requests():
        engine.step()
    if trace is not None:
        prof.export_chrome_trace(trace)
    out = summarize(prof.key_averages(), max(done, 1), wall,
                    None if after is None else after - copied)
    out["gpu_span_ms_per_step"] = device_span_ms(prof.events(), max(done, 1))
    out["gpu_gaps"] = device_gaps(prof.events(), max(done, 1))
    return out


def _bytes_copied(llm) -> int | None:
    """The expert cache's bytes copied so far over every layer (None: no cache)."""
    stats = llm.get_moe_cache_stats()
    return None if stats is None else int(stats["bytes_copied"])

"""The exact-size pinned allocator (csrc/memory/pinned_host.cu, ``ops.empty_pinned``) on a GPU:
page-locked, mapped for the gather kernel, outside torch's rounding host allocator, and a failed
allocation is torch.OutOfMemoryError and leaves nothing behind for torch's next launch check,
and a free returns the memory under the allocating GPU. Needs a CUDA GPU and vllm._C. On an H100
(2026-11-26) the first two passed and the failed allocation crashed the process (a C++
exception; the op now returns a status instead); the others have not run on a GPU yet."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    from vllm.kernels.cuda import ops
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not ops.has_empty_pinned():
        pytest.skip("vllm._C is not built: VLLM_TARGET_DEVICE=cuda pip install "
                    "--no-build-isolation -e .")
    return ops


def _torch_pinned_bytes() -> int | None:
    """Bytes torch's caching host allocator holds, where this torch reports it."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return None if stats is None else stats().get("allocated_bytes.current", 0)


def test_exact_pinned_tensor_round_trips_and_is_not_torch_s(ops):
    before = _torch_pinned_bytes()
    t = ops.empty_pinned((3, 1000, 7), torch.bfloat16)
    assert t.device.type == "cpu" and t.shape == (3, 1000, 7) and t.is_pinned()
    assert t.is_contiguous() and t.untyped_storage().nbytes() == 3 * 1000 * 7 * 2
    t.copy_(torch.randn(3, 1000, 7).to(torch.bfloat16))
    d = t.to("cuda", non_blocking=True)
    back = ops.empty_pinned((3, 1000, 7), torch.bfloat16)
    back.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, t)
    if before is not None:
        assert _torch_pinned_bytes() == before


def test_the_gather_kernel_reads_it_in_place(ops):
    src = ops.empty_pinned((5, 64, 48), torch.bfloat16)
    src.copy_(torch.randn(5, 64, 48).to(torch.bfloat16))
    dst = torch.zeros(2, 64, 48, dtype=torch.bfloat16, device="cuda")
    experts = torch.tensor([4, 1], device="cuda")
    slots = torch.tensor([1, 0], device="cuda")
    ops.expert_gather(src, dst, experts, slots, torch.tensor([True, True], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(dst[1].cpu(), src[4]) and torch.equal(dst[0].cpu(), src[1])


def test_a_failed_allocation_is_out_of_memory_and_leaves_no_error_behind(ops):
    """Out of lockable memory is torch.OutOfMemoryError (the store's cue to go pageable), and the
    CUDA error it read is not left for torch's next launch check. 256 TiB is more than any
    machine has: refused before cudaHostAlloc is asked."""
    with pytest.raises(torch.OutOfMemoryError, match="cannot page-lock 281474976710656 bytes"):
        ops.empty_pinned((1 << 48,), torch.uint8)         # 256 TiB
    t, status, error = torch.ops._C.try_empty_pinned([1 << 48], torch.uint8)
    # 2: cudaErrorMemoryAllocation
    assert (t.numel(), status, error) == (0, ops.PINNED_OUT_OF_MEMORY, 2)
    x = torch.ones(4, device="cuda") * 2                  # torch's launch check must pass
    torch.cuda.synchronize()
    assert x.sum().item() == 8


def _mem_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes: page-locked memory leaves it whether or not the
    driver's pages show in this process's resident set."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    pytest.skip("/proc/meminfo has no MemAvailable")


BLOCK = 4 << 30
"""Bytes locked by the free test: large against the noise of other processes' memory."""


def test_freed_memory_is_returned(ops):
    """4 GiB locked (every page touched) takes most of it out of MemAvailable; freed, it comes
    back, eight times running. Each check compares readings taken around one allocation or one
    free, not against the first reading: the GPU session runs the gpu tests in 8 workers, whose
    own allocations moved MemAvailable by 3 GB between the first reading and the last (H100,
    2026-11-27)."""
    if _mem_available() < 3 * BLOCK:
        pytest.skip(f"needs {3 * BLOCK >> 30} GiB of available host memory")
    for _ in range(8):
        before = _mem_available()
        t = ops.empty_pinned((BLOCK,), torch.uint8)
        t[:: 1 << 12].fill_(1)
        held = _mem_available()
        del t
        after = _mem_available()
        assert before - held > BLOCK * 3 // 4, "the block was not taken from MemAvailable"
        assert after - held > BLOCK * 3 // 4, "the freed block did not come back"


_FREE_ON_A_FRESH_THREAD = """if True:
    import threading, torch
    from vllm.kernels.cuda import ops
    t = ops.empty_pinned((1 << 20,), torch.uint8, torch.device("cuda:1"))
    assert not torch._C._cuda_hasPrimaryContext(0), "allocating touched GPU 0"
    box = [t]
    del t
    worker = threading.Thread(target=box.clear)       # drops the last reference there
    worker.start()
    worker.join()
    print("gpu0 context:", torch._C._cuda_hasPrimaryContext(0))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_free_on_a_fresh_thread_runs_under_the_allocating_gpu(ops):
    """The deleter selects the allocating GPU: a thread that never chose one would otherwise
    make a context (hundreds of MB) on GPU 0. A fresh interpreter, so GPU 0 starts untouched."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _FREE_ON_A_FRESH_THREAD], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "gpu0 context: False" in proc.stdout, proc.stdout


def test_the_expert_cache_store_uses_it(ops):
    from vllm.config import MoECacheConfig
    from vllm.model_executor.layers.fused_moe.expert_cache.provider import CachedWeightProvider
    before = _torch_pinned_bytes()
    w = {"w13_weight": torch.randn(8, 32, 16).to(torch.bfloat16),
         "w2_weight": torch.randn(8, 16, 16).to(torch.bfloat16)}
    p = CachedWeightProvider.from_experts(w, lambda t: t, MoECacheConfig(2), "cuda")
    assert p.store.pinned
    for n, t in p.store.tensors.items():
        assert t.is_pinned() and torch.equal(t, w[n])
        assert t.untyped_storage().nbytes() == w[n].numel() * 2
    if before is not None:
        assert _torch_pinned_bytes() == before

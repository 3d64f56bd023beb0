"""Run C-kernel code under another build of the kernels (other compiler flags), for tests that
check every build computes the same bits (vllm/kernels/cpu/build.py caches one build per flags)."""
from __future__ import annotations

from vllm.kernels.cpu import build


def run_with_cflags(monkeypatch, flags: str, fn):
    """fn() with the kernels built with ``VLLM_CPU_KERNEL_CFLAGS=flags``; the default build is
    back afterwards, however fn ends."""
    monkeypatch.setenv("VLLM_CPU_KERNEL_CFLAGS", flags)
    build.load_cpu_kernels.cache_clear()
    try:
        return fn()
    finally:
        monkeypatch.delenv("VLLM_CPU_KERNEL_CFLAGS")
        build.load_cpu_kernels.cache_clear()


def assert_pairs_same_bits_in_build(monkeypatch, flags: str, cases) -> None:
    """Each case (kernel, packed, x [T, H] bf16, weights [T, K], ids [T, K]) run through
    ``kernel.apply_pairs`` on its first 1, 3 and all T tokens (register tiles alone, and the
    block buffer past 4 tokens per expert) gives the same bits in the ``flags`` build as in the
    default one."""
    import torch

    def run():
        outs = []
        for kernel, packed, x, wts, ids in cases:
            for t in (1, 3, x.shape[0]):
                out = torch.zeros(t, ids.shape[1], x.shape[1], dtype=torch.bfloat16)
                kernel.apply_pairs(packed, x[:t], wts[:t], ids[:t], out)
                outs.append(out)
        return outs

    native = run()
    other = run_with_cflags(monkeypatch, flags, run)
    for a, b in zip(native, other):
        assert torch.equal(a, b)

"""The Triton kernels compile for each CI architecture (SM90, SM120) without a GPU: Triton's
frontend, its LLVM lowering and the ptxas it ships run on any machine. This catches what the
interpreter cannot (a non-constexpr global, an op without a lowering), and checks the float64
arithmetic the bit-exactness rests on: no FMA contraction, IEEE round-to-nearest division.
Each kernel is compiled as Triton's JIT specializes a real launch (tests/triton_compile.py
``compile_like_jit``), with the arguments its launcher passes (``capture_launches``), so its
registers and spills are those of that launch. Compiling is not running: the kernels' results
are checked on a GPU by the ``gpu`` tests."""
from __future__ import annotations

import pytest
from triton_compile import compile_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

# (slots N, tokens T, wave, padded rows) of a layer of E = 64 experts, top-8 (the probe shape):
# decode at batch 1 with 16 slots (wave 0: P = 8, N and w = 0 16-divisible) and with 63 slots
# (the H100's all-hits figures), and 32 tokens with 63 slots, the second wave of a CUDA-graph
# batch with padding rows (w = 1 a constexpr), and both of that batch's waves in one launch, as
# the provider plans them (wave -1: ``KernelStep.waves``); and a batch-1 decode step planned as
# the CUDA provider plans it, its route, then its account for a side stream (wave -2: the
# route's launch, -3: the account's), and the batch of 32's two waves so (-4, -5).
LAUNCHES = {"n16_decode": (16, 1, 0, False), "n63_decode": (63, 1, 0, False),
            "n63_wave1": (63, 32, 1, True), "n63_b32_all_waves": (63, 32, -1, True),
            "n63_decode_route": (63, 1, -2, False), "n63_decode_account": (63, 1, -3, False),
            "n63_b32_route": (63, 32, -4, True), "n63_b32_account": (63, 32, -5, True)}
POLICIES = ("lru", "lfu", "lfru", "lrfu", "lrfu_next")      # kernel_code 0 to 4

# The body of a script run by compile_in_subprocess (tests/triton_compile.py): the residency
# step's launcher (KernelStep over triton residency_step) on meta tensors, its launch compiled.
SCRIPT = r"""
import contextlib
import torch
from vllm.kernels.triton import residency_step as m
from vllm.model_executor.layers.fused_moe.expert_cache.policy import get_policy
from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency
from vllm.model_executor.layers.fused_moe.expert_cache.residency_step import KernelStep

class Side:
    @contextlib.contextmanager
    def fork(self, role):
        yield

    def join(self, role):
        pass

def launch(policy, N, T, wave, padded):
    res = Residency(64, N, get_policy(policy), device="meta")
    ids = torch.empty(T, 8, dtype=torch.int64, device="meta")
    rows = torch.empty(T, dtype=torch.int64, device="meta") if padded else None
    step = KernelStep(m.residency_step, "triton", False, Side() if wave < -1 else None)
    W = 2 if wave in (-1, -4, -5) else 1
    run = (lambda: list(step.waves(res, ids, rows, W))) if wave < 0 else \
        (lambda: step(res, ids, rows, wave))
    launched = capture_launches([(m, "_residency_step_kernel")], run)
    return launched[1 if wave in (-3, -5) else 0][1:]

for cc in (90, 120):
    for name, (N, T, wave, padded) in LAUNCHES.items():
        for policy in POLICIES:
            values, consts, options = launch(policy, N, T, wave, padded)
            out[f"{cc}/{name}/{policy}"] = compile_with_spills(m._residency_step_kernel, values,
                                                            consts, cc, options)
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocess(f"LAUNCHES = {LAUNCHES!r}\nPOLICIES = {POLICIES!r}\n" + SCRIPT)


@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
@pytest.mark.parametrize("policy", POLICIES)
def test_residency_step_compiles_without_contraction(compiled, cc, launch, policy):
    k = compiled[f"{cc}/{launch}/{policy}"]
    ptx = k["ptx"]
    assert f".target sm_{cc}a" in ptx
    # crf * p * w1 + r * w0; lrfu_next's lrfu + p * next_weight and err * lr / norm * 2**32
    assert "fma.rn.f64" not in ptx and "fma.rz.f64" not in ptx
    assert "rcp.approx" not in ptx and "div.approx" not in ptx
    # Their keep scores divide (the account ranks nothing, but lrfu_next's learning divides).
    if policy == "lrfu_next" or (policy in ("lfru", "lrfu") and not launch.endswith("account")):
        assert "div.rn.f64" in ptx
    # lrfu_next's learning (not in the route) rounds half to even as (x +- 2**52) -+ 2**52:
    # not folded away.
    if policy == "lrfu_next" and not launch.endswith("route"):
        assert "0d4330000000000000" in ptx and "cvt.rni" not in ptx


@pytest.mark.parametrize("cc", [90, 120])
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_residency_step_does_not_spill(compiled, cc, launch):
    """One program does the step's waves over [E] and [N] vectors and an [N, N] ranking: it must
    fit in registers. Spills fail; so does any stack beyond one spilled 32-bit word, which
    ptxas 13.x (Triton 3.9's, run with ``--regAllocOptLevel=2``) may leave at 40 registers, far
    from the cap (one store, two reloads). Measured (SM90 / SM120, 2026-11-26): lrfu_next
    80-118 registers under 3.9 and 96-206 under 3.6 (the GPU machine's) on 8 warps; before, on
    4 warps, 63 slots of a batch-1 decode took 255 registers and spilled 40 bytes under 3.6;
    the other policies 32-86. The launch of both waves (2026-11-27, 8 warps): lrfu_next 164-168
    under 3.9 and 254-255, without a spill, under 3.6 (its loop holds more than one wave's
    body); the others 76-114 and 112-122. Its route and account for a side stream (2026-11-27,
    SM90 / SM120): the route 88-166 under 3.9 and 128-255 under 3.6 (it holds the waves'
    routes and, for a step whose experts need several waves, their whole bodies), the account
    40-120 and 42-130; no spill."""
    got = {p: compiled[f"{cc}/{launch}/{p}"] for p in POLICIES}
    got = {p: (k["registers"], k["spills"], k["stack"]) for p, k in got.items()}
    assert all(spills == stack == 0 or (regs <= 64 and spills <= 4 and stack <= 8)
               for regs, spills, stack in got.values()), got

"""The expert cache's Triton residency step (``vllm/kernels/triton/residency_step.py``) equals the
torch reference step bit for bit (plan, slot ids, wave plan, maps, policy state, counters) over
random and recorded routing, for every policy and N in {1, top_k, E/2, E-1}, launched wave by wave
and planning all of a step's waves in one launch.

On a GPU these run the compiled kernel on CUDA against the reference on CUDA; elsewhere
the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py: numpy,
so float64 and integer results are those of IEEE arithmetic, as on the GPU). The test marked
``gpu`` adds longer sequences and larger shapes on CUDA.
"""
from __future__ import annotations

import pytest
import torch
from triton_kernels import triton_module

from residency_cases import (POLICIES, random_steps, saturate_predictor, step_all_waves,
                             step_both)

from vllm.model_executor.layers.fused_moe.expert_cache.policy import get_policy
from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency
from vllm.model_executor.layers.fused_moe.expert_cache.residency_step import (KernelStep,
                                                                              reference_step)

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def triton_step():
    """The kernel, compiled on a GPU, else interpreted."""
    return KernelStep(triton_module("residency_step").residency_step, "triton", on_host=False)


def _run(step, E, K, N, policy, num_steps, seed, device=DEVICE, compare=step_both):
    """``compare``: step_both (a launch per wave) or step_all_waves (one for the step)."""
    dev = torch.device(device)
    ref = Residency(E, N, get_policy(policy), device=dev)
    ker = Residency(E, N, get_policy(policy), device=dev)
    for ids, row_slots in random_steps(E, K, num_steps, seed=seed):
        rows = row_slots.to(dev) if row_slots is not None else None
        compare(reference_step, step, ref, ker, ids.to(dev), rows)
    assert int(ker.hits) > 0 and int(ker.misses) > 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("E,K,N,num_steps", [(16, 4, 1, 25), (16, 4, 4, 80), (16, 4, 8, 80),
                                             (16, 4, 15, 80), (64, 6, 63, 60)])
def test_triton_step_equals_reference(triton_step, policy, E, K, N, num_steps):
    _run(triton_step, E, K, N, policy, num_steps, seed=E * 100 + N)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("E,K,N,num_steps", [(16, 4, 1, 8), (16, 4, 4, 40), (64, 6, 63, 40)])
def test_triton_one_launch_for_all_waves_equals_reference(triton_step, policy, E, K, N,
                                                          num_steps):
    """``KernelStep.waves``: one launch plans every wave of the step (wave 0's body, then the
    loop over the rest), against the reference wave by wave."""
    _run(triton_step, E, K, N, policy, num_steps, seed=E * 10 + N, compare=step_all_waves)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("E,K,N,num_steps", [(16, 4, 4, 24), (16, 4, 15, 24)])
def test_triton_route_then_account_equals_reference(policy, E, K, N, num_steps):
    """``KernelStep`` with a side stream: a step launches its route, forks its account onto
    the side stream (role "account") and joins it once the waves were taken. A step of several
    waves splits so when its experts fit the first wave, else its route runs the waves whole
    and the account nothing. Against the reference wave by wave: every plan, the slot ids and
    all state after each step (N = 4 of 16 at top-4 mixes one-wave steps and several-wave ones
    of both kinds; N = 15 has only one-wave steps)."""
    from side_streams import RecordingSideStream
    side = RecordingSideStream()
    step = KernelStep(triton_module("residency_step").residency_step, "triton", on_host=False,
                      side=side)
    kinds = []                                 # (waves by shape, waves the experts needed)

    def compare(*args):
        W = step_all_waves(*args)
        kinds.append((W, int(args[3].step_waves)))
    _run(step, E, K, N, policy, num_steps, seed=E * 7 + N, compare=compare)
    assert side.roles == [("fork", "account"), ("join", "account")] * len(kinds)
    assert any(W == 1 for W, _ in kinds)
    if N == 4:
        assert any(W > 1 and n <= 1 for W, n in kinds)      # the split several-wave launch
        assert any(W > 1 and n > 1 for W, n in kinds)       # the route runs the waves whole


def test_triton_parts_refuse_bad_evictions_or_a_later_first_wave(triton_step):
    res = Residency(16, 4, get_policy("lru"))
    ids = torch.zeros(1, 4, dtype=torch.int64)
    args = triton_step._arguments(res, ids, None, 0, 2)
    with pytest.raises(ValueError, match=r"part='route' of waves \[0, 2\) needs .* 3 elements"):
        triton_step.kernel(*args, num_waves=2, part="route",
                           evictions=torch.zeros(1, dtype=torch.int64))
    later = triton_step._arguments(res, ids, None, 1, 2)
    with pytest.raises(ValueError, match=r"waves \[1, 3\) needs them to start at wave 0"):
        triton_step.kernel(*later, num_waves=2, part="account",
                           evictions=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="part='half'; allowed"):
        triton_step.kernel(*args, num_waves=2, part="half")


@pytest.mark.parametrize("policy", ["lrfu", "lrfu_next"])
def test_triton_step_equals_reference_with_padded_expert_lanes(triton_step, policy):
    """E = 40 (64 lanes: lrfu_next's unrolled weight tiles of 32 rows, the second one
    partly past E), N = 20 (a 32-lane slot block, partly past N)."""
    _run(triton_step, 40, 6, 20, policy, 50, seed=40)


@pytest.mark.parametrize("policy", ["lru", "lrfu", "lrfu_next"])
def test_triton_step_equals_reference_at_large_shapes(triton_step, policy):
    """E = 160 (padded to 256 lanes), N = 80 (more victims than one row block), prefill-sized
    steps of up to 40 x 8 pairs (more than one pair chunk)."""
    _run(triton_step, 160, 8, 80, policy, 30, seed=7)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("N", [1, 4, 16, 31])
def test_triton_step_equals_reference_on_recorded_routing(triton_step, recorded_routing, policy,
                                                          N):
    """The default model's own routing (E = 32, top-4), one layer, as decode steps of four
    interleaved sequences."""
    from vllm.model_executor.layers.fused_moe.expert_cache.trace import interleave
    trace = recorded_routing
    ref = Residency(trace.num_experts, N, get_policy(policy), DEVICE)
    ker = Residency(trace.num_experts, N, get_policy(policy), DEVICE)
    steps = interleave(trace.offsets, 4)
    for tokens in steps[:12] if N == 1 else steps:          # N = 1: one wave per expert
        ids = torch.as_tensor(trace.experts[tokens[tokens >= 0], 1].astype("int64"))
        step_both(reference_step, triton_step, ref, ker, ids.to(DEVICE), None)
    assert int(ker.hits) + int(ker.misses) > 0


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, device=DEVICE)


@pytest.mark.parametrize("policy", ["lrfu", "lrfu_next"])
def test_triton_step_past_the_decay_table(triton_step, policy):
    ref = Residency(16, 5, get_policy(policy), DEVICE)
    ker = Residency(16, 5, get_policy(policy), DEVICE)
    for i, (ids, row_slots) in enumerate(random_steps(16, 2, 60, seed=3)):
        if i == 30:
            for r in (ref, ker):
                r.clock.add_(10 ** 6)
        rows = row_slots.to(DEVICE) if row_slots is not None else None
        step_both(reference_step, triton_step, ref, ker, ids.to(DEVICE), rows)


@pytest.mark.parametrize("E,N", [(16, 4), (64, 40)])
def test_triton_step_lrfu_next_at_the_weight_bounds(triton_step, E, N):
    """lrfu_next from weights and biases over the whole +-2**40 range: large exact sums, and
    updates that the clamps cut."""
    ref, ker = (Residency(E, N, get_policy("lrfu_next"), DEVICE) for _ in range(2))
    saturate_predictor([ref.policy_state, ker.policy_state], seed=E + N)
    weight, clamped = ker.policy_state["weight"], 0
    for ids, row_slots in random_steps(E, 4, 40, seed=N):
        rows = row_slots.to(DEVICE) if row_slots is not None else None
        before = weight.abs() == 2 ** 40
        step_both(reference_step, triton_step, ref, ker, ids.to(DEVICE), rows)
        clamped += int(((weight.abs() == 2 ** 40) & ~before).sum())
    assert clamped > 0


def test_triton_step_by_hand(triton_step):
    """E=6, N=2: waves resident-first, empty slots before evictions, padding rows and empty
    waves change nothing; ids >= E route nowhere (the router never makes one)."""
    res = Residency(6, 2, get_policy("lru"), DEVICE)
    triton_step(res, _t([[4, 1]]), None, 0)                   # 1 -> slot 0, 4 -> slot 1
    assert res.expert_of_slot.tolist() == [1, 4]
    ids = _t([[0, 4], [5, -1], [4, 2]])                       # needs 0, 2, 4, 5
    plan, slots = triton_step(res, ids, _t([0, 1, 2]), 0)
    assert res.wave_of_expert.tolist() == [0, -1, 1, -1, 0, 1]
    assert int(res.step_waves) == 2
    assert plan.experts.tolist() == [0, -1] and plan.slots.tolist() == [0, -1]
    assert slots.tolist() == [[0, 1], [-1, -1], [1, -1]]
    before = res.counters.clone()
    plan, slots = triton_step(res, _t([[3, 9]]), _t([-1]), 0)
    assert slots.tolist() == [[-1, -1]] and not plan.valid.any()
    assert torch.equal(res.counters[:7], before[:7]) and int(res.step_waves) == 0
    plan, slots = triton_step(res, _t([[6, 4]]), None, 0)
    assert slots.tolist() == [[-1, res.slot_of_expert[4].item()]]


def test_triton_step_rejects_wrong_tensors(triton_step):
    res = Residency(6, 2, get_policy("lru"), DEVICE)
    params, decay_pow = res.policy.kernel_params(torch.device(DEVICE))
    i64 = {"dtype": torch.int64, "device": DEVICE}
    with pytest.raises(ValueError, match="topk_ids must be a contiguous torch.int64"):
        triton_step.kernel(_t([[1, 2]]).int(), None, 0, res.slot_of_expert, res.expert_of_slot,
                           res.wave_of_expert, res.counters, 0, res.policy_state, params,
                           decay_pow, torch.empty(2, **i64), torch.empty(2, **i64),
                           torch.empty(2, dtype=torch.bool, device=DEVICE),
                           torch.empty(1, 2, **i64))
    assert res.counters.tolist() == [0] * 8


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_triton_step_equals_reference_on_cuda(policy):
    """The compiled kernel on the GPU against the torch reference on the GPU. Three shapes: on
    an H100 each new shape compiled several variants, six shapes took 35 s per policy."""
    from vllm.kernels.triton.residency_step import residency_step
    step = KernelStep(residency_step, "triton", on_host=False)
    for E, K, N in [(16, 4, 1), (64, 8, 32), (256, 8, 64)]:
        _run(step, E, K, N, policy, 80, seed=E + N, device="cuda")
    # One launch for all of a step's waves: its own compiled variants, so one shape only.
    _run(step, 64, 8, 32, policy, 40, seed=32, device="cuda", compare=step_all_waves)
    # A one-wave step's route, then its account on the platform's side stream.
    from vllm.platforms import platform_for
    routed = KernelStep(residency_step, "triton", on_host=False,
                        side=platform_for("cuda").side_stream(torch.device("cuda")))
    _run(routed, 64, 8, 32, policy, 40, seed=33, device="cuda", compare=step_all_waves)

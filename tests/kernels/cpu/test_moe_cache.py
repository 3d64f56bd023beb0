"""The expert cache's C kernels (``vllm/kernels/cpu/moe_cache.c``): the fused residency step
equals the torch reference step bit for bit (plan, slot ids, wave plan, maps, policy state,
counters) over long random and recorded routing sequences, for every policy and N in
{1, top_k, E/2, E-1}, called wave by wave and planning all of a step's waves in one call; LRU
also against a plain-Python simulator; and the copy kernel against torch indexing."""
from __future__ import annotations

import random

import pytest
import torch

from residency_cases import (POLICIES, bits, plain_lru, random_steps, saturate_predictor,
                             step_all_waves, step_both)

from vllm.kernels.cpu import moe_cache
from vllm.kernels.cpu.build import load_cpu_kernels
from vllm.model_executor.layers.fused_moe.expert_cache.policy import get_policy
from vllm.model_executor.layers.fused_moe.expert_cache.residency import Residency
from vllm.model_executor.layers.fused_moe.expert_cache.residency_step import (KernelStep,
                                                                              reference_step)

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="CPU kernels not built")
kernel_step = KernelStep(moe_cache.residency_step, "cpu_kernel", on_host=True)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("E,K,N", [(16, 4, 1), (16, 4, 4), (16, 4, 8), (16, 4, 15),
                                   (64, 6, 6), (64, 6, 32), (64, 6, 63)])
def test_kernel_equals_reference_on_random_routing(policy, E, K, N):
    ref, ker = Residency(E, N, get_policy(policy)), Residency(E, N, get_policy(policy))
    for ids, row_slots in random_steps(E, K, 400, seed=E * 100 + N):
        step_both(reference_step, kernel_step, ref, ker, ids, row_slots)
    assert int(ker.hits) > 0 and int(ker.misses) > 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("E,K,N", [(16, 4, 1), (16, 4, 4), (16, 4, 15), (64, 6, 6),
                                   (64, 6, 32), (64, 6, 63)])
def test_one_call_for_all_waves_equals_reference(policy, E, K, N):
    """``KernelStep.waves``: one C call plans every wave of the step, against the reference wave
    by wave; steps of several waves with misses in later ones occur (else this tests little)."""
    ref, ker = Residency(E, N, get_policy(policy)), Residency(E, N, get_policy(policy))
    multi = 0
    for ids, row_slots in random_steps(E, K, 300, seed=E * 10 + N):
        misses = int(ref.misses)
        if step_all_waves(reference_step, kernel_step, ref, ker, ids, row_slots) > 1:
            multi += int(ref.misses) > misses and int(ref.last_misses) > 0
    assert multi > 0 or N >= E - 1, "no multi-wave step missed in its last wave"


@pytest.mark.parametrize("policy", ["lfru", "lrfu", "lrfu_next"])
def test_kernel_equals_reference_past_the_decay_table(policy):
    """A clock far past the last uses: dt beyond the lrfu table (g**dt is then 0.0)."""
    ref, ker = Residency(16, 5, get_policy(policy)), Residency(16, 5, get_policy(policy))
    steps = list(random_steps(16, 2, 120, seed=3))
    for i, (ids, row_slots) in enumerate(steps):
        if i == 60:
            for r in (ref, ker):
                r.clock.add_(10 ** 6)
        step_both(reference_step, kernel_step, ref, ker, ids, row_slots)


@pytest.mark.parametrize("E,N", [(16, 4), (64, 12), (64, 40)])
def test_kernel_equals_reference_lrfu_next_at_the_weight_bounds(E, N):
    """lrfu_next from weights and biases over the whole +-2**40 range: large exact sums, and
    updates that the clamps cut."""
    ref, ker = (Residency(E, N, get_policy("lrfu_next")) for _ in range(2))
    saturate_predictor([ref.policy_state, ker.policy_state], seed=E + N)
    weight, clamped = ker.policy_state["weight"], 0
    for ids, row_slots in random_steps(E, 4, 150, seed=N):
        before = weight.abs() == 2 ** 40
        step_both(reference_step, kernel_step, ref, ker, ids, row_slots)
        clamped += int(((weight.abs() == 2 ** 40) & ~before).sum())
    assert clamped > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_keep_scores_bitwise(policy):
    """The C scores equal the torch policy's keep_score bit for bit on random states (dt from 0
    past the lrfu decay table; lrfu_next's weights over their whole range)."""
    pol = get_policy(policy)
    g = torch.Generator().manual_seed(1)
    E, clock = 4096, 50_000
    state = pol.init_state(E, torch.device("cpu"))
    if "freq" in state:
        state["freq"] = torch.randint(0, 10_000, (E,), generator=g)
    if "last_use" in state:
        state["last_use"] = clock - torch.randint(0, 40_000, (E,), generator=g)
        state["last_use"][:64] = clock - torch.arange(64)
    if "crf" in state:
        state["crf"] = torch.rand(E, generator=g, dtype=torch.float64) * 40
    if "weight" in state:
        saturate_predictor([state], seed=2)
    params, table = pol.kernel_params(torch.device("cpu"))
    got = moe_cache.keep_scores(pol.kernel_code, clock, state, params, table)
    want = pol.keep_score(state, torch.tensor(clock))
    assert bits(got) == bits(want)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("N", [1, 4, 16, 31])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_kernel_equals_reference_on_recorded_routing(recorded_routing, policy, N, batch):
    """Each layer's recorded routing replayed as decode steps of ``batch`` interleaved
    sequences (the E = 32, top-4 default model); batch 16 (64 pairs: 2 to 32 waves) plans
    each step's waves in one call."""
    from vllm.model_executor.layers.fused_moe.expert_cache.trace import interleave
    trace = recorded_routing
    steps = interleave(trace.offsets, batch)                             # [S, batch] tokens
    compare = step_all_waves if batch == 16 else step_both
    for layer in range(trace.num_layers):
        ref = Residency(trace.num_experts, N, get_policy(policy))
        ker = Residency(trace.num_experts, N, get_policy(policy))
        for tokens in steps:
            ids = torch.as_tensor(trace.experts[tokens[tokens >= 0], layer].astype("int64"))
            compare(reference_step, kernel_step, ref, ker, ids, None)
        assert int(ker.hits) + int(ker.misses) > 0


def test_kernel_lru_matches_plain_python():
    E, K, N = 12, 3, 5
    res, needs, rng = Residency(E, N, get_policy("lru")), [], random.Random(9)
    for _ in range(300):                                   # one token a step: one wave
        row = rng.sample(range(E // 2) if rng.random() < 0.6 else range(E), K)
        needs.append(sorted(row))
        kernel_step(res, torch.tensor([row]), None, 0)
    assert (int(res.hits), int(res.misses)) == plain_lru(needs, N)


def test_slot_ids_and_waves_by_hand():
    """E=6, N=2, all experts resident-or-not by construction: waves resident-first."""
    res = Residency(6, 2, get_policy("lru"))
    kernel_step(res, torch.tensor([[4, 1]]), None, 0)             # 1 -> slot 0, 4 -> slot 1
    assert res.expert_of_slot.tolist() == [1, 4]
    ids = torch.tensor([[0, 4], [5, -1], [4, 2]])                  # needs 0, 2, 4, 5
    plan, slots = kernel_step(res, ids, torch.tensor([0, 1, 2]), 0)
    assert res.wave_of_expert.tolist() == [0, -1, 1, -1, 0, 1]      # 4 (hit) first, then 0 | 2, 5
    assert int(res.step_waves) == 2
    assert plan.experts.tolist() == [0, -1] and plan.slots.tolist() == [0, -1]  # 0 evicts 1
    assert slots.tolist() == [[0, 1], [-1, -1], [1, -1]]
    plan, slots = kernel_step(res, ids, torch.tensor([0, 1, 2]), 1)
    assert plan.experts.tolist() == [2, 5] and sorted(plan.slots.tolist()) == [0, 1]
    assert slots.tolist() == [[-1, -1], [res.slot_of_expert[5].item(), -1],
                              [-1, res.slot_of_expert[2].item()]]
    # A padding row routes nowhere and an empty wave changes nothing.
    before = res.counters.clone()
    plan, slots = kernel_step(res, torch.tensor([[3, 0]]), torch.tensor([-1]), 0)
    assert slots.tolist() == [[-1, -1]] and not plan.valid.any()
    assert torch.equal(res.counters[:7], before[:7]) and int(res.step_waves) == 0


def test_expert_id_out_of_range_is_an_error():
    res = Residency(6, 2, get_policy("lru"))
    with pytest.raises(ValueError, match="num_experts=6"):
        kernel_step(res, torch.tensor([[6, 1]]), None, 0)
    assert res.counters.tolist() == [0] * 8 and res.slot_of_expert.tolist() == [-1] * 6


def test_wrong_sizes_are_refused_before_the_kernel_runs():
    """The kernel indexes row_slots, the plans and slot_ids without bounds: their sizes are
    checked against T, K, N and num_waves first, naming the values."""
    res = Residency(6, 2, get_policy("lru"))
    params, decay_pow = res.policy.kernel_params(torch.device("cpu"))

    def call(row_slots, num_waves, plan_n, sid_n):
        moe_cache.residency_step(
            torch.tensor([[1, 2], [3, 4]]), row_slots, 0, res.slot_of_expert, res.expert_of_slot,
            res.wave_of_expert, res.counters, 0, res.policy_state, params, decay_pow,
            torch.empty(plan_n, dtype=torch.int64), torch.empty(plan_n, dtype=torch.int64),
            torch.empty(plan_n, dtype=torch.bool), torch.empty(sid_n, dtype=torch.int64),
            num_waves=num_waves)
    with pytest.raises(ValueError, match="row_slots has 1 entries for T=2"):
        call(torch.tensor([0]), 2, 4, 8)
    with pytest.raises(ValueError, match=r"num_waves=2, N=2, T=2, K=2 .* need 4 elements and "
                                         r"slot_ids 8, got \[2, 2, 2\] and 8"):
        call(None, 2, 2, 8)
    with pytest.raises(ValueError, match="num_waves=0; must be an int >= 1"):
        call(None, 0, 0, 0)
    assert res.counters.tolist() == [0] * 8
    call(torch.tensor([0, 1]), 2, 4, 8)                     # the right sizes run
    assert int(res.misses) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.int32])
def test_expert_copy_moves_only_valid_rows(dtype):
    g = torch.Generator().manual_seed(0)
    src = (torch.randn(7, 3, 5, generator=g) * 4).to(dtype)
    dst = torch.zeros(4, 3, 5, dtype=dtype)
    experts = torch.tensor([6, 2, -1, 0])
    slots = torch.tensor([1, 3, -1, 0])
    valid = torch.tensor([True, True, False, False])
    moe_cache.expert_copy(src, dst, experts, slots, valid)
    want = torch.zeros(4, 3, 5, dtype=dtype)
    want[1], want[3] = src[6], src[2]
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


def test_expert_copy_rejects_out_of_range_ids():
    src, dst = torch.zeros(3, 4), torch.zeros(2, 4)
    with pytest.raises(ValueError, match="outside"):
        moe_cache.expert_copy(src, dst, torch.tensor([3]), torch.tensor([0]), torch.tensor([True]))
    with pytest.raises(ValueError, match="outside"):
        moe_cache.expert_copy(src, dst, torch.tensor([0]), torch.tensor([2]), torch.tensor([True]))

"""Bounds of the "cutlass_w4a16" backend's pair path (not yet passed on a GPU; its op here is the
torch stand-in written from the op's contract): 8191/8192/8193 tokens against the torch
backend, act order included (its gathers run in 1024-row chunks, so these sizes cross chunk
edges), and a cache of one slot, fewer than top_k, equal bit for bit to the uncached layer."""
from __future__ import annotations

import pytest
import torch
from model_executor.layers.fused_moe.cutlass_w4a16_standin import standin_ops
from model_executor.layers.fused_moe.test_cutlass_w4a16 import TOP_K, assert_close_to, inputs
from model_executor.layers.fused_moe.test_cutlass_w4a16_act_order import build


@pytest.fixture(scope="module")
def layers():
    return build("torch", True), build("torch", True, ops=standin_ops())


@pytest.mark.parametrize("T", [8191, 8192, 8193])
def test_large_batches_close_to_the_torch_backend(layers, T):
    ref, got = layers
    x, logits = inputs(T, T)
    assert_close_to(got(x, logits), ref(x, logits))


def test_fewer_slots_than_top_k_bitwise():
    assert TOP_K > 1
    plain = build("torch", True, ops=standin_ops())
    one = build("torch", True, cache=1, ops=standin_ops())
    assert one.expert_cache is not None
    for T in (1, 3, 17):
        x, logits = inputs(T, 90 + T)
        assert torch.equal(one(x, logits), plain(x, logits))

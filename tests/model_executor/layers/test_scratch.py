"""The reused CPU scratch buffers."""
from __future__ import annotations

import torch

from vllm.model_executor.layers.scratch import scratch


def test_same_purpose_reuses_memory_and_grows():
    cpu = torch.device("cpu")
    a = scratch("test.a", (4, 8), torch.float32, cpu)
    b = scratch("test.a", (2, 8), torch.float32, cpu)
    assert a.shape == (4, 8) and b.shape == (2, 8) and b.data_ptr() == a.data_ptr()
    other = scratch("test.b", (4, 8), torch.float32, cpu)
    assert other.data_ptr() != a.data_ptr()                     # purposes never share
    assert scratch("test.a", (4, 8), torch.bfloat16, cpu).data_ptr() != a.data_ptr()
    big = scratch("test.a", (64, 64), torch.float32, cpu)
    assert big.shape == (64, 64) and big.is_contiguous()


def test_writable_inside_and_outside_inference_mode():
    with torch.inference_mode():
        buf = scratch("test.c", (3,), torch.float32, torch.device("cpu"))
        buf.fill_(1.0)
    scratch("test.c", (3,), torch.float32, torch.device("cpu")).add_(1.0)
    assert torch.equal(buf, torch.full((3,), 2.0))

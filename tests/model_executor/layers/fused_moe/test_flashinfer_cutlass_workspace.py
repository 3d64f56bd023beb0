"""flashinfer_cutlass's shared workspace against FlashInfer's FP8 block-scale runner, which sizes
its workspace from the most rows it has ever seen (a stand-in with that running maximum): a large
eager prefill must not leave later calls passing a buffer FlashInfer then rejects."""
from __future__ import annotations

import torch
from model_executor.layers.fused_moe.flashinfer_standin import running_max_flashinfer
from model_executor.layers.fused_moe.test_flashinfer_cutlass import build, inputs

from vllm.model_executor.layers.fused_moe import flashinfer_cutlass as fc
from vllm.model_executor.layers.fused_moe.modular_kernel import capture_warm_up


def test_fp8_block_workspace_follows_flashinfers_running_maximum(monkeypatch):
    """A large eager prefill (FlashInfer allocating its own workspace) raises the FP8 runner's
    need past the buffer the capture warm-up sized: later eager calls must not pass it, and
    the next capture warm-up grows it."""
    api = running_max_flashinfer()
    layer = build("fp8-block", "torch", api=api, dtype=torch.bfloat16)
    with capture_warm_up(8):
        layer(*inputs(2, 0, torch.bfloat16))                         # 16 rows: 1 KiB
    layer(*inputs(20, 1, torch.bfloat16))                            # 40 rows, eager
    layer(*inputs(2, 2, torch.bfloat16))                             # needs 40 rows' worth
    assert api.calls[-1][2]["workspace_buffer"] is None
    with capture_warm_up(8):
        layer(*inputs(2, 3, torch.bfloat16))
    monkeypatch.setattr(fc, "capturing", lambda device: True)
    del api.calls[:]
    layer(*inputs(8, 4, torch.bfloat16))
    assert api.calls[-1][2]["workspace_buffer"].numel() >= 64 * 40

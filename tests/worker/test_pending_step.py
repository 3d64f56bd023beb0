"""``PendingStep``: a launched step's tokens, read back once, and the rows a step scheduled
ahead takes from it; ``Platform.download`` on CPU."""
from __future__ import annotations

import pytest
import torch

from vllm.core.sched_output import RunnerOutput, SampledToken
from vllm.platforms import platform_for
from vllm.worker.pending_step import PendingStep


def _step(tokens: list[int], **kw) -> PendingStep:
    t = torch.tensor(tokens, dtype=torch.int64)
    return PendingStep(req_ids=[f"r{i}" for i in range(len(tokens))], token_ids=t,
                       host_tokens=platform_for("cpu").download(t), **kw)


def test_result_maps_rows_to_requests_once():
    step = _step([7, 8, 9])
    out = step.result()
    assert out.sampled == {"r0": SampledToken(7), "r1": SampledToken(8), "r2": SampledToken(9)}
    assert step.result() is out


def test_tokens_for_keeps_or_selects_rows_in_the_order_asked():
    step = _step([7, 8, 9])
    assert step.tokens_for(["r0", "r1", "r2"]) is step.token_ids
    assert step.tokens_for(["r2", "r0"]).tolist() == [9, 7]
    with pytest.raises(RuntimeError, match=r"\['r5'\] were scheduled ahead"):
        step.tokens_for(["r0", "r5"])
    with pytest.raises(RuntimeError, match="sampled nothing"):
        PendingStep.done(RunnerOutput({})).tokens_for(["r0"])


def test_a_failing_read_calls_on_error():
    called = []

    def broken():
        raise RuntimeError("device fault")
    step = PendingStep(req_ids=["r0"], token_ids=torch.tensor([1]), host_tokens=broken,
                       on_error=lambda: called.append(True))
    with pytest.raises(RuntimeError, match="device fault"):
        step.result()
    assert called == [True]


def test_download_on_cpu_returns_the_tensor():
    t = torch.arange(4)
    assert platform_for("cpu").download(t)() is t


@pytest.mark.gpu
def test_download_on_cuda_returns_the_values_after_the_copy():
    """Pinned memory and an event: the host reads the tensor once the copy, queued behind the
    kernel that wrote it, has run."""
    x = torch.randn(4096, 4096, device="cuda")
    t = (x @ x).argmax(dim=1)                   # a kernel still running when download starts
    wait = platform_for("cuda").download(t)
    host = wait()
    assert host.device.type == "cpu" and host.is_pinned()
    assert torch.equal(host, t.cpu())

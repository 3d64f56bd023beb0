"""``CudaGraphCapturer`` against a recording ``torch.cuda`` (tests/fake_cuda.py), and what
``CudaDecodeGraphs`` keeps of a capture. Without a GPU this checks the order and the device of
every stream, synchronize and capture call, not that CUDA accepts them (the ``gpu`` tests in
test_cuda_graphs.py capture real graphs)."""
from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCuda

from vllm import LLM, SamplingParams
from vllm.worker import cuda_graphs
from vllm.worker.graph_capture import CudaGraphCapturer, GraphCapturer


class _Out:
    """The warm-up's output: records which stream it is marked as used on."""

    def __init__(self, cuda: FakeCuda):
        self.cuda = cuda

    def record_stream(self, stream) -> None:
        self.cuda.log.append(("record_stream", stream.name))


def _step(cuda: FakeCuda, name: str):
    def fn():
        cuda.log.append((name, cuda.where()))
        return _Out(cuda)
    return fn


def test_warm_up_and_capture_run_on_the_engines_device_and_capture_stream():
    """Device cuda:1 while cuda:0 is current: everything runs under cuda:1, the warm-up on the
    capture stream (joined both ways), which is a high-priority stream."""
    cuda = FakeCuda(current_device=0)
    capturer = CudaGraphCapturer(torch.device("cuda", 1), cuda=cuda)
    capturer.warm_up(_step(cuda, "warm-up"))
    replay = capturer.capture(_step(cuda, "captured"))
    replay()
    assert cuda.index == 0 and cuda.current_stream(1).name == "default:1"
    cap = capturer.stream.name
    assert capturer.stream.index == 1 and capturer.stream.priority == -1
    assert cuda.log == [
        ("Stream", cap, -1),
        ("wait_stream", cap, "default:1"), ("warm-up", (1, cap)),
        ("wait_stream", "default:1", cap), ("record_stream", "default:1"),
        ("synchronize", 1), ("capture_begin", capturer.pool, (1, cap)), ("captured", (1, cap)),
        ("capture_end", (1, cap)), ("wait_stream", "default:1", cap),
        ("replay", (1, "default:1"))]


def test_a_failed_capture_ends_it_and_the_next_uses_a_fresh_pool():
    cuda = FakeCuda()
    capturer = CudaGraphCapturer(torch.device("cuda", 1), cuda=cuda)

    def fails():
        raise RuntimeError("host sync inside the forward")
    with pytest.raises(RuntimeError, match="host sync"):
        capturer.capture(fails)
    first = capturer.pool
    assert cuda.log[-1] == ("capture_end", (1, capturer.stream.name)) and cuda.index == 0
    capturer.after_failure()
    assert cuda.log[-1] == ("synchronize", 1)
    capturer.capture(_step(cuda, "captured"))
    assert capturer.pool is not None and capturer.pool != first


def test_a_graph_break_splits_the_capture_into_pieces_replayed_in_order():
    """``break_graph`` inside the captured function ends the graph being captured and begins
    the next in the same pool; its function does not run at capture. A replay runs the first
    graph, the function (its result copied into the tensor the capture handed on; a break
    without ``out_like`` hands on nothing), the next graph, ..., on the caller's stream; outside
    a capture ``break_graph`` just calls it."""
    from vllm.model_executor.graph_break import break_graph
    cuda = FakeCuda()
    capturer = CudaGraphCapturer(torch.device("cuda", 1), cuda=cuda)
    handed = []

    def eager():
        cuda.log.append(("eager", cuda.where()))
        return torch.full((2,), 7.0)

    def in_place():
        cuda.log.append(("in place", cuda.where()))

    def fn():
        cuda.log.append(("before", cuda.where()))
        handed.append(break_graph(eager, torch.zeros(2)))
        cuda.log.append(("after", cuda.where()))
        handed.append(break_graph(in_place, None))    # writes in place: nothing handed on
        return _Out(cuda)
    replay = capturer.capture(fn)
    cap, pool = (1, capturer.stream.name), capturer.pool
    assert cuda.log == [("Stream", cap[1], -1), ("synchronize", 1), ("capture_begin", pool, cap),
                        ("before", cap),
                        ("capture_end", cap), ("capture_begin", pool, cap), ("after", cap),
                        ("capture_end", cap), ("capture_begin", pool, cap),
                        ("capture_end", cap), ("wait_stream", "default:1", capturer.stream.name)]
    del cuda.log[:]
    replay()
    assert cuda.log == [("replay", (1, "default:1")), ("eager", (1, "default:1")),
                        ("replay", (1, "default:1")), ("in place", (1, "default:1")),
                        ("replay", (1, "default:1"))]
    assert handed[1] is None
    assert handed[0].tolist() == [7.0, 7.0]
    assert break_graph(lambda: torch.ones(1), torch.zeros(1)).tolist() == [1.0]


class _MaskingCapturer(GraphCapturer):
    """As the CUDA capture: the forward raises, then ``capture_end`` in the ``finally`` raises
    its own error, which masks the first."""

    def capture(self, fn):
        try:
            raise ValueError("the forward read a device value on the host")
        finally:
            self.end()

    def end(self):
        raise RuntimeError("capture_end: operation failed due to a previous error")


def _llm(tiny_model_factory, monkeypatch, capturer=None, **kw):
    monkeypatch.setattr(cuda_graphs, "uses_cuda_graphs", lambda device: True)
    if capturer is not None:
        monkeypatch.setattr(cuda_graphs, "default_capturer", lambda device: capturer)
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    return LLM(path, device="cpu", max_num_seqs=4, **kw)


_PROMPTS = [{"prompt_token_ids": p} for p in ([5, 17, 99, 3], [250, 7], [11] * 9)]
_PARAMS = [SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True) for i in range(3)]


def test_a_failed_capture_logs_the_error_capture_end_masked(tiny_model_factory, monkeypatch,
                                                             vllm_log):
    llm = _llm(tiny_model_factory, monkeypatch, _MaskingCapturer())
    llm.generate(_PROMPTS, _PARAMS)
    graphs = llm.llm_engine.runner.decode_graphs
    assert graphs.refused.startswith("RuntimeError: capture_end")
    assert "root cause: ValueError: the forward read a device value" in graphs.refused
    assert "root cause: ValueError" in vllm_log.text and graphs._out is None


def test_every_graph_writes_one_shared_logits_buffer(tiny_model_factory, monkeypatch):
    """One [Pmax, V] buffer, allocated at the first capture: each replay returns rows of it (a
    copy of the graph's logits, so still bitwise the eager ones: test_cuda_graphs.py), and an
    entry keeps no logits of its own."""
    llm = _llm(tiny_model_factory, monkeypatch, cuda_graph_sizes=[2, 4])
    graphs = llm.llm_engine.runner.decode_graphs
    orig, seen = graphs.logits, []

    def spy(input_ids, positions, md, ids=None):
        replayed = graphs._out is not None and \
            graphs._entries.get(cuda_graphs.padded_size(input_ids.shape[0], graphs.sizes))
        out = orig(input_ids, positions, md, ids=ids)
        if out is not None and replayed and replayed.replay is not None:
            seen.append((input_ids.shape[0], out.data_ptr() == graphs._out.data_ptr()))
        return out
    graphs.logits = spy
    llm.generate(_PROMPTS, _PARAMS)
    assert graphs.captured_sizes == [2, 4]
    assert graphs._out.shape == (4, llm.llm_engine.runner.model.config.vocab_size)
    assert {b for b, _ in seen} >= {1, 2, 3} and all(same for _, same in seen)

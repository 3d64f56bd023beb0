"""benchmark_expert_offload.py --graphs (benchmarks/offload_graphs.py): each design's steps
replayed from graphs give the eager run's outputs bit for bit and its cache counters, on the CUDA
path rehearsed on CPU with a capturer that keeps a graph's semantics (a capture executes nothing,
a replay runs only what was recorded); what cannot be captured says why and runs eagerly."""
from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_cuda import FakeCuda
from graph_recorder import RecordingCapturer
from rehearsal import RehearsalPlatform
from test_benchmark_expert_offload import _trace

from vllm.model_executor.layers.fused_moe.expert_cache.host_compute import HostCostModel
from vllm.model_executor.layers.fused_moe.expert_cache.trace import interleave, load_trace
from vllm.model_executor.graph_break import break_graph
from vllm.platforms import _PLATFORMS
from vllm.worker.graph_capture import (CudaGraphCapturer, EagerCapturer, capture_error,
                                       no_gc)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchmark_expert_offload as bench  # noqa: E402
import offload_graphs  # noqa: E402
from offload_designs import cached  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")

TOKENS, LAYERS, BATCH = 9, 2, 2
COUNTERS = ("hits", "misses", "bytes_copied", "prefetch", "cpu_pairs", "cpu_expert_calls")


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("graphs") / "trace.npz")
    _trace(path)
    return path


def _run(path: str, designs: list[str], graphs: bool) -> dict:
    argv = ["--trace", path, "--shape", "tiny", "--dtype", "float32", "--capacity", "2",
            "--batch", "1", "3", "--max-tokens", "10", "--designs", *designs]
    return bench.run(bench.parse_args(argv + (["--graphs"] if graphs else [])),
                     keep_outputs=True)


def _by_job(out: dict) -> dict:
    return {(r["design"], r["batch"]): r for r in out["rows"]}


def _rows(path: str, designs: list[str], graphs: bool, device: str = "cpu",
          dtype: torch.dtype = torch.float32) -> dict:
    """design -> row of one cold run (no warm-up runs: the interpreter is slow) of the odd
    sequences' first TOKENS tokens, LAYERS layers, BATCH lanes, capacity 2."""
    trace, fit = bench.prepare_trace(path, "odd", TOKENS, LAYERS)
    setup = bench.Setup(trace, "tiny", dtype, device, BATCH)
    setup.affinity_pred = bench.predict_next(trace, bench.fit_affinity(fit))
    setup.cpu_cost = HostCostModel(1e-3, 3e-4, 1e-4, concurrent=True)   # fixed choices
    return {d: bench.run_design(setup, d, 2 if cached(d) else None, BATCH, "auto",
                                keep_outputs=True, use_graphs=graphs) for d in designs}


def _sizes(path: str) -> list[int]:
    """The active batch sizes of the run's steps: the odd sequences' first TOKENS tokens, lanes
    refilled as sequences end (from the trace file, not from the benchmark)."""
    lens = np.diff(load_trace(path).offsets)[1::2]
    offsets = np.unique(np.minimum(np.concatenate([[0], np.cumsum(lens)]), TOKENS))
    return sorted({int((row >= 0).sum()) for row in interleave(offsets, BATCH)})


@pytest.mark.triton
@pytest.mark.usefixtures("triton_interpreter")
def test_replayed_steps_equal_eager_on_the_rehearsed_cuda_path(trace_path, monkeypatch):
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    designs = ["resident", "ours", "ours+prefetch", "ours+cpu"]
    eager = _rows(trace_path, designs, False)
    capturer = RecordingCapturer()
    monkeypatch.setattr(offload_graphs, "capturer_for", lambda device: capturer)
    got = _rows(trace_path, designs, True)
    assert capturer.replays > 0 and capturer.breaks > 0       # ours+cpu: pieces
    assert len(_sizes(trace_path)) == 2                        # two graphs a design
    for design, row in got.items():
        ref = eager[design]
        assert row["graphs"] and row["graph_refusal"] is None, (design, row["graph_refusal"])
        assert row["graph_sizes"] == _sizes(trace_path), design
        assert len(row["_outputs"]) == len(ref["_outputs"])
        for a, b in zip(row["_outputs"], ref["_outputs"]):
            assert torch.equal(a, b), design
        for k in COUNTERS:
            assert row.get(k) == ref.get(k), (design, k)
    assert got["ours+cpu"]["cpu_pairs"] > 0 and got["ours"]["misses"] > 0
    assert got["ours+prefetch"]["prefetch"]["prefetch_loads"] > 0


@pytest.mark.triton
@pytest.mark.usefixtures("triton_interpreter")
def test_exp12_design_equals_ours_and_counts_its_planes(trace_path, monkeypatch):
    """ours+exp12 (bf16: the experts exp12 holds) gives ours' outputs bit for bit, eagerly and
    replayed, with the same misses; its link bytes are the experts copied x the planes'
    bytes per expert, about three quarters of ours'."""
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    eager = _rows(trace_path, ["ours", "ours+exp12"], False, dtype=torch.bfloat16)
    capturer = RecordingCapturer()
    monkeypatch.setattr(offload_graphs, "capturer_for", lambda device: capturer)
    graphed = _rows(trace_path, ["ours+exp12"], True, dtype=torch.bfloat16)["ours+exp12"]
    ours, packed = eager["ours"], eager["ours+exp12"]
    assert graphed["graphs"] and capturer.replays > 0
    for row in (packed, graphed):
        assert row["status"] == "ok" and row["misses"] == ours["misses"] > 0
        assert all(torch.equal(a, b) for a, b in zip(row["_outputs"], ours["_outputs"],
                                                        strict=True))
        assert row["bytes_copied"] == ours["bytes_copied"] == ours["link_bytes"]
        assert 0.70 < row["link_bytes"] / ours["link_bytes"] < 0.85


@pytest.mark.triton
@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("base", ["ours+prefetch", "ours+cpu"])
def test_exp12_added_to_a_design_changes_only_its_link_bytes(trace_path, monkeypatch, base):
    """ours+prefetch+exp12 and ours+cpu+exp12 (bf16) give their base design's outputs bit for
    bit and its counters (prefetch loads, CPU pairs), eagerly and replayed; only what crosses
    the link shrinks, to the planes' bytes. The CPU's pairs: ``HostExperts`` in both, from the
    bf16 store and from the planes (as on a GPU; on a CPU device the base design would use the
    layer's own backend)."""
    from vllm.model_executor.layers.fused_moe.expert_cache import provider
    from vllm.model_executor.layers.fused_moe.expert_cache.link_codec import Exp12
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    real = provider.host_experts
    monkeypatch.setattr(provider, "host_experts", lambda qm, device, planes=False:
                        real(qm, device, planes=True))
    read = []
    real_init = provider.HostMissCompute.__init__

    def init(self, mode, experts, tensors, cost):
        read.append(type(tensors["w13_weight"]))
        real_init(self, mode, experts, tensors, cost)
    monkeypatch.setattr(provider.HostMissCompute, "__init__", init)
    both = base + "+exp12"
    eager = _rows(trace_path, [base, both], False, dtype=torch.bfloat16)
    capturer = RecordingCapturer()
    monkeypatch.setattr(offload_graphs, "capturer_for", lambda device: capturer)
    graphed = _rows(trace_path, [both], True, dtype=torch.bfloat16)[both]
    ref = eager[base]
    assert graphed["graphs"] and capturer.replays > 0, graphed["graph_refusal"]
    assert ref["bytes_copied"] > 0 and (ref.get("cpu_pairs") or ref["prefetch"]["prefetch_loads"])
    for row in (eager[both], graphed):
        assert row["status"] == "ok"
        assert all(torch.equal(a, b) for a, b in zip(row["_outputs"], ref["_outputs"],
                                                        strict=True))
        for k in COUNTERS:
            assert row.get(k) == ref.get(k), k
        assert 0.70 < row["link_bytes"] / ref["link_bytes"] < 0.85
    if base == "ours+cpu":                   # the base's layers read bf16, the others planes
        assert read[:LAYERS] == [torch.Tensor] * LAYERS and \
            set(read[LAYERS:]) == {Exp12}


def test_design_names_combine_features_in_order():
    from offload_designs import design_name, features
    assert design_name("ours+prefetch+cpu+exp12") == "ours+prefetch+cpu+exp12"
    assert features("ours+cpu+exp12") == {"cpu", "exp12"} and features("uva") == set()
    for bad in ("ours+exp12+cpu", "ours+cpu+cpu", "uva+exp12", "ours+zstd", "theirs"):
        with pytest.raises(ValueError, match="is invalid"):
            design_name(bad)
    with pytest.raises(SystemExit):
        bench.parse_args(["--trace", "t.npz", "--designs", "ours+exp12+cpu"])


def test_sync_lfru_runs_eagerly_and_says_why(trace_path, monkeypatch):
    monkeypatch.setattr(offload_graphs, "capturer_for", lambda device: EagerCapturer())
    row = _by_job(_run(trace_path, ["sync-lfru"], True))[("sync-lfru", 1)]
    assert not row["graphs"] and "sync-lfru" in row["graph_refusal"]


class FailingCapturer(EagerCapturer):
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_goes_on_eagerly_with_the_reason(trace_path, monkeypatch):
    eager = _by_job(_run(trace_path, ["ours"], False))
    monkeypatch.setattr(offload_graphs, "capturer_for", lambda device: FailingCapturer())
    got = _by_job(_run(trace_path, ["ours"], True))
    for job, row in got.items():
        assert not row["graphs"] and row["graph_sizes"] == []
        assert "capturing batch" in row["graph_refusal"] and "not permitted" in \
            row["graph_refusal"]
        assert all(torch.equal(a, b) for a, b in zip(row["_outputs"], eager[job]["_outputs"]))
        assert row["misses"] == eager[job]["misses"]


def test_without_a_capturer_every_design_runs_eagerly_and_says_why(trace_path):
    got = _run(trace_path, ["resident", "ours"], True)
    for row in got["rows"]:
        assert not row["graphs"] and "no graphs on cpu" in row["graph_refusal"]
    assert got["graphs_asked"] is True


def test_the_tests_byte_counter_refuses_graphs(trace_path, monkeypatch):
    monkeypatch.setattr(offload_graphs, "capturer_for", lambda device: EagerCapturer())
    args = bench.parse_args(["--trace", trace_path, "--shape", "tiny", "--dtype", "float32",
                             "--capacity", "2", "--batch", "1", "--max-tokens", "8",
                             "--designs", "ours", "--graphs"])
    row = bench.run(args, count=True)["rows"][0]
    assert not row["graphs"] and "count_copies" in row["graph_refusal"]


@pytest.mark.gpu
def test_replayed_cuda_graphs_equal_eager(trace_path):
    """The real capture: every design but sync-lfru replays CUDA graphs (ours+overlap's side
    stream and ours+cpu's pieces included) and gives the eager run's outputs and counters."""
    designs = ["resident", "uva", "ours", "ours+overlap", "ours+prefetch", "ours+cpu"]
    eager = _rows(trace_path, designs, False, "cuda")
    got = _rows(trace_path, designs, True, "cuda")
    for design, row in got.items():
        ref = eager[design]
        assert row["graphs"] and row["graph_refusal"] is None, (design, row["graph_refusal"])
        assert row["graph_sizes"] == _sizes(trace_path), design
        for a, b in zip(row["_outputs"], ref["_outputs"], strict=True):
            assert torch.equal(a, b), design
        for k in COUNTERS:
            assert row.get(k) == ref.get(k), (design, k)


@pytest.mark.gpu
def test_exp12_on_cuda_equals_ours_eager_and_replayed(trace_path):
    """The pinned planes decoded by the compiled kernel: ours' outputs bit for bit."""
    eager = _rows(trace_path, ["ours", "ours+exp12"], False, "cuda", torch.bfloat16)
    graphed = _rows(trace_path, ["ours+exp12"], True, "cuda", torch.bfloat16)["ours+exp12"]
    ours = eager["ours"]
    for row in (eager["ours+exp12"], graphed):
        assert row["status"] == "ok" and row["misses"] == ours["misses"] > 0
        for a, b in zip(row["_outputs"], ours["_outputs"], strict=True):
            assert torch.equal(a, b)
    assert graphed["graphs"], graphed["graph_refusal"]


@pytest.mark.gpu
@pytest.mark.parametrize("base", ["ours+prefetch", "ours+cpu"])
def test_exp12_added_on_cuda_changes_only_the_link_bytes(trace_path, base):
    both = base + "+exp12"
    eager = _rows(trace_path, [base, both], False, "cuda", torch.bfloat16)
    graphed = _rows(trace_path, [both], True, "cuda", torch.bfloat16)[both]
    assert graphed["graphs"], graphed["graph_refusal"]
    for row in (eager[both], graphed):
        for a, b in zip(row["_outputs"], eager[base]["_outputs"], strict=True):
            assert torch.equal(a, b)
        for k in COUNTERS:
            assert row.get(k) == eager[base].get(k), k
        assert row["link_bytes"] < eager[base]["link_bytes"]


@pytest.mark.triton
@pytest.mark.usefixtures("triton_interpreter")
def test_the_header_times_the_exp12_copy(trace_path, monkeypatch):
    """With ours+exp12 asked for, the header has the exp12 copy's speed in slot bytes and in
    the planes' bytes (their ratio the row's exp12_ratio)."""
    monkeypatch.setitem(_PLATFORMS, "cpu", RehearsalPlatform())
    argv = ["--trace", trace_path, "--shape", "tiny", "--dtype", "bfloat16", "--capacity", "2",
            "--batch", "1", "--max-tokens", "4", "--designs", "ours+exp12"]
    out = bench.run(bench.parse_args(argv))
    row = out["rows"][0]
    assert out["exp12_copy_gbps"] > 0
    assert out["exp12_link_gbps"] == pytest.approx(out["exp12_copy_gbps"] * row["exp12_ratio"])


def _stores_made(monkeypatch) -> list:
    """Weak references to the store tensors of each ``bench.Setup`` made from now on."""
    made, real = [], bench.Setup.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.extend(weakref.ref(t) for t in self.store.tensors.values())
    monkeypatch.setattr(bench.Setup, "__init__", init)
    return made


@pytest.mark.parametrize("design,count", [("ours+cpu", False), ("ours", True),
                                          ("sync-lfru", True)])
def test_a_run_frees_its_store_when_it_returns(trace_path, monkeypatch, design, count):
    """With the collector off, a run's store goes with its last reference: no reference cycle
    (the wrappers of ``model_wait_seconds`` and ``count_copies`` were ones) leaves it to a
    later collection, which could fall inside a later run's capture (on CUDA the store is
    pinned: freeing it there invalidated the capture, on an H100)."""
    made = _stores_made(monkeypatch)
    with no_gc():
        trace, _ = bench.prepare_trace(trace_path, "odd", TOKENS, LAYERS)
        setup = bench.Setup(trace, "tiny", torch.float32, "cpu", BATCH)
        setup.cpu_cost = HostCostModel(1e-3, 3e-4, 1e-4, concurrent=True)
        row = bench.run_design(setup, design, 2, BATCH, "auto", count=count)
        del setup
        assert made and not any(r() is not None for r in made), design
    assert row["status"] == "ok" and (row.get("cpu_pairs") or row["bytes_copied_counted"])


class _Out:
    def record_stream(self, stream) -> None:
        pass


def test_no_garbage_collection_runs_inside_a_capture():
    """Cyclic garbage whose finalizer would free pinned memory is not collected while a graph
    (or a piece of one) is captured, however much the captured function allocates; it is
    after. The collector's state is restored, also when the capture raises."""
    cuda, events = FakeCuda(), []
    capturer = CudaGraphCapturer(torch.device("cuda", 0), cuda=cuda)
    capturing = [False]

    class Node:
        pass

    def garbage() -> None:               # a pinned store in a cycle, its free recorded
        a, b = Node(), Node()
        a.other, b.other = b, a
        weakref.finalize(b, lambda: events.append(("freed", capturing[0])))

    def fn(fail: bool):
        def run():
            capturing[0] = True
            events.append(("gc on", gc.isenabled()))
            junk = [[i] for i in range(20000)]        # many collections' worth, were it on
            break_graph(lambda: None, None)
            del junk
            capturing[0] = False
            if fail:
                raise RuntimeError("a launch failed")
            return _Out()
        return run
    assert gc.isenabled()
    garbage()
    capturer.capture(fn(False))
    garbage()
    with pytest.raises(RuntimeError, match="a launch failed"):
        capturer.capture(fn(True))
    assert gc.isenabled()
    gc.collect()
    assert events.count(("gc on", False)) == 2 and ("gc on", True) not in events
    assert events.count(("freed", False)) == 2 and ("freed", True) not in events


def test_a_capture_error_names_its_chain_where_it_was_raised_and_what_invalidates():
    """The H100's failure: the Triton launch noticed the invalidated capture, then capture_end
    raised too. The refusal has both errors, the launch's place, and what to look for."""
    invalidated = "CUDA error: operation failed due to a previous error during capture"

    def launch():
        raise RuntimeError("Triton Error [CUDA]: " + invalidated[12:])

    try:
        try:
            launch()
        finally:
            raise RuntimeError(invalidated)
    except RuntimeError as err:
        text = capture_error(err)
    assert text.startswith("RuntimeError: " + invalidated)
    assert "(root cause: RuntimeError: Triton Error [CUDA]: operation failed" in text
    assert f"[raised at {__file__}:" in text and " in launch]" in text
    assert "cudaFreeHost" in text and "garbage collector" in text
    assert "cudaFreeHost" not in capture_error(ValueError("no"))


def test_each_batch_size_is_warmed_up_as_captured_just_before_its_capture(trace_path,
                                                                          monkeypatch):
    """Every captured shape ran first where it is captured (kernels compiled and loaded, each
    stream's workspaces made), with the same static buffers."""
    log = []

    class Logging(EagerCapturer):
        def warm_up(self, fn):
            log.append("warm_up")
            return fn()

        def capture(self, fn):
            log.append("capture")
            return fn

    real = offload_graphs.StepGraphs.step

    def step(self, ids, pred, h):
        log.append(("step", ids.shape[0], ids.shape[0] in self.replays))
        return real(self, ids, pred, h)
    monkeypatch.setattr(offload_graphs.StepGraphs, "step", step)
    monkeypatch.setattr(offload_graphs, "capturer_for", lambda device: Logging())
    row = _rows(trace_path, ["ours"], True)["ours"]
    firsts = [i for i, e in enumerate(log) if isinstance(e, tuple) and not e[2]]
    assert len(firsts) == len(row["graph_sizes"]) == len(_sizes(trace_path))
    for i in firsts:
        assert log[i + 1:i + 3] == ["warm_up", "capture"]
    assert log.count("capture") == len(firsts)

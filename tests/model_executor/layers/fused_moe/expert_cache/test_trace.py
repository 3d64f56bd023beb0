"""Routing-trace format, recorder (fed by a real FusedMoE forward) and step interleaving."""
import json

import numpy as np
import pytest
import torch

from vllm.model_executor.layers.fused_moe.expert_cache.trace import (
    RoutingTrace, RoutingTraceRecorder, interleave, load_trace, save_trace, step_masks)
from vllm.model_executor.layers.fused_moe.layer import FusedMoE


def test_save_load_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 300, size=(7, 2, 3))
    trace = RoutingTrace(experts, np.array([0, 4, 7]), {"num_experts": 300, "model": "m"})
    save_trace(str(tmp_path / "t.npz"), trace)
    raw = np.load(tmp_path / "t.npz")
    assert raw["experts"].dtype == np.uint16 and raw["offsets"].dtype == np.int64
    back = load_trace(str(tmp_path / "t.npz"))
    assert np.array_equal(back.experts, experts) and back.offsets.tolist() == [0, 4, 7]
    assert back.meta["model"] == "m" and back.meta["num_layers"] == 2 and back.meta["top_k"] == 3


def test_bad_offsets_rejected():
    with pytest.raises(ValueError, match="offsets"):
        RoutingTrace(np.zeros((5, 1, 2), dtype=np.uint8), np.array([0, 3]))


def test_recorder_with_fused_moe_layers(tmp_path):
    torch.manual_seed(0)
    layers = [FusedMoE(8, 2, 16, 8, prefix=f"model.layers.{i}.mlp.experts") for i in (3, 1)]
    for layer in layers:
        layer.finish_loading(torch.device("cpu"))
    rec = RoutingTraceRecorder(num_experts=8, top_k=2, model="tiny")
    for layer in layers:
        layer.routing_observer = rec.observe
    expected = {}   # sequence key -> list of [L, K] rows, built from the router directly
    steps = [(["a", "a", "b"]), (["b", "a"]), (["c"])]
    for keys in steps:
        x = torch.randn(len(keys), 16)
        logits = [torch.randn(len(keys), 8) for _ in layers]
        for layer, lg in zip(layers, logits):
            layer(x, lg)
        rec.end_step(keys)
        # layers in model order: layer index 1 (second object) before 3.
        ids = torch.stack([torch.topk(logits[1], 2).indices, torch.topk(logits[0], 2).indices], 1)
        for i, k in enumerate(keys):
            expected.setdefault(k, []).append(ids[i])
    trace = rec.save(str(tmp_path / "r.npz"))
    back = load_trace(str(tmp_path / "r.npz"))
    want = np.concatenate([torch.stack(expected[k]).numpy() for k in ("a", "b", "c")])
    # top-k order within a token is not part of the contract: compare as sets.
    assert np.array_equal(np.sort(back.experts, -1), np.sort(want, -1))
    assert back.offsets.tolist() == [0, 3, 5, 6]
    assert back.experts.dtype == np.uint8 and back.meta["num_layers"] == 2
    assert trace.meta["model"] == "tiny"


def test_recorder_unkeyed_sequences_and_errors():
    rec = RoutingTraceRecorder(num_experts=4, top_k=1)
    for n_tok in (2, 1):
        rec.start_sequence()
        rec.observe(0, torch.zeros(n_tok, 1, dtype=torch.long))
        rec.end_step()
    assert rec.to_trace().offsets.tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="observed twice"):
        rec.observe(0, torch.zeros(1, 1, dtype=torch.long))
        rec.observe(0, torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"topk_ids must be \[T, 1\]"):
        rec.observe(1, torch.zeros(1, 2, dtype=torch.long))


def test_interleave_continuous_batching():
    # seq0 = tokens 0-2, seq1 = token 3, seq2 = tokens 4-5; 2 lanes: lane1 picks seq2 after seq1.
    assert interleave(np.array([0, 3, 4, 6]), 2).tolist() == [[0, 3], [1, 4], [2, 5]]
    assert interleave(np.array([0, 1, 4]), 2).tolist() == [[0, 1], [-1, 2], [-1, 3]]
    assert interleave(np.array([0, 2]), 1).tolist() == [[0], [1]]


def test_step_masks_union():
    experts = np.array([[[0, 1]], [[1, 2]], [[3, 0]]])            # [T=3, L=1, K=2]
    trace = RoutingTrace(experts, np.array([0, 2, 3]), {"num_experts": 4})
    masks = step_masks(trace, 2)                                   # steps: {0, 2}, {1}
    assert masks[:, 0].tolist() == [[True, True, False, True], [False, True, True, False]]
    assert json.loads(json.dumps(trace.meta))["num_experts"] == 4


def test_recorder_scores_are_the_routers_softmax(tmp_path):
    """record_scores: the trace's optional scores [T, L, E] float16 are each router's softmax,
    in the same token order as the ids; subset and truncated carry them; no scores -> None."""
    torch.manual_seed(0)
    layers = [FusedMoE(8, 2, 16, 8, prefix=f"model.layers.{i}.mlp.experts") for i in (0, 1)]
    for layer in layers:
        layer.finish_loading(torch.device("cpu"))
    rec = RoutingTraceRecorder(num_experts=8, top_k=2, record_scores=True)
    for layer in layers:
        layer.routing_observer = rec.observe
    want = {}
    for keys in (["a", "b"], ["b", "a"], ["a"]):
        logits = [torch.randn(len(keys), 8) for _ in layers]
        for layer, lg in zip(layers, logits):
            layer(torch.randn(len(keys), 16), lg)
        rec.end_step(keys)
        probs = torch.stack([lg.softmax(-1) for lg in logits], 1).half()       # [T, L, E]
        for i, k in enumerate(keys):
            want.setdefault(k, []).append(probs[i])
    rec.save(str(tmp_path / "s.npz"))
    back = load_trace(str(tmp_path / "s.npz"))
    expected = np.concatenate([torch.stack(want[k]).numpy() for k in ("a", "b")])
    assert back.scores.dtype == np.float16 and np.array_equal(back.scores, expected)
    top = np.sort(np.argsort(-back.scores.astype(np.float32), -1)[..., :2], -1)
    assert np.array_equal(np.sort(back.experts, -1), top)
    assert np.array_equal(back.subset([1]).scores, expected[3:])
    assert np.array_equal(back.truncated(2).scores, expected[:2])
    with pytest.raises(ValueError, match="scores must be"):
        RoutingTrace(back.experts, back.offsets, back.meta, back.scores[:, :1])
    plain = RoutingTraceRecorder(num_experts=8, top_k=2)
    plain.observe(0, torch.zeros(1, 2, dtype=torch.long))
    plain.save(str(tmp_path / "p.npz"))
    assert load_trace(str(tmp_path / "p.npz")).scores is None

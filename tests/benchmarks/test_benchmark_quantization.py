"""benchmarks/benchmark_quantization.py --speed's ``--out``: rewritten after every load and timed
call with "partial": true, so a run cut short keeps what it measured. Engines are stand-ins (no
checkpoint is built): the end-to-end rows are tested in tests/kernels/cpu/test_benchmarks.py."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchmark_quantization as bench  # noqa: E402


class Cut(Exception):
    pass


@pytest.fixture
def fake(monkeypatch):
    """Stand-in engines; ``state["limit"]``: decode calls before one raises Cut (a timeout)."""
    state = {"decodes": 0, "limit": None, "writes": [], "loads": []}
    # A backend that ran W8A8 on the runner's device (TritonExperts.quantizes_inputs).
    kernel = SimpleNamespace(quantizes_inputs=lambda device: device == "dev0")
    layer = SimpleNamespace(quant_method=SimpleNamespace(backend_name="fake", kernel=kernel))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(runner=SimpleNamespace(
        moe_layers=[layer], device="dev0")))

    def decode_rate(llm, b, tokens):
        if state["decodes"] == state["limit"]:
            raise Cut
        state["decodes"] += 1
        return float(state["decodes"])
    real_write = bench.write_json
    monkeypatch.setattr(bench, "speed_checkpoint", lambda scheme, work, shape: scheme)
    monkeypatch.setattr(bench, "load_engine",
                        lambda *a: (state["loads"].append(a), (llm, 0.5))[1])
    monkeypatch.setattr(bench, "layer_expert_bytes", lambda layer: 100)
    monkeypatch.setattr(bench, "decode_rate", decode_rate)
    monkeypatch.setattr(bench, "write_json", lambda p, obj: (
        state["writes"].append(json.loads(json.dumps(obj))), real_write(p, obj)))
    return state


def _argv(tmp_path, out):
    return ["--speed", "--speed-shape", "64", "32", "8", "1", "--speed-reps", "2",
            "--schemes", "fp8-block", "--work", str(tmp_path), "--out", str(out),
            "--threads", str(torch.get_num_threads())]          # leave torch's threads as found


def test_speed_out_is_rewritten_after_every_measurement(fake, tmp_path, capsys):
    out = tmp_path / "q.json"
    bench.main(_argv(tmp_path, out) + ["--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    writes = fake["writes"]
    # 4 loads (bf16, fp8-block x cache 0, 2), then 2 rounds x 4 engines, then the final write.
    assert len(writes) == 4 + 8 + 1
    assert all(w["partial"] is True for w in writes[:-1]) and "partial" not in writes[-1]
    assert [len(w["rows"]) for w in writes[:4]] == [1, 2, 3, 4]
    assert "tok_s_b1" not in writes[3]["rows"][0]               # loaded, not yet timed
    assert "tok_s_b32" in writes[4]["rows"][0] and "tok_s_b1" not in writes[4]["rows"][1]
    assert json.loads(out.read_text()) == printed == writes[-1]
    assert [(r["scheme"], r["cache"]) for r in printed["rows"]] == [
        (s, n) for s in ("bf16", "fp8-block") for n in (0, 2)]
    # decode calls 1..16: round 1 gives row i (b1, b32) = (2i+1, 2i+2), round 2 adds 8 to each;
    # the median of two is the larger
    assert [(r["tok_s_b1"], r["tok_s_b32"]) for r in printed["rows"]] == [
        (2 * i + 9.0, 2 * i + 10.0) for i in range(4)]


def test_speed_cut_short_keeps_what_it_measured(fake, tmp_path):
    out = tmp_path / "q.json"
    fake["limit"] = 5                          # round 1: engines 0, 1 timed, engine 2 half
    with pytest.raises(Cut):
        bench.main(_argv(tmp_path, out))
    kept = json.loads(out.read_text())
    assert kept["partial"] is True and len(kept["rows"]) == 4
    assert [("tok_s_b1" in r, "tok_s_b32" in r) for r in kept["rows"]] == [
        (True, True), (True, True), (False, False), (False, False)]
    assert not (tmp_path / "q.json.tmp").exists()


def test_fp8_weight_only_rows(fake, tmp_path, capsys):
    """``--fp8-weight-only-too``: each fp8 scheme loads again with weight_only (its rows after
    the others); every row says which activations its backend ran (``inputs``)."""
    bench.main(_argv(tmp_path, tmp_path / "q.json") + ["--json", "--fp8-weight-only-too"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(a[0], a[1], a[4]) for a in fake["loads"]] == [
        ("bf16", 0, False), ("bf16", 2, False), ("fp8-block", 0, False),
        ("fp8-block", 2, False), ("fp8-block", 0, True), ("fp8-block", 2, True)]
    assert [r["scheme"] for r in printed["rows"]] == ["bf16"] * 2 + ["fp8-block"] * 4
    assert all(r["inputs"] == "fp8" for r in printed["rows"])

"""benchmarks/benchmark_throughput.py runs end to end (tiny settings), and transformers runs in
the dtype the engine resolved (``--dtype auto`` means the checkpoint's dtype on both sides)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks",
                     "benchmark_throughput.py")


def _bench():
    spec = importlib.util.spec_from_file_location("benchmark_throughput", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("saved,flag,want", [(torch.bfloat16, "auto", torch.bfloat16),
                                             (torch.bfloat16, "float32", torch.float32)])
def test_both_sides_run_in_the_engines_dtype(tmp_path, monkeypatch, capsys, saved, flag, want):
    import transformers
    from tiny_models import build_tiny_model
    path = tmp_path / "tiny"
    build_tiny_model("Qwen3MoeForCausalLM", path, dtype=saved)
    seen = []
    orig = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        model = orig(*args, **kwargs)
        seen.append(next(model.parameters()).dtype)
        return model
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    result = _bench().main(["--model", str(path), "--num-prompts", "3", "--input-len", "5",
                            "--output-len", "4", "--random-range-ratio", "0.5", "--repeat", "1",
                            "--hf-baseline", "--dtype", flag, "--json"])
    assert result["dtype"] == str(want).removeprefix("torch.") and seen == [want]
    assert json.loads(capsys.readouterr().out) == result
    eng, hf = result["engine"], result["hf"]
    for side in (eng, hf):
        assert len(side["all_seconds"]) == 1 and side["seconds"] == side["all_seconds"][0] > 0
        assert side["requests_per_s"] == pytest.approx(3 / side["seconds"])
    # Both sides generate the same tokens: 3 requests of 4 +- 50% output tokens each.
    n_eng = eng["output_tokens_per_s"] * eng["seconds"]
    n_hf = hf["output_tokens_per_s"] * hf["seconds"]
    assert n_eng == pytest.approx(round(n_eng)) and n_hf == pytest.approx(n_eng)
    assert 3 * 2 <= round(n_eng) <= 3 * 6
    assert result["speedup_vs_hf"] == pytest.approx(eng["output_tokens_per_s"]
                                                    / hf["output_tokens_per_s"])


def test_cache_sweep_compares_sizes_in_one_run(tmp_path, capsys):
    """--cache-sweep 0 2 5: one engine per size, each with its own figures; the ratio is to the
    uncached engine's median, and the cached rows count their timed passes' misses and copies
    (6 experts in the tiny model: 2 slots miss, 5 slots nearly never after warm-up)."""
    from tiny_models import build_tiny_model
    path = tmp_path / "tiny"
    build_tiny_model("Qwen3MoeForCausalLM", path)
    result = _bench().main(["--model", str(path), "--num-prompts", "4", "--input-len", "6",
                            "--output-len", "5", "--repeat", "2", "--device", "cpu",
                            "--cache-sweep", "0", "2", "5", "--json"])
    assert json.loads(capsys.readouterr().out) == result
    rows = result["cache_sweep"]
    assert [r["moe_expert_cache_size"] for r in rows] == [0, 2, 5]
    for r in rows:
        assert len(r["all_seconds"]) == 2 and r["seconds"] in r["all_seconds"]
        assert r["output_tokens_per_s"] == pytest.approx(4 * 5 / r["seconds"])
        assert r["relative_to_uncached"] == pytest.approx(rows[0]["seconds"] / r["seconds"])
    assert "hit_rate" not in rows[0]
    small, large = rows[1], rows[2]
    assert 0 <= small["hit_rate"] < large["hit_rate"] <= 1 and small["misses_per_pass"] > 0
    per_expert = small["bytes_copied_per_pass"] / small["misses_per_pass"]
    assert per_expert > 0 and small["copy_seconds_per_pass"] > 0

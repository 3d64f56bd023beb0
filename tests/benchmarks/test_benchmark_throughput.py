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

"""benchmarks/benchmark_link_codec.py: exp12's savings on a checkpoint's experts, grouped as the
cache stores them; counts checked against the files themselves."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchmark_link_codec as bench  # noqa: E402


def test_the_default_model_saves_a_quarter(capsys):
    out = bench.main(["--json", "--per-group"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
    with safe_open(str(bench.DEFAULT_MODEL / "model.safetensors"), "pt") as st:
        expert_names = [n for n in st.keys() if ".experts." in n]
        weights = sum(st.get_tensor(n).numel() for n in expert_names)
    assert out["weights"] == weights and out["refused"] == {}
    assert sum(g["experts"] for g in out["groups"]) == len(expert_names)
    assert 12.0 < out["bits_per_weight"] < 12.2 and out["ratio_to_bf16"] < 0.76
    assert all(g["group"].count(".*.") == 1 for g in out["groups"])


def test_stacked_experts_and_what_exp12_refuses(tmp_path):
    g = torch.Generator().manual_seed(0)
    save_file({"model.layers.0.mlp.experts.gate_up_proj":
               torch.randn(4, 64, 32, generator=g).to(torch.bfloat16),
               "model.layers.0.mlp.experts.down_proj": torch.randn(4, 32, 32, generator=g),
               "model.layers.0.mlp.gate.weight": torch.randn(4, 32, generator=g)},
              str(tmp_path / "model.safetensors"))
    out = bench.main(["--model", str(tmp_path), "--json", "--per-group"])
    assert [x["group"] for x in out["groups"]] == ["model.layers.0.mlp.experts.gate_up_proj"]
    assert out["weights"] == 4 * 64 * 32
    assert "bfloat16" in out["refused"]["model.layers.0.mlp.experts.down_proj"]


def test_a_folder_without_checkpoints_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        bench.main(["--model", str(tmp_path)])

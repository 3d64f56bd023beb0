"""tools/tune_fused_moe.py on CPU under Triton's interpreter (its times mean nothing there; the
logic is what is tested): one result per token count, candidates whose output differs from the
default configuration's are dropped, and the written table is one the engine loads, keyed by the
intermediate size, with the command that made it."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")
pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("triton_interpreter")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGV = ["--hidden", "32", "--intermediate", "16", "--experts", "4", "--top-k", "2", "--dtype",
        "fp32", "--tokens", "3", "1", "--search", "test", "--iters", "1", "--device", "cpu"]


@pytest.fixture
def tune():
    spec = importlib.util.spec_from_file_location(
        "tune_fused_moe", os.path.join(ROOT, "tools", "tune_fused_moe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_writes_a_table_the_engine_loads(tune, tmp_path, monkeypatch, capsys):
    from vllm.kernels.triton import fused_moe_config as fc
    path = tmp_path / "Dev_X.json"
    kept = {"default": [{"max_m": None, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
                         "GROUP_M": 1, "num_warps": 4, "num_stages": 2}]}
    kept["N=999"] = kept["default"]
    path.write_text(json.dumps(kept))                  # an existing table: its keys stay
    out = tune.main(ARGV + ["--out", str(path)])
    assert json.loads(capsys.readouterr().out) == out
    assert [r["tokens"] for r in out["results"]] == [3, 1]
    assert all(len(r["tried"]) == 2 and r["best"] in tune.candidates("test")
               for r in out["results"])
    table = json.loads(path.read_text())
    assert [e["max_m"] for e in table["N=16"]] == [1, None]
    assert table["default"] == table["N=999"] == kept["default"]
    assert "python tools/tune_fused_moe.py --hidden 32" in table["_tuned_N=16"]
    monkeypatch.setattr(fc, "CONFIG_DIR", str(tmp_path))
    fc.load_table.cache_clear()
    try:
        best_1 = next(r["best"] for r in out["results"] if r["tokens"] == 1)
        assert fc.get_moe_config(16, 1, "Dev X") == best_1
        assert fc.get_moe_config(32, 1, "Dev X") == fc.load_table("Dev X")[1]["default"][0][1]
    finally:
        fc.load_table.cache_clear()


def test_a_candidate_with_another_output_is_dropped(tune, monkeypatch, capsys):
    """A configuration whose output is not the default's (here: made so by a stand-in) is never
    chosen, whatever its time."""
    from vllm.kernels.triton import fused_moe as fm
    real = fm.fused_moe

    def skewed(*args, config=None, **kwargs):
        out = real(*args, config=config, **kwargs)
        return out + 1.0 if config is not None and config["BLOCK_M"] == 16 else out
    monkeypatch.setattr(fm, "fused_moe", skewed)
    out = tune.main(ARGV)
    for r in out["results"]:
        assert r["best"]["BLOCK_M"] == 32
        assert [t["status"].split(":")[0] for t in r["tried"]] == ["wrong", "ok"]


def test_bad_arguments_name_the_value(tune, capsys):
    with pytest.raises(SystemExit):
        tune.parse_args(ARGV[:6] + ["--top-k", "9"])
    assert "--top-k 9 is invalid: must be in [1, --experts 4]" in capsys.readouterr().err

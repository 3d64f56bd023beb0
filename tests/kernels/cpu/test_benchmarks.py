"""The kernel benchmarks run end to end (tiny settings) and report what they claim to."""
from __future__ import annotations

import importlib.util
import os

import pytest

_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_benchmark_cpu_kernels_rows(capsys, dtype):
    rows = _load("benchmark_cpu_kernels").main(["--iters", "3", "--dtype", dtype])
    assert len(rows) == 8 and len({name for name, _, _ in rows}) == 8
    assert all(t > 0 and c > 0 for _, t, c in rows)
    out = capsys.readouterr().out
    assert f"dtype={dtype}, medians of 3 calls" in out
    for name, t, c in rows:            # the table prints each row's own times and their ratio
        [line] = [ln for ln in out.splitlines() if ln.startswith(name)]
        torch_ms, c_ms, speedup = line[len(name):].split()
        assert (float(torch_ms), float(c_ms)) == (round(t, 3), round(c, 3))
        assert speedup == f"{t / c:.1f}x"


def test_profile_decode_step_splits_the_step(capsys):
    result = _load("profile_decode_step").main(["--batch", "2", "--steps", "3",
                                                "--enforce-eager"])
    kernels = result["kernels_ms"]
    assert {"dense_linear", "moe_expert_pairs", "paged_attention"} <= set(kernels)
    assert "run_graph" not in kernels
    assert 0 < sum(kernels.values()) < result["step_ms"]
    assert "C kernels" in capsys.readouterr().out
    # By default the decode steps replay a graph: the forward's kernels are one call.
    kernels = _load("profile_decode_step").main(["--batch", "2", "--steps", "3"])["kernels_ms"]
    assert "run_graph" in kernels and "paged_attention" not in kernels
    from vllm.kernels.cpu.build import load_cpu_kernels
    lib = load_cpu_kernels()
    assert type(lib.dense_linear).__name__ != "_Timed"     # the shared library is left as found


def test_profile_decode_step_needs_the_kernels(torch_paths):
    with pytest.raises(SystemExit):
        _load("profile_decode_step").main(["--steps", "1"])


def test_benchmark_quantization_speed_rows(capsys):
    """--speed on a tiny shape: a row per scheme and cache size, quantized rows on the C kernel."""
    _load("benchmark_quantization").main(
        ["--speed", "--speed-shape", "64", "32", "8", "1", "--speed-tokens", "2",
         "--speed-reps", "1", "--schemes", "fp8-block", "w4a16-gptq", "--json"])
    import json
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = result["rows"]
    assert [(r["scheme"], r["cache"]) for r in rows] == [
        (s, n) for s in ("bf16", "fp8-block", "w4a16-gptq") for n in (0, 2)]
    assert all(r["backend"] == "cpu_kernel" and r["tok_s_b1"] > 0 and r["tok_s_b32"] > 0
               for r in rows)
    bf16, gptq = rows[0]["bytes_per_expert"], rows[-1]["bytes_per_expert"]
    assert gptq < bf16 / 2


def test_benchmark_quantization_backend_per_scheme(capsys):
    """--moe-backend SCHEME=NAME sets that scheme's backend only (how a GPU run times
    cutlass_w4a16 beside bf16 on auto); a bare name beside pairs is refused."""
    bench = _load("benchmark_quantization")
    bench.main(["--speed", "--speed-shape", "64", "32", "8", "1", "--speed-tokens", "2",
                "--speed-reps", "1", "--schemes", "w4a16-gptq", "--moe-backend",
                "w4a16-gptq=torch", "--json"])
    import json
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [(r["scheme"], r["backend"]) for r in rows] == [
        ("bf16", "cpu_kernel"), ("bf16", "cpu_kernel"), ("w4a16-gptq", "torch"),
        ("w4a16-gptq", "torch")]
    with pytest.raises(SystemExit, match="give one name, or SCHEME=NAME pairs"):
        bench.backend_for(["torch", "w4a16-gptq=triton"], "bf16")


def test_benchmark_quantization_reuses_its_work_dir_and_measures_the_loaded_layout(
        capsys, tmp_path, monkeypatch):
    """--work: a second run reuses the checkpoints (no quantization); bytes per expert are the
    loaded engine's, so the torch backend's GPTQ layout (int32 words, f16 scales) differs from
    the C kernel's packed one, and a row with the cache equals the one without."""
    import json
    bench = _load("benchmark_quantization")
    argv = ["--speed", "--speed-shape", "64", "32", "8", "1", "--speed-tokens", "2",
            "--speed-reps", "1", "--schemes", "w4a16-gptq", "--json", "--work", str(tmp_path)]
    bench.main(argv)
    packed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    calls = []
    monkeypatch.setattr(bench, "quantize_main", lambda a: calls.append(a))
    bench.main(argv + ["--moe-backend", "w4a16-gptq=torch"])
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert calls == [] and (tmp_path / "64x32x8x1" / "w4a16-gptq" / ".done").exists()
    per = {(r["scheme"], r["backend"], r["cache"]): r["bytes_per_expert"]
           for r in packed + plain}
    for scheme, backend in (("bf16", "cpu_kernel"), ("w4a16-gptq", "cpu_kernel"),
                            ("w4a16-gptq", "torch")):
        assert per[scheme, backend, 0] == per[scheme, backend, 2]
    assert per["w4a16-gptq", "torch", 0] != per["w4a16-gptq", "cpu_kernel", 0]


def test_benchmark_quant_layer_cpu_rows(capsys):
    """A row per scheme, dtype and token count, as printed; act order and FP8 both run."""
    import json
    _load("benchmark_quant_layer_cpu").main(
        ["--schemes", "fp8-block", "gptq-g32-sym-descact", "--experts", "4", "--top-k", "2",
         "--hidden", "128", "--inter", "64", "--tokens", "1", "3", "--reps", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert [(r["scheme"], r["dtype"], r["tokens"]) for r in result["rows"]] == [
        (s, d, t) for s in ("fp8-block", "gptq-g32-sym-descact")
        for d in ("float32", "bfloat16") for t in (1, 3)]
    assert all(r["best_us"] > 0 for r in result["rows"])
    with pytest.raises(SystemExit, match="unknown scheme 'gptq-x'"):
        _load("benchmark_quant_layer_cpu").main(["--schemes", "gptq-x"])

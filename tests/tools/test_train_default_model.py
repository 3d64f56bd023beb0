"""The default model's training tools: a resumed run gives the same weights as an uninterrupted
one, the package corpus keeps only permissive, non-test, non-held-out sources, and the quality
metrics of eval_default_model.py."""
from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import default_model_corpus as corpus  # noqa: E402
import eval_default_model as edm  # noqa: E402

SMOKE = ["--max-files", "12", "--batch-size", "2", "--seq-len", "32", "--threads", "1",
         "--heldout-tokens", "256"]


def _train(*args: str) -> None:
    proc = subprocess.run([sys.executable, str(TOOLS / "train_default_model.py"), *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_resumed_training_equals_an_uninterrupted_run(tmp_path):
    _train("--steps", "3", "--out", str(tmp_path / "a"), "--checkpoint", str(tmp_path / "a.pt"),
           *SMOKE)
    _train("--steps", "2", "--out", str(tmp_path / "b"), "--checkpoint", str(tmp_path / "b.pt"),
           *SMOKE)
    _train("--steps", "3", "--resume", str(tmp_path / "b.pt"), "--out", str(tmp_path / "b"),
           "--checkpoint", str(tmp_path / "b.pt"), "--threads", "1", "--heldout-tokens", "256")
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
    import json
    meta = json.loads((tmp_path / "b" / "training_metadata.json").read_text())
    assert [(r["from_step"], r["to_step"]) for r in meta["runs"]] == [(0, 2), (2, 3)]
    assert all(r["device"] == "cpu" and r["seconds"] > 0 for r in meta["runs"])
    assert 0 < meta["heldout_tokens"] < 256       # of the first 256 held-out tokens


def _fake_dist(root: Path, name: str, licence: str, files: dict[str, str]):
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                                   f"License: {licence}\n")
    (info / "RECORD").write_text("".join(f"{p},,\n" for p in files))
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return md.PathDistribution(info)


def test_package_corpus_keeps_permissive_sources_only(tmp_path, monkeypatch):
    held = "def held_out():\n    return 1\n"
    dists = [
        _fake_dist(tmp_path, "okpkg", "MIT", {"okpkg/__init__.py": "x = 1\n",
                                              "okpkg/tests/test_x.py": "assert 1\n",
                                              "okpkg/copy_of_held.py": held,
                                              "okpkg/data.txt": "not python"}),
        _fake_dist(tmp_path, "gplpkg", "GPL-3.0", {"gplpkg/__init__.py": "y = 2\n"}),
    ]
    monkeypatch.setattr(corpus.md, "distributions", lambda: dists)
    texts, packages = corpus.package_sources([held])
    assert texts == ["x = 1\n"]
    assert packages == [{"name": "okpkg", "version": "1.0", "licence": "MIT", "files": 1,
                         "bytes": 6}]


def test_quality_metrics():
    assert edm.distinct_ratio([1, 1, 2, 3]) == 0.75 and edm.distinct_ratio([]) == 0.0
    assert edm.longest_repeated_line_run("a\nb\nc") == 1
    assert edm.longest_repeated_line_run("#\n#\n\n#\nx\n#") == 3    # blank lines do not break it
    assert edm.longest_repeated_line_run("") == 0


@pytest.mark.parametrize("bad", [["--steps", "0"]])
def test_bad_arguments(bad):
    import train_default_model as tdm
    with pytest.raises(SystemExit):
        tdm.parse_args(bad)

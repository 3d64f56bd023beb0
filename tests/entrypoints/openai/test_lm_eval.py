"""lm-evaluation-harness end to end: a local 30-question multiple-choice task (continuations of
standard-library code) run against a real `vllm serve` (`local-completions`: echo + logprobs
loglikelihood requests) and against transformers (`hf`) in the same test, on the shipped
default model in float32: per-question loglikelihoods equal within tolerance, equal accuracy."""
from __future__ import annotations

import json
import os

import pytest

from openai_server_utils import RemoteServer

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed "
                                                "(pip install -e '.[test]')")

QUESTIONS = [  # (context, right continuation, wrong ones)
    ("import os\npath = os.path.", "join(a, b)", ["banana(a)", "wheel()", "spoon"]),
    ("import sys\nargs = sys.", "argv[1:]", ["carrot", "moon()", "pillow[3]"]),
    ("import json\ndata = json.", "loads(text)", ["jump(x)", "tiger", "boat()"]),
    ("from collections import ", "defaultdict", ["sandwich", "elephant", "rainbow"]),
    ("for i in ", "range(10):", ["apple pie", "the garden", "blue sky"]),
    ("def main():\n    ", "return 0", ["elephant dance", "sunny beach", "purple rain"]),
    ("import re\nm = re.", "match(pattern, s)", ["giraffe()", "lemon", "cloudy"]),
    ("import math\nx = math.", "sqrt(2)", ["pancake(2)", "river", "dragon()"]),
    ("with open(path) as f:\n    ", "data = f.read()", ["dog barks", "hello moon", "kite"]),
    ("import time\nstart = time.", "time()", ["sandwich()", "violin", "forest()"]),
    ("if __name__ == ", '"__main__":', ["banana split", "42 apples", "the ocean"]),
    ("class Stack:\n    def ", "__init__(self):", ["mountain", "pizza party", "zebra"]),
    ("try:\n    x = 1\n", "except Exception:", ["tomato soup", "green field", "kangaroo"]),
    ("import random\nn = random.", "randint(0, 9)", ["octopus()", "piano", "meadow"]),
    ("items = []\nitems.", "append(x)", ["castle(x)", "thunder", "bicycle()"]),
    ("import subprocess\nsubprocess.", "run(cmd)", ["waffle(cmd)", "desert", "pencil"]),
    ("print(", '"hello")', ["carpet ride", "snowflake", "lantern"]),
    ("import logging\nlogger = logging.", "getLogger(__name__)", ["volcano()", "cherry", "owl"]),
    ("return ", "None", ["spaghetti tree", "mountain goat", "sunflower"]),
    ("import itertools\nfor a, b in itertools.", "product(x, y):", ["lobster:", "cactus",
                                                                    "meteor()"]),
    ("x = [i * i for i in ", "range(5)]", ["the zoo]", "ice cream]", "planet]"]),
    ("import argparse\nparser = argparse.", "ArgumentParser()", ["Hamburger()", "canyon",
                                                                 "seagull"]),
    ("import pathlib\np = pathlib.", "Path(name)", ["Walrus(name)", "glacier", "tulip"]),
    ("while True:\n    ", "break", ["penguin walk", "sunset", "avocado"]),
    ("import shutil\nshutil.", "copy(src, dst)", ["giraffe(src)", "harbor", "noodle"]),
    ("d = {}\nd.", "get(key)", ["parrot(key)", "lagoon", "muffin"]),
    ("import datetime\nnow = datetime.datetime.", "now()", ["walrus()", "bamboo", "comet"]),
    ("s = 'abc'\ns.", "upper()", ["hippo()", "valley", "cupcake"]),
    ("import csv\nreader = csv.", "reader(f)", ["badger(f)", "island", "pretzel"]),
    ("raise ", "ValueError(msg)", ["Pineapple(msg)", "the mountain", "dolphin"]),
]


def _write_task(tmp_path) -> str:
    data = tmp_path / "stdlib_mc.jsonl"
    with open(data, "w") as f:
        for ctx, right, wrong in QUESTIONS:
            f.write(json.dumps({"context": ctx, "choices": [right, *wrong], "label": 0}) + "\n")
    (tmp_path / "stdlib_mc.yaml").write_text(f"""task: stdlib_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
""")
    return str(tmp_path)


def _evaluate(model: str, model_args: dict, include_path: str) -> tuple[float, list]:
    from lm_eval.tasks import TaskManager
    res = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["stdlib_mc"],
                                  task_manager=TaskManager(include_path=include_path),
                                  log_samples=True, batch_size=1)
    samples = sorted(res["samples"]["stdlib_mc"], key=lambda s: s["doc_id"])
    lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return res["results"]["stdlib_mc"]["acc,none"], lls


def test_lm_eval_against_server_equals_transformers(tmp_path, monkeypatch):
    import vllm
    if not os.path.isdir(vllm.DEFAULT_MODEL):
        pytest.skip("default model not shipped")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "task").mkdir()
    include = _write_task(tmp_path / "task")
    srv = RemoteServer(vllm.DEFAULT_MODEL, ["--served-model-name", "default", "--dtype",
                                            "float32", "--uvicorn-log-level", "warning"],
                       str(tmp_path / "server.log"))
    try:
        acc_srv, ll_srv = _evaluate("local-completions", {
            "base_url": srv.url + "/v1/completions", "model": "default",
            "tokenizer_backend": "huggingface", "tokenizer": vllm.DEFAULT_MODEL,
            "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1}, include)
    finally:
        srv.stop()
    acc_hf, ll_hf = _evaluate("hf", {"pretrained": vllm.DEFAULT_MODEL, "dtype": "float32",
                                     "device": "cpu"}, include)
    assert len(ll_srv) == len(ll_hf) == len(QUESTIONS)
    for q, (a, b) in enumerate(zip(ll_srv, ll_hf)):
        assert a == pytest.approx(b, abs=2e-3), (q, a, b)
    assert acc_srv == acc_hf
    assert acc_hf > 0.5          # the default model knows some Python

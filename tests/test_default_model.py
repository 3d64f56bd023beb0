"""Transformers-side checks of the shipped default model (vllm/models/default).

Engine-side checks live elsewhere; everything here uses only Hugging Face transformers and plain
torch as the reference, so a broken checkpoint, tokenizer or metadata file fails these tests.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

MODEL_DIR = Path(__file__).resolve().parent.parent / "vllm" / "models" / "default"
REQUIRED_FILES = (
    "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    "generation_config.json", "training_metadata.json",
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The test machine is shared; a single intra-op thread avoids oversubscription stalls.
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((MODEL_DIR / "config.json").read_text())


@pytest.fixture(scope="module")
def metadata() -> dict:
    return json.loads((MODEL_DIR / "training_metadata.json").read_text())


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_files_present_and_small():
    for name in REQUIRED_FILES:
        assert (MODEL_DIR / name).is_file(), f"missing {name} in {MODEL_DIR}"
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir())
    assert total < 25 * 2**20, f"default model directory is {total} bytes, budget is 25 MiB"


def test_checkpoint_has_per_expert_tensor_names(config):
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for layer in range(layers):
            prefix = f"model.layers.{layer}.mlp"
            assert f.get_slice(f"{prefix}.gate.weight").get_shape() == [experts, hidden]
            for e in range(experts):
                for proj, shape in (("gate_proj", [inter, hidden]), ("up_proj", [inter, hidden]),
                                    ("down_proj", [hidden, inter])):
                    name = f"{prefix}.experts.{e}.{proj}.weight"
                    assert name in keys, f"missing {name}"
                    assert f.get_slice(name).get_shape() == shape, name
    fused = [k for k in keys if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert not fused, f"fused expert tensors found: {fused[:3]}"


def test_generate_matches_manual_greedy_loop(model, tokenizer):
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    # Reference: full-sequence forward each step, argmax of the last position (no KV cache).
    ref = ids
    with torch.no_grad():
        for _ in range(8):
            nxt = model(input_ids=ref).logits[0, -1].argmax()
            ref = torch.cat([ref, nxt.view(1, 1)], dim=1)
    assert out.shape == (1, ids.shape[1] + 8)
    assert torch.equal(out, ref)
    assert tokenizer.decode(out[0]).startswith("def fibonacci(n):")


def _nll(model, ids: torch.Tensor, seq_len: int) -> tuple[float, int]:
    """Mean next-token NLL over non-overlapping windows, computed with log_softmax + gather."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, seq_len):
            w = ids[start : start + seq_len]
            if len(w) < 2:
                continue
            logp = torch.log_softmax(model(input_ids=w[None]).logits[0].double(), dim=-1)  # [S, V]
            total -= logp[:-1].gather(1, w[1:, None]).sum().item()
            count += len(w) - 1
    return total / count, count


def test_heldout_slice_loss_matches_record(model, tokenizer, metadata):
    sl = metadata["slice"]
    text = sl["text"]
    assert hashlib.sha256(text.encode()).hexdigest() == sl["sha256"]
    stdlib_file = Path(sysconfig.get_paths()["stdlib"]) / sl["module"]
    if stdlib_file.is_file() and metadata["python"] == sysconfig.get_python_version():
        # Same interpreter line as training: the stored slice must be the slice definition.
        assert stdlib_file.read_text(encoding="utf-8")[: sl["chars"]] == text
    assert sl["module"] in metadata["heldout_modules"]
    ids = torch.tensor(tokenizer(text).input_ids, dtype=torch.long)
    loss, count = _nll(model, ids, metadata["train_args"]["seq_len"])
    assert count == sl["tokens"]
    assert abs(loss - sl["loss"]) <= 0.02 * sl["loss"], f"slice loss {loss:.4f} vs recorded {sl['loss']:.4f}"
    # A trained model beats a uniform guess over the vocabulary by more than 2 nats/token.
    assert loss < math.log(len(tokenizer)) - 2.0


def test_heldout_modules_never_in_training_split(metadata):
    import importlib.util

    script = MODEL_DIR.parent.parent.parent / "tools" / "train_default_model.py"
    spec = importlib.util.spec_from_file_location("train_default_model", script)
    tdm = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tdm  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(tdm)
    finally:
        del sys.modules[spec.name]
    train, held = tdm.split_corpus(tdm.stdlib_root())
    assert held == metadata["heldout_modules"]
    assert set(held).isdisjoint(train) and len(train) > 100
    assert metadata["heldout_tokens"] > 10_000
    assert math.isclose(metadata["heldout_perplexity"], math.exp(metadata["heldout_loss"]), rel_tol=1e-9)


CODE_SAMPLES = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os\n\tx = {'a': [1, 2.5e-3]}  # café ✓ 日本\r\n",
    "   leading spaces and trailing   \n\n\n",
]


@pytest.mark.parametrize("text", CODE_SAMPLES)
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # BPE merges something on real code


def test_special_tokens_and_chat_template(tokenizer):
    for tok in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        ids = tokenizer(tok, add_special_tokens=False).input_ids
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == tok
    assert tokenizer.eos_token == "<|endoftext|>"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered == expected
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert tokenizer.convert_ids_to_tokens(ids[0]) == "<|im_start|>"
    assert tokenizer.decode(ids) == expected

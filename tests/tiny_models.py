"""Tiny random Hugging Face models with a real byte-level BPE tokenizer, for engine tests."""
from __future__ import annotations

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model_executor.tiny_checkpoints import TINY

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_TEXT = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
         "import os\nimport sys\nclass Stack:\n    def __init__(self):\n        self.items = []",
         "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語",
         "for i in range(10):\n    print(i, i * i)\n"]
VOCAB = 320


def make_tokenizer(path) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=[
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_TEXT * 4, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def build_tiny_model(arch: str, path, seed: int = 0, dtype=torch.float32, **overrides):
    """Save a random tiny ``arch`` model + tokenizer to ``path``; return the fp32 HF model."""
    make_tokenizer(path)
    torch.manual_seed(seed)
    config = TINY[arch](**{"vocab_size": VOCAB, "eos_token_id": 0, "bos_token_id": 0,
                           "pad_token_id": 0, **overrides})
    model = getattr(transformers, arch)(config).eval()
    model.to(dtype).save_pretrained(str(path))
    return model.float()

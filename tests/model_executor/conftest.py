"""Fixtures for model tests; helpers live in tiny_checkpoints.py."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def tokens():
    g = torch.Generator().manual_seed(1234)
    return lambda n, vocab=160: torch.randint(0, vocab, (n,), generator=g).tolist()

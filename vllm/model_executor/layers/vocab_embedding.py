"""Token embedding that skips random initialisation (weights always come from a checkpoint)."""
from __future__ import annotations

from torch import nn


class VocabEmbedding(nn.Embedding):
    """``nn.Embedding`` [vocab, hidden] left uninitialised; the loader fills it."""

    def reset_parameters(self) -> None:
        pass

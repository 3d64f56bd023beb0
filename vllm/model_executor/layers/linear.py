"""Plain projection layers that skip random initialisation (weights always come from a checkpoint)."""
from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` whose parameters are left uninitialised: building a large model stays cheap."""

    def reset_parameters(self) -> None:
        # Every weight is overwritten by the loader; a missing one is reported as an error there.
        pass

"""The modular MoE kernel interface: what an expert backend implements, what it is asked to
support, and the one combine every backend's pairs go through.

A backend computes *pairs*: ``out[t, k] = topk_weights[t, k] * expert_{ids[t, k]}(x[t])`` for
every pair whose id is >= 0, reading the expert tensors it is given (``weights``: name -> [G, ...],
G = E experts, or N cache slots with slot ids); pairs with a negative id are left untouched, so
the expert cache can run a step as several waves into one ``out``. ``combine_pairs`` then
reduces over k in k order, the same reduction for every backend and every wave split, which is
why cached and uncached runs agree bitwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.kernels.cpu.ops import moe_sum
from vllm.platforms import Platform, native_kernels


@dataclass(frozen=True)
class MoEKernelQuery:
    """What a layer needs from an expert backend (the registry matches it against each
    backend's declaration)."""
    scheme: str
    """"unquantized" or a quantization scheme (``vllm.config.quantization.SCHEMES``)."""
    activation: str
    """"silu" or "gelu" (gated: act(gate) * up)."""
    dtype: torch.dtype
    """Activation (model) dtype."""
    hidden_size: int
    intermediate_size: int
    platform: Platform

    def describe(self) -> str:
        cap = self.platform.get_device_capability()
        sm = f" (SM {cap})" if cap is not None else ""
        return (f"scheme {self.scheme}, activation {self.activation}, dtype "
                f"{str(self.dtype).replace('torch.', '')}, hidden_size {self.hidden_size}, "
                f"intermediate_size {self.intermediate_size} on {self.platform.name}{sm}")


class MoEExperts:
    """One layer's expert computation (a backend bound to the layer's scheme and activation)."""

    name: str = ""

    def pack(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layout this backend reads, made once after loading from the scheme's layout.
        Applied to one expert's tensors (the cache's host store) or to stacked [E, ...] ones
        (uncached layers), so a layout change must be per expert. Identity by default."""
        return tensors

    def apply_pairs(self, weights: dict[str, torch.Tensor], x: torch.Tensor,
                    topk_weights: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        """x [T, H]; topk_weights, ids [T, top_k] (ids index dim 0 of every tensor in
        ``weights``, -1 = skip); out [T, top_k, H]: the pair contract above."""
        raise NotImplementedError


def combine_pairs(out: torch.Tensor) -> torch.Tensor:
    """[T, top_k, H] per-pair outputs -> [T, H], summed in k order: one C call on CPU (on a
    2048-token prefill's pairs torch's strided sum took 0.4-2.3 ms, the C loop 0.2 ms), else
    torch; both sum in k order."""
    if native_kernels(out.dtype, out.device):
        return moe_sum(out)
    return out.sum(dim=1)

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

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm.kernels.cpu.ops import moe_sum
from vllm.platforms import Platform, native_kernels

GATED_ACTIVATIONS = ("silu", "gelu", "swigluoai")
"""Activations of gated experts: w13 holds [gate; up] (2N rows)."""
NON_GATED_ACTIVATIONS = ("relu2_no_mul",)
"""Activations of non-gated experts (Nemotron-H): w13 holds the up projection only (N rows)."""
MOE_ACTIVATIONS = GATED_ACTIVATIONS + NON_GATED_ACTIVATIONS
BIAS_NAMES = ("w13_bias", "w2_bias")
"""Expert biases, when a layer has them: [G, 2N] (gate then up, after the first projection) and
[G, H] (after the second), in the activation dtype; backends read them from ``weights``."""


@dataclass(frozen=True)
class MoEActivation:
    """The activation between an expert's projections. Gated: gate_up [P, 2N] (gate columns,
    then up columns) -> [P, N]. "silu"/"gelu": act(gate) * up. "swigluoai" (GPT-OSS): gate
    clamped above at ``limit``, up clamped to [-limit, limit], then (up + 1) * gate *
    sigmoid(alpha * gate). Not gated: "relu2_no_mul" (Nemotron-H): up [P, N] -> relu(up)^2.
    The torch code here is the one definition the torch backends share, so they agree bitwise,
    and a value never depends on the other rows in the call."""
    name: str = "silu"
    alpha: float = 1.702
    """swigluoai only: the sigmoid's gain."""
    limit: float = 7.0
    """swigluoai only: the clamp of gate (above) and up (both sides)."""

    def __post_init__(self) -> None:
        if self.name not in MOE_ACTIVATIONS:
            raise ValueError(f"activation={self.name!r} is invalid: must be one of "
                             f"{list(MOE_ACTIVATIONS)}")

    @classmethod
    def of(cls, activation: "str | MoEActivation") -> "MoEActivation":
        """A name (default parameters) or an MoEActivation -> an MoEActivation."""
        return activation if isinstance(activation, cls) else cls(activation)

    @property
    def gated(self) -> bool:
        """Whether the first projection is [gate; up] (else the up projection alone)."""
        return self.name not in NON_GATED_ACTIVATIONS

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self.gated:                      # relu2_no_mul, as HF's ReLUSquaredActivation
            return torch.square(F.relu(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        if self.name == "silu":
            return F.silu(gate) * up
        if self.name == "gelu":
            return F.gelu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        # sigmoid as 1 / (1 + exp(-z)): torch's CPU sigmoid rounds a contiguous tensor's tail
        # elements (scalar path) differently from the rest, so a value would depend on how many
        # pairs share the call (a cache wave vs the whole step); exp, + and / do not.
        sig = 1 / (1 + torch.exp(-(gate * self.alpha)))
        return (up + 1) * (gate * sig)


@dataclass(frozen=True)
class MoEKernelQuery:
    """What a layer needs from an expert backend (the registry matches it against each
    backend's declaration)."""
    scheme: str
    """"unquantized" or a quantization scheme (``vllm.config.quantization.SCHEMES``)."""
    activation: str
    """One of MOE_ACTIVATIONS (``MoEActivation.name``)."""
    dtype: torch.dtype
    """Activation (model) dtype."""
    hidden_size: int
    intermediate_size: int
    platform: Platform
    has_bias: bool = False
    """The experts carry biases (w13_bias [G, 2N], w2_bias [G, H]; GPT-OSS)."""

    def describe(self) -> str:
        cap = self.platform.get_device_capability()
        sm = f" (SM {cap})" if cap is not None else ""
        return (f"scheme {self.scheme}, activation {self.activation}, dtype "
                f"{str(self.dtype).replace('torch.', '')}, hidden_size {self.hidden_size}, "
                f"intermediate_size {self.intermediate_size}{', biased' if self.has_bias else ''} "
                f"on {self.platform.name}{sm}")


@dataclass(frozen=True)
class WaveIds:
    """The ids of one ``apply_pairs`` pass of a step (a cache wave, or half of one with
    overlap; the whole step without a cache): ids [T, top_k] into dim 0 of the weights, -1 =
    skip the pair; ``max_ids`` bounds how many distinct ids >= 0 they hold, fixed by shapes
    alone (None: up to G, dim 0 of the weights). A backend may size its grids by it: a CUDA
    graph's launches are fixed at capture, and a cache's last wave holds few experts (at
    N = E - 1 and T*k >= E, one), so grids sized for G would launch mostly idle blocks."""
    ids: torch.Tensor
    max_ids: int | None = None


class MoEExperts:
    """One layer's expert computation (a backend bound to the layer's scheme and activation)."""

    name: str = ""
    cuda_graph_safe: bool = False
    """``apply_pairs`` enqueues the same kernels with the same shapes for every call of a given
    [T, top_k], with no host read of device data (group sizes stay on the device): safe to
    capture in a decode graph (``worker/cuda_graphs.py``). Not the per-expert loop reference,
    whose ``nonzero`` / ``tolist`` sizes its work on the host."""

    def pack(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The layout this backend reads, made once after loading from the scheme's layout.
        Applied to one expert's tensors (the cache's host store) or to stacked [E, ...] ones
        (uncached layers), so a layout change must be per expert. Identity by default."""
        return tensors

    def apply_pairs(self, weights: dict[str, torch.Tensor], x: torch.Tensor,
                    topk_weights: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
                    max_ids: int | None = None) -> None:
        """x [T, H]; topk_weights, ids [T, top_k] (ids index dim 0 of every tensor in
        ``weights``, -1 = skip); out [T, top_k, H]: the pair contract above. ``max_ids``:
        ``WaveIds.max_ids`` (a promise of the caller; a backend may ignore it)."""
        raise NotImplementedError


_CAPTURE_WARM_UP: ContextVar[int | None] = ContextVar("moe_capture_warm_up", default=None)


@contextlib.contextmanager
def capture_warm_up(max_tokens: int):
    """Marks the eager step that precedes a CUDA-graph capture (``worker/cuda_graphs.py``);
    ``max_tokens`` is the largest batch any decode graph captures. A backend whose calls need
    one-time host work for the captured shapes (a JIT build, a persistent workspace:
    ``flashinfer_cutlass``) does it inside, while nothing is being captured."""
    token = _CAPTURE_WARM_UP.set(max_tokens)
    try:
        yield
    finally:
        _CAPTURE_WARM_UP.reset(token)


def capture_warm_up_tokens() -> int | None:
    """Inside ``capture_warm_up``: its ``max_tokens``; else None."""
    return _CAPTURE_WARM_UP.get()


def combine_pairs(out: torch.Tensor) -> torch.Tensor:
    """[T, top_k, H] per-pair outputs -> [T, H], summed in k order: one C call on CPU (on a
    2048-token prefill's pairs torch's strided sum took 0.4-2.3 ms, the C loop 0.2 ms), else
    torch; both sum in k order."""
    if native_kernels(out.dtype, out.device):
        return moe_sum(out)
    return out.sum(dim=1)

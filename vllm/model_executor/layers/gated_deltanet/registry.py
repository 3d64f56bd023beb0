"""Gated delta rule backends: the torch reference everywhere, flash-linear-attention on CUDA.

A backend computes, over a step's flattened tokens,
- ``chunk(q, k, v, g, beta, starts, initial)``: prefill chunks, sequence i being tokens
  starts[i]:starts[i+1]; q/k [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv], initial [N, Hv, Dk, Dv]
  fp32 (zeros for a sequence starting fresh) or None (all fresh) -> (o [T, Hv, Dv], final
  states [N, Hv, Dk, Dv] fp32);
- ``recurrent(q, k, v, g, beta, state)``: one token per sequence (decodes), q/k [B, Hk, Dk],
  v [B, Hv, Dv], g/beta [B, Hv], state [B, Hv, Dk, Dv] fp32 -> (o [B, Hv, Dv], new state);
both with q/k l2-normalised inside (``torch_ref.py`` defines the math). The causal conv1d is the
torch one on every backend (one small depthwise conv per sequence).

``fla`` (CUDA only, when the ``fla`` module of flash-linear-attention / fla-core is importable:
the optional extra) calls its Triton kernels; it is imported only inside its functions, so no
other platform ever imports it. Not yet run on a GPU. "auto" tries ``Platform.gdn_backends``
(CUDA: fla, then torch; elsewhere torch); the choice is logged once (``BackendRegistry``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vllm.model_executor.layers.backend_registry import (BackendRegistry, OpQuery,
                                                         platform_package_refusal)
from vllm.model_executor.layers.gated_deltanet import torch_ref


class GdnQuery(OpQuery):
    what = "a gated delta rule"


@dataclass(frozen=True)
class GdnBackend:
    name: str
    chunk: Callable
    recurrent: Callable
    platforms: tuple[str, ...] | None = None
    """Platform names; None = every platform."""
    module: str | None = None
    """A Python module that must be importable (the optional package's), or None."""
    package: str = ""
    """What to install for ``module``, named in the refusal."""

    def refusal(self, q: GdnQuery) -> str | None:
        return platform_package_refusal(self.platforms, q.platform.name,
                                        (self.module,) if self.module else (), self.package)


def _torch_chunk(q, k, v, g, beta, starts: list[int], initial: torch.Tensor | None):
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    finals = []
    for i, (s, e) in enumerate(zip(starts[:-1], starts[1:])):
        init = None if initial is None else initial[i:i + 1]
        o, final = torch_ref.chunk_gated_delta_rule(q[None, s:e], k[None, s:e], v[None, s:e],
                                                    g[None, s:e], beta[None, s:e], init)
        out[s:e] = o[0]
        finals.append(final)
    return out, torch.cat(finals)


def _torch_recurrent(q, k, v, g, beta, state: torch.Tensor):
    o, final = torch_ref.recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None],
                                                    g[:, None], beta[:, None], state)
    return o[:, 0], final


def _gva(q, k, hv: int):
    """fla's kernels take as many q/k heads as value heads: repeat each q/k head."""
    hk = k.shape[-2]
    if hk == hv:
        return q, k
    return q.repeat_interleave(hv // hk, dim=-2), k.repeat_interleave(hv // hk, dim=-2)


def _fla_chunk(q, k, v, g, beta, starts: list[int], initial: torch.Tensor | None):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule   # CUDA only, optional
    q, k = _gva(q, k, v.shape[-2])
    cu = torch.tensor(starts, dtype=torch.long, device=v.device)
    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(),
                                      beta[None], initial_state=initial,
                                      output_final_state=True, cu_seqlens=cu,
                                      use_qk_l2norm_in_kernel=True)
    return o[0], final.float()


def _fla_recurrent(q, k, v, g, beta, state: torch.Tensor):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule  # CUDA only
    q, k = _gva(q, k, v.shape[-2])
    o, final = fused_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g[:, None].float(), beta[:, None],
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[:, 0], final.float()


_REGISTRY: BackendRegistry[GdnBackend] = BackendRegistry("gated delta rule", "gdn_backend")
_REGISTRY.register(GdnBackend("fla", _fla_chunk, _fla_recurrent, platforms=("cuda",),
                              module="fla", package="flash-linear-attention (or fla-core)"))
_REGISTRY.register(GdnBackend("torch", _torch_chunk, _torch_recurrent))


def gdn_backend_names() -> tuple[str, ...]:
    return _REGISTRY.names()


def get_gdn_backend(name: str) -> GdnBackend:
    return _REGISTRY.get(name)


def select_gdn_backend(q: GdnQuery, requested: str = "auto") -> GdnBackend:
    """The backend for ``q``: ``requested`` if it can run it (else ValueError naming why), or for
    "auto" fla on CUDA where importable, else torch."""
    return _REGISTRY.select(q, requested, q.platform.gdn_backends)

"""Mamba-2 kernel backends: what each supports, and the one function that picks one.

A backend provides the four ops a Mamba-2 mixer runs (``MambaKernels``: the causal conv over a
prefill and its one-token update, the chunked SSD scan and the recurrent state update), with
the signatures and float32 results of ``ssd_torch.py``.

Built in: ``torch`` (``ssd_torch.py``, every platform; the reference the tests check) and
``mamba_ssm`` (CUDA only, where the ``mamba_ssm`` package is installed: its Triton
``mamba_chunk_scan_combined`` and ``selective_state_update``, with ``causal_conv1d``'s update
kernel for decode convs where that package is installed too; imported only when chosen, and
not yet run on a GPU). "auto" follows ``Platform.mamba_backends``.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from vllm.model_executor.layers.backend_registry import (BackendRegistry, OpQuery,
                                                         platform_package_refusal)
from vllm.model_executor.layers.mamba import ssd_torch


class MambaQuery(OpQuery):
    what = "a Mamba-2 mixer"


@dataclass(frozen=True)
class MambaKernels:
    """The ops, each as in ``ssd_torch`` (shapes and semantics there)."""
    causal_conv1d: Callable = ssd_torch.causal_conv1d
    causal_conv1d_update: Callable = ssd_torch.causal_conv1d_update
    chunk_scan: Callable = ssd_torch.ssd_chunk_scan
    state_update: Callable = ssd_torch.selective_state_update


@dataclass(frozen=True)
class MambaBackend:
    name: str
    make: Callable[[], MambaKernels]
    platforms: tuple[str, ...] | None = None
    """Platform names; None = every platform."""
    packages: tuple[str, ...] = ()
    """Python packages that must be installed (checked without importing them)."""

    def refusal(self, q: MambaQuery) -> str | None:
        return platform_package_refusal(self.platforms, q.platform.name, self.packages)


_REGISTRY: BackendRegistry[MambaBackend] = BackendRegistry("Mamba", "mamba_backend")


def register_mamba_backend(backend: MambaBackend) -> MambaBackend:
    return _REGISTRY.register(backend)


def mamba_backend_names() -> tuple[str, ...]:
    return _REGISTRY.names()


def select_mamba_backend(q: MambaQuery, requested: str = "auto") -> MambaBackend:
    """The backend for ``q``: ``requested`` if it can run it (else ValueError with the reason and
    the backends that would), or for "auto" the first in the platform's order that can."""
    return _REGISTRY.select(q, requested, q.platform.mamba_backends)


# ---- mamba_ssm (CUDA) ------------------------------------------------------------------------
def _mamba_ssm_kernels() -> MambaKernels:
    """mamba_ssm's Triton kernels behind the ``ssd_torch`` signatures (one sequence per scan
    call, batch 1; the decode ops on the gathered [B, ...] states, which they update in place).
    dt arrives already softplus-ed and clamped, so the kernels get no dt_bias / dt_softplus."""
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    def chunk_scan(x, dt, A, B, C, D, chunk_size, init=None):
        init = None if init is None else init.float()[None].contiguous()
        y, final = mamba_chunk_scan_combined(
            x[None].contiguous(), dt[None].float().contiguous(), A.float(), B[None].contiguous(),
            C[None].contiguous(), chunk_size, D=D.float(), initial_states=init,
            return_final_states=True)
        return y[0].float(), final[0].float()

    def state_update(state, x, dt, A, B, C, D):
        h, p, n = state.shape[1:]
        new = state.to(torch.float32, copy=True).contiguous()   # updated in place
        y = selective_state_update(
            new, x.float(), dt.float()[..., None].expand(-1, -1, p), A.float()[:, None, None]
            .expand(-1, p, n), B.float(), C.float(), D.float()[:, None].expand(-1, p))
        return y.float(), new

    return MambaKernels(causal_conv1d=ssd_torch.causal_conv1d,
                        causal_conv1d_update=_conv_update_kernel(),
                        chunk_scan=chunk_scan, state_update=state_update)


def _conv_update_kernel():
    """causal_conv1d's decode update where that package is installed, else the torch one."""
    if importlib.util.find_spec("causal_conv1d") is None:
        return ssd_torch.causal_conv1d_update
    from causal_conv1d import causal_conv1d_update

    def conv_update(x, state, weight, bias, activation="silu"):
        new = state.to(x.dtype, copy=True).contiguous()    # updated in place by the kernel
        return causal_conv1d_update(x, new, weight, bias, activation), new
    return conv_update


register_mamba_backend(MambaBackend("torch", MambaKernels))
register_mamba_backend(MambaBackend("mamba_ssm", _mamba_ssm_kernels, platforms=("cuda",),
                                    packages=("mamba_ssm",)))

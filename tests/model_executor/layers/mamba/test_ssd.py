"""Mamba-2 torch kernels (``ssd_torch.py``) against a naive per-token recurrence and a naive
convolution written here in float64: the chunked scan at lengths that chunk sizes do not
divide, from zero and from given states; the one-step update; a sequence split anywhere
(prefill, then chunks or single steps from the stored state) gives the unsplit result."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.model_executor.layers.mamba import ssd_torch
from vllm.model_executor.layers.mamba.registry import (MambaQuery, mamba_backend_names,
                                                       select_mamba_backend)
from vllm.platforms import platform_for

H, P, G, N = 4, 3, 2, 5          # heads, head_dim, groups, state size
TOL = dict(atol=2e-5, rtol=2e-5)


def inputs(L: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)          # noqa: E731
    dt = F.softplus(r(L, H) - 1)                          # positive steps, some small
    A = -torch.exp(r(H) * 0.5)
    return r(L, H, P), dt, A, r(L, G, N), r(L, G, N), r(H), r(H, P, N)


def naive_scan(x, dt, A, B, C, D, init=None):
    """state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T; y_t = state_t C_t + D x_t; float64,
    head h reads group h // (H / G)."""
    x, dt, A, B, C, D = (t.double() for t in (x, dt, A, B, C, D))
    state = torch.zeros(H, P, N, dtype=torch.float64) if init is None else init.double().clone()
    group = torch.arange(H) // (H // G)
    ys = []
    for t in range(x.shape[0]):
        Bt, Ct = B[t, group], C[t, group]                 # [H, N]
        state = state * torch.exp(dt[t] * A)[:, None, None] + \
            dt[t][:, None, None] * x[t][:, :, None] * Bt[:, None, :]
        ys.append((state * Ct[:, None, :]).sum(-1) + D[:, None] * x[t])
    return torch.stack(ys).float(), state.float()


def naive_conv(x, weight, bias, init):
    """y[t, c] = silu(bias[c] + sum_j weight[c, j] * window[t + j, c]), window = init ++ x."""
    window = torch.cat([init.t(), x]).double()            # [K-1+L, C]
    K = weight.shape[1]
    y = torch.stack([(window[t:t + K] * weight.double().t()).sum(0)
                     for t in range(x.shape[0])]) + bias.double()
    return F.silu(y).float(), window[-(K - 1):].t().float()


@pytest.mark.parametrize("L,chunk", [(1, 4), (5, 4), (8, 4), (13, 8), (30, 8), (30, 64)])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunk_scan_equals_naive_recurrence(L, chunk, with_init):
    x, dt, A, B, C, D, init = inputs(L, seed=L)
    init = init if with_init else None
    y, final = ssd_torch.ssd_chunk_scan(x, dt, A, B, C, D, chunk, init)
    y_ref, final_ref = naive_scan(x, dt, A, B, C, D, init)
    torch.testing.assert_close(y, y_ref, **TOL)
    torch.testing.assert_close(final, final_ref, **TOL)
    assert y.dtype == final.dtype == torch.float32


def test_state_update_equals_naive_recurrence():
    """Batched single steps, each sequence from its own state, several steps in a row."""
    steps, batch = 6, 3
    seqs = [inputs(steps, seed=10 + b) for b in range(batch)]
    A = seqs[0][2]
    state = torch.stack([s[6] for s in seqs])              # [batch, H, P, N]
    for t in range(steps):
        pick = lambda j: torch.stack([s[j][t] for s in seqs])  # noqa: E731
        y, state = ssd_torch.selective_state_update(state, pick(0), pick(1), A, pick(3),
                                                    pick(4), seqs[0][5])
    for b, (x, dt, _, B, C, _, init) in enumerate(seqs):
        y_ref, final_ref = naive_scan(x, dt, A, B, C, seqs[0][5], init)
        torch.testing.assert_close(y[b], y_ref[-1], **TOL)
        torch.testing.assert_close(state[b], final_ref, **TOL)


@pytest.mark.parametrize("split", [1, 3, 7, 12])
def test_split_sequence_continues_from_state(split):
    """A prefill of ``split`` tokens, then the rest as a chunk (from the stored state) or one
    token at a time: the outputs and final state of the whole sequence at once."""
    L, chunk = 20, 8
    x, dt, A, B, C, D, _ = inputs(L, seed=3)
    y_all, final_all = ssd_torch.ssd_chunk_scan(x, dt, A, B, C, D, chunk)
    y1, s = ssd_torch.ssd_chunk_scan(x[:split], dt[:split], A, B[:split], C[:split], D, chunk)
    y2, final = ssd_torch.ssd_chunk_scan(x[split:], dt[split:], A, B[split:], C[split:], D,
                                         chunk, s)
    torch.testing.assert_close(torch.cat([y1, y2]), y_all, **TOL)
    torch.testing.assert_close(final, final_all, **TOL)
    ys = [y1]
    for t in range(split, L):
        y, s = ssd_torch.selective_state_update(s[None], x[t:t + 1], dt[t:t + 1], A, B[t:t + 1],
                                                C[t:t + 1], D)
        s = s[0]
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys), y_all, **TOL)
    torch.testing.assert_close(s, final_all, **TOL)


@pytest.mark.parametrize("L", [1, 2, 9])
def test_causal_conv1d_equals_naive_and_continues(L):
    Ch, K = 6, 4
    g = torch.Generator().manual_seed(L)
    x, w, b = torch.randn(L, Ch, generator=g), torch.randn(Ch, K, generator=g), \
        torch.randn(Ch, generator=g)
    init = torch.randn(Ch, K - 1, generator=g)
    for start in (None, init):
        y, final = ssd_torch.causal_conv1d(x, w, b, start)
        y_ref, final_ref = naive_conv(x, w, b, torch.zeros(Ch, K - 1) if start is None else start)
        torch.testing.assert_close(y, y_ref, **TOL)
        torch.testing.assert_close(final, final_ref, **TOL)
    # One token at a time through the update: the same outputs and window.
    state, ys = init[None], []
    for t in range(L):
        y, state = ssd_torch.causal_conv1d_update(x[t:t + 1], state, w, b)
        ys.append(y)
    y_ref, final_ref = naive_conv(x, w, b, init)
    torch.testing.assert_close(torch.cat(ys), y_ref, **TOL)
    torch.testing.assert_close(state[0], final_ref, **TOL)


def test_registry_picks_torch_on_cpu_and_refuses_mamba_ssm():
    q = MambaQuery(platform_for("cpu"), torch.float32)
    assert set(mamba_backend_names()) >= {"torch", "mamba_ssm"}
    assert select_mamba_backend(q).name == "torch"
    with pytest.raises(ValueError, match=r"mamba_backend='mamba_ssm'.*runs on \['cuda'\]"):
        select_mamba_backend(q, "mamba_ssm")


def test_mamba_ssm_wrappers_call_its_api(monkeypatch):
    """The mamba_ssm backend's argument plumbing (shapes, batch dim, expanded dt/A/D, in-place
    state), with transformers' torch implementations of the same two functions standing in for
    mamba_ssm's Triton kernels (the package itself needs CUDA): equal to ``ssd_torch``."""
    import sys
    import types

    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    from vllm.model_executor.layers.mamba import registry
    for name, attrs in (("mamba_ssm", {}), ("mamba_ssm.ops", {}), ("mamba_ssm.ops.triton", {}),
                        ("mamba_ssm.ops.triton.selective_state_update",
                         {"selective_state_update": hf.mamba2_selective_state_update}),
                        ("mamba_ssm.ops.triton.ssd_combined",
                         {"mamba_chunk_scan_combined": hf.mamba2_chunk_scan})):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    k = registry._mamba_ssm_kernels()
    x, dt, A, B, C, D, init = inputs(13, seed=5)
    for start in (None, init):
        got = k.chunk_scan(x, dt, A, B, C, D, 4, start)
        want = ssd_torch.ssd_chunk_scan(x, dt, A, B, C, D, 4, start)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL)
    states = torch.stack([init, init * 0.5])
    got = k.state_update(states, x[:2], dt[:2], A, B[:2], C[:2], D)
    want = ssd_torch.selective_state_update(states, x[:2], dt[:2], A, B[:2], C[:2], D)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    assert torch.equal(states[0], init)                  # the caller's state is not modified

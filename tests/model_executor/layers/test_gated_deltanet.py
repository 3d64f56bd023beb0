"""Gated delta rule kernels (layers/gated_deltanet/): the chunked form (prefill) and the
recurrent form (decode) against a naive per-token loop written here from the definition, with
initial states, grouped value heads and splits at arbitrary points; the causal conv1d in
pieces; the backend registry; the recurrent-state layer contract (slots of other requests
untouched, plain and dummy forwards store nothing)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from vllm.model_executor.forward_context import AttentionMetadata, set_forward_context
from vllm.model_executor.layers.gated_deltanet import torch_ref
from vllm.model_executor.layers.gated_deltanet.layer import GatedDeltaNet
from vllm.model_executor.layers.gated_deltanet.registry import (GdnQuery, gdn_backend_names,
                                                                select_gdn_backend)
from vllm.model_executor.layers.recurrent_state import recurrent_layers, state_bytes_per_slot
from vllm.platforms import platform_for

TOL = dict(atol=2e-5, rtol=2e-5)


def naive(q, k, v, g, beta, state=None):
    """The definition, one token and one head at a time (fp32; q/k l2-normalised, q scaled)."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    S = torch.zeros(B, Hv, Dk, Dv) if state is None else state.clone()
    out = torch.zeros(B, T, Hv, Dv)
    for b in range(B):
        for h in range(Hv):
            kh = h // (Hv // Hk)
            for t in range(T):
                qt = q[b, t, kh] / q[b, t, kh].norm().clamp_min(1e-12) * Dk ** -0.5
                kt = k[b, t, kh] / k[b, t, kh].norm().clamp_min(1e-12)
                S[b, h] = S[b, h] * torch.exp(g[b, t, h])
                delta = beta[b, t, h] * (v[b, t, h] - S[b, h].T @ kt)
                S[b, h] = S[b, h] + torch.outer(kt, delta)
                out[b, t, h] = S[b, h].T @ qt
    return out, S


def inputs(B=2, T=150, Hk=2, Hv=4, Dk=8, Dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    g = -torch.nn.functional.softplus(r(B, T, Hv)) * 0.3     # decays in (0, 1]
    return r(B, T, Hk, Dk), r(B, T, Hk, Dk), r(B, T, Hv, Dv), g, torch.rand(B, T, Hv,
                                                                            generator=gen)


@pytest.mark.parametrize("T", [1, 5, 64, 150])
def test_chunked_and_recurrent_equal_the_naive_loop(T):
    q, k, v, g, beta = inputs(T=T)
    init = torch.randn(2, 4, 8, 6) * 0.5
    ref_o, ref_s = naive(q, k, v, g, beta, init)
    for fn in (torch_ref.chunk_gated_delta_rule, torch_ref.recurrent_gated_delta_rule):
        o, s = fn(q, k, v, g, beta, init)
        torch.testing.assert_close(o, ref_o, **TOL)
        torch.testing.assert_close(s, ref_s, **TOL)


def test_split_anywhere_carries_the_state():
    """A sequence fed in pieces (chunked prefill, then decodes) equals one pass."""
    q, k, v, g, beta = inputs(B=1, T=100)
    full, final = torch_ref.chunk_gated_delta_rule(q, k, v, g, beta)
    state, outs = None, []
    for s, e in ((0, 37), (37, 90), (90, 98)):
        o, state = torch_ref.chunk_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e],
                                                    g[:, s:e], beta[:, s:e], state)
        outs.append(o)
    for t in (98, 99):
        o, state = torch_ref.recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1],
                                                        v[:, t:t + 1], g[:, t:t + 1],
                                                        beta[:, t:t + 1], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, **TOL)
    torch.testing.assert_close(state, final, **TOL)


def test_equals_transformers_kernels():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    q, k, v, g, beta = inputs(T=70)
    init = torch.randn(2, 4, 8, 6)
    o, s = torch_ref.chunk_gated_delta_rule(q, k, v, g, beta, init)
    ho, hs = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init,
                                             output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, ho) and torch.equal(s, hs)


def test_causal_conv1d_in_pieces():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(20, 6, generator=gen), torch.randn(6, 4, generator=gen)
    full, final = torch_ref.causal_conv1d(x, w, None)
    ref = torch.nn.functional.conv1d(x.t()[None], w[:, None], padding=3, groups=6)[0, :, :20]
    torch.testing.assert_close(full, torch.nn.functional.silu(ref).t())
    state, outs = None, []
    for s, e in ((0, 2), (2, 11), (11, 12), (12, 18)):
        y, state = torch_ref.causal_conv1d(x[s:e], w, state)
        outs.append(y)
    for t in (18, 19):
        y, state = torch_ref.causal_conv1d_step(x[t:t + 1], w, state[None])
        state = state[0]
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), full)
    torch.testing.assert_close(state, final)
    torch.testing.assert_close(final, x[-3:].t())


def test_registry_torch_everywhere_fla_only_on_cuda():
    assert set(gdn_backend_names()) == {"torch", "fla"}
    cpu = platform_for(torch.device("cpu"))
    assert select_gdn_backend(GdnQuery(cpu, torch.float32)).name == "torch"
    with pytest.raises(ValueError, match=r"runs on \['cuda'\], not 'cpu'.*would: \['torch'\]"):
        select_gdn_backend(GdnQuery(cpu, torch.bfloat16), "fla")
    cuda = platform_for(torch.device("cuda"))       # the platform object: no device needed
    assert cuda.gdn_backends[0] == "fla"
    if importlib.util.find_spec("fla") is None:      # "auto" falls back; forcing names the package
        assert select_gdn_backend(GdnQuery(cuda, torch.bfloat16)).name == "torch"
        with pytest.raises(ValueError, match="flash-linear-attention"):
            select_gdn_backend(GdnQuery(cuda, torch.bfloat16), "fla")


def _fake_fla(monkeypatch):
    """Installs a stand-in ``fla.ops.gated_delta_rule`` whose two functions keep fla's calling
    convention (batch 1 with ``cu_seqlens`` for varlen prefill, states [N, H, Dk, Dv], q/k with
    as many heads as v) and compute with transformers' torch versions of them (what
    transformers calls when fla is missing): the fla backend's plumbing runs without CUDA."""
    import sys
    import types

    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    def chunk(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
              use_qk_l2norm_in_kernel=False):
        assert q.shape[0] == 1 and q.shape[2] == v.shape[2] and g.dtype == torch.float32
        outs, finals = [], []
        bounds = cu_seqlens.tolist()
        for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            init = None if initial_state is None else initial_state[i:i + 1]
            o, f = hf.torch_chunk_gated_delta_rule(
                q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=init,
                output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, 1), torch.cat(finals) if output_final_state else None

    def recurrent(q, k, v, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False):
        assert q.shape[1] == 1 and q.shape[2] == v.shape[2]
        return hf.torch_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    ops = types.SimpleNamespace(chunk_gated_delta_rule=chunk,
                                fused_recurrent_gated_delta_rule=recurrent)
    for name, mod in (("fla", types.SimpleNamespace()), ("fla.ops", types.SimpleNamespace()),
                      ("fla.ops.gated_delta_rule", ops)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_fla_backend_plumbing_equals_torch(monkeypatch):
    """The fla backend's argument passing (varlen boundaries, grouped value heads repeated for
    q/k, initial and final states, the in-kernel l2norm) against the torch backend, over two
    prefill sequences with stored states and a batch of decodes. fla's kernels themselves
    need CUDA: not yet run on a GPU."""
    from vllm.model_executor.layers.gated_deltanet import registry
    _fake_fla(monkeypatch)
    fla, ref = registry.get_gdn_backend("fla"), registry.get_gdn_backend("torch")
    q, k, v, g, beta = (t[0] for t in inputs(B=1, T=21))      # [T, H, D], Hv = 2 Hk
    init = torch.randn(2, 4, 8, 6)
    for got, want in zip(fla.chunk(q, k, v, g, beta, [0, 9, 21], init),
                         ref.chunk(q, k, v, g, beta, [0, 9, 21], init)):
        torch.testing.assert_close(got, want, **TOL)
    state = torch.randn(3, 4, 8, 6)
    for got, want in zip(fla.recurrent(q[:3], k[:3], v[:3], g[:3], beta[:3], state.clone()),
                         ref.recurrent(q[:3], k[:3], v[:3], g[:3], beta[:3], state.clone())):
        torch.testing.assert_close(got, want, **TOL)


def _layer(seed=0):
    cfg = transformers.Qwen3NextConfig(hidden_size=16, linear_num_key_heads=1,
                                       linear_num_value_heads=2, linear_key_head_dim=4,
                                       linear_value_head_dim=4, linear_conv_kernel_dim=3)
    torch.manual_seed(seed)
    layer = GatedDeltaNet(cfg, "gdn")
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    return layer


def _md(lens, starts_pos, slots):
    """Metadata for sequences of ``lens`` new tokens from positions ``starts_pos``."""
    qsl = torch.tensor([0] + lens).cumsum(0)
    seq_lens = [p + n for p, n in zip(starts_pos, lens)]
    nd = next((i for i, n in enumerate(lens) if n != 1), len(lens))
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(lens), dtype=torch.long), block_tables=torch.zeros(
            len(lens), 1, dtype=torch.long), seq_lens=torch.tensor(seq_lens), query_start_loc=qsl,
        seq_lens_cpu=seq_lens, query_lens_cpu=lens, num_decodes=nd, block_size=4,
        state_slots=torch.tensor(slots), has_initial_state=[p > 0 for p in starts_pos])


@torch.no_grad()
def test_layer_state_contract():
    """Sequences read/write only their slots; a plain forward is one sequence from zeros; with
    metadata but no bound state each sequence starts from zeros; nothing is stored by either."""
    layer = _layer()
    assert recurrent_layers(torch.nn.Sequential(layer)) == [layer]
    assert state_bytes_per_slot([layer]) == (2 * 4 + 8) * 2 * 4 + 2 * 4 * 4 * 4
    x = torch.randn(12, 16)
    a, b = x[:7], x[7:]
    ref_a, ref_b = layer(a), layer(b)                    # plain forwards
    with set_forward_context(_md([7, 5], [0, 0], [0, 1])):
        both = layer(x)                                  # no state bound: per sequence
    torch.testing.assert_close(both, torch.cat([ref_a, ref_b]))
    layer.bind_state(4)
    for st in layer.state.values():
        st[1].fill_(7.0)                                 # a stale slot: never read at pos 0
    with set_forward_context(_md([4, 5], [0, 0], [3, 1])):
        out = layer(torch.cat([a[:4], b]))
    torch.testing.assert_close(out, torch.cat([ref_a[:4], ref_b]))
    assert all(float(st[[0, 2]].abs().max()) == 0 for st in layer.state.values())
    saved = {n: st.clone() for n, st in layer.state.items()}
    with set_forward_context(_md([1, 2], [4, 5], [3, 1])):   # a decode, then a 2-token chunk
        out = layer(torch.cat([a[4:5], a[5:7]]))
    torch.testing.assert_close(out[:1], ref_a[4:5], atol=1e-5, rtol=1e-5)
    # a's tokens 5-6 fed as sequence 2 continuing from slot 1 (b's state): differs from ref
    assert not torch.allclose(out[1:], ref_a[5:7])
    for n, st in layer.state.items():
        assert torch.equal(st[[0, 2]], saved[n][[0, 2]])       # other slots untouched
        assert not torch.equal(st[3], saved[n][3])             # its own slot advanced
    saved = {n: st.clone() for n, st in layer.state.items()}
    layer(x)
    for n, st in layer.state.items():                          # plain forwards stored nothing
        assert torch.equal(st, saved[n])

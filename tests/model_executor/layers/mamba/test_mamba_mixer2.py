"""``MambaMixer2`` against transformers' ``NemotronHMamba2Mixer`` (random weights, fp32): one
plain forward, and sequences of mixed lengths fed over several steps (prefill chunks that
chunk_size does not divide, then decodes batched in front) through the state slots, each
output row equal to HF's full-sequence forward at that position; rows of other slots are left
alone; without bound state nothing is stored."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from vllm.model_executor.forward_context import AttentionMetadata, set_forward_context
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

TOL = dict(atol=1e-5, rtol=1e-5)
HIDDEN = 32


def hf_mixer(seed: int = 0, **kw) -> NemotronHMamba2Mixer:
    """Random mixer; HF initialises A_log, D, dt_bias and the norm to constants: randomised.
    time_step_min tiny, so HF's prefill clamp (dt >= time_step_min) never binds (we apply the
    config's time_step_limit, (0, inf), as the original implementation does)."""
    torch.manual_seed(seed)
    cfg = transformers.NemotronHConfig(
        hidden_size=HIDDEN, layers_block_type=["linear_attention"], mamba_num_heads=6,
        mamba_head_dim=4, ssm_state_size=5, n_groups=2, conv_kernel=4, chunk_size=4,
        time_step_min=1e-7, **kw)
    m = NemotronHMamba2Mixer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        m.A_log.uniform_(-1, 1.5)
        m.dt_bias.normal_(-1, 0.5)
        m.norm.weight.normal_(1, 0.2)
    return m


def ours_from(hf: NemotronHMamba2Mixer) -> MambaMixer2:
    c = hf.config
    m = MambaMixer2(HIDDEN, c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.n_groups,
                    c.conv_kernel, c.chunk_size, use_conv_bias=c.use_conv_bias,
                    use_bias=c.use_bias, eps=c.layer_norm_epsilon)
    params = dict(m.named_parameters())
    for name, t in hf.state_dict().items():
        params[name].data.copy_(t)
    return m


def metadata(qlens: list[int], ctx: list[int], slots: list[int]) -> AttentionMetadata:
    """Just what recurrent layers read (the attention fields are placeholders)."""
    lens = [c + q for c, q in zip(ctx, qlens)]
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(qlens), dtype=torch.long),
        block_tables=torch.zeros(len(qlens), 1, dtype=torch.long),
        seq_lens=torch.tensor(lens), query_start_loc=torch.tensor([0] + qlens).cumsum(0),
        seq_lens_cpu=lens, query_lens_cpu=qlens,
        num_decodes=next((i for i, q in enumerate(qlens) if q != 1), len(qlens)), block_size=4,
        state_slots=torch.tensor(slots), has_initial_state=[c > 0 for c in ctx])


@pytest.mark.parametrize("use_conv_bias,use_bias", [(True, False), (False, True)])
@torch.no_grad()
def test_plain_forward_equals_transformers(use_conv_bias, use_bias):
    hf = hf_mixer(use_conv_bias=use_conv_bias, use_bias=use_bias)
    ours = ours_from(hf)
    x = torch.randn(11, HIDDEN)
    torch.testing.assert_close(ours(x), hf(x[None])[0], **TOL)


@torch.no_grad()
def test_stepwise_through_state_slots_equals_full_sequence():
    """Three sequences (slots 5, 1, 3 of 6) fed in different step patterns: prefill chunks of
    3/6/5 tokens (chunk_size 4), then decodes in front of the remaining prefills."""
    hf = hf_mixer(1)
    ours = ours_from(hf)
    ours.bind_state(6)
    garbage = {n: torch.randn_like(t) for n, t in ours.state.items()}
    for n, t in ours.state.items():
        t.copy_(garbage[n])                      # stale contents must never be read
    lens, slots, chunk = [9, 14, 7], [5, 1, 3], [3, 6, 5]
    xs = [torch.randn(L, HIDDEN) for L in lens]
    refs = [hf(x[None])[0] for x in xs]
    fed, got = [0] * 3, [[] for _ in lens]
    while any(f < L for f, L in zip(fed, lens)):
        order = sorted((i for i in range(3) if fed[i] < lens[i]),
                       key=lambda i: fed[i] < chunk[i] * 2)      # decodes first
        qlens = [1 if fed[i] >= chunk[i] * 2 else min(chunk[i], lens[i] - fed[i])
                 for i in order]
        md = metadata(qlens, [fed[i] for i in order], [slots[i] for i in order])
        with set_forward_context(md):
            out = ours(torch.cat([xs[i][fed[i]:fed[i] + q] for i, q in zip(order, qlens)]))
        for i, rows in zip(order, out.split(qlens)):
            got[i].append(rows)
            fed[i] += rows.shape[0]
    for g, ref in zip(got, refs):
        torch.testing.assert_close(torch.cat(g), ref, **TOL)
    for n, t in ours.state.items():              # slots 0, 2, 4 were never touched
        torch.testing.assert_close(t[[0, 2, 4]], garbage[n][[0, 2, 4]], rtol=0, atol=0)


@torch.no_grad()
def test_without_bound_state_each_sequence_starts_fresh():
    """Metadata but no state (a profiling run): each sequence from zero, nothing stored."""
    hf = hf_mixer(2)
    ours = ours_from(hf)
    xs = [torch.randn(L, HIDDEN) for L in (1, 6, 3)]
    with set_forward_context(metadata([1, 6, 3], [0, 0, 0], [0, 1, 2])):
        out = ours(torch.cat(xs))
    assert ours.state is None
    for rows, x in zip(out.split([1, 6, 3]), xs):
        torch.testing.assert_close(rows, hf(x[None])[0], **TOL)

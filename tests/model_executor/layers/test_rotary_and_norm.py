"""Rotary frequencies vs transformers' own rope init functions; RMSNorm vs HF's RMSNorm."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope

SCALINGS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
     "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
     "original_max_position_embeddings": 512, "truncate": False, "attention_factor": 1.3},
]


def _config(rope):
    return transformers.LlamaConfig(hidden_size=256, num_attention_heads=4,
                                    max_position_embeddings=4096, rope_parameters=rope)


@pytest.mark.parametrize("rope", SCALINGS, ids=lambda r: r["rope_type"])
def test_inv_freq_matches_transformers(rope):
    cfg = _config(rope)
    if rope["rope_type"] == "default":   # transformers 5 has no init function for it
        ref_inv, ref_scale = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 64, 2).float() / 64)), 1.0
    else:
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    ours = get_rope(cfg, 64)
    torch.testing.assert_close(ours.inv_freq, ref_inv.float(), atol=0, rtol=1e-6)
    assert ours.attention_scaling == pytest.approx(ref_scale)


@pytest.mark.parametrize("rope", SCALINGS, ids=lambda r: r["rope_type"])
def test_inv_freq_is_computed_on_the_cpu_under_any_default_device(rope):
    """Models are built under the target device (torch.device(cuda)); the frequencies are still
    computed on the CPU as transformers does (a GPU's pow may differ by an ulp). The meta
    device stands in for the GPU: values computed there would not exist."""
    from vllm.model_executor.layers.rotary_embedding import compute_inv_freq, rope_parameters
    params = rope_parameters(_config(rope))
    want, scale = compute_inv_freq(params, 64, 4096)
    with torch.device("meta"):
        got, got_scale = compute_inv_freq(params, 64, 4096)
    assert got.device.type == "cpu" and torch.equal(got, want) and got_scale == scale


def test_legacy_rope_fields():
    class Legacy:
        hidden_size, num_attention_heads, max_position_embeddings = 64, 4, 2048
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}
    rope = get_rope(Legacy(), 16)
    expected = 1.0 / (1234.0 ** (torch.arange(0, 16, 2).float() / 16)) / 2.0
    torch.testing.assert_close(rope.inv_freq, expected)


def test_unsupported_rope_type_is_named():
    cfg = _config({"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    cfg.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="'dynamic'"):
        get_rope(cfg, 64)


def test_rotation_matches_hf_apply_and_partial_keeps_tail():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    torch.manual_seed(0)
    T, H, D = 5, 3, 16
    cfg = _config({"rope_type": "default", "rope_theta": 10000.0})
    rope = get_rope(cfg, D)
    pos = torch.tensor([0, 3, 7, 100, 2047])
    q, k = torch.randn(T, H * D), torch.randn(T, H * D)
    freqs = pos[:, None].float() * rope.inv_freq[None]
    emb = torch.cat((freqs, freqs), -1)
    ref_q, ref_k = apply_rotary_pos_emb(q.view(T, H, D), k.view(T, H, D), emb.cos(), emb.sin(),
                                        unsqueeze_dim=1)
    oq, ok = rope(pos, q, k)
    torch.testing.assert_close(oq.view(T, H, D), ref_q)
    torch.testing.assert_close(ok.view(T, H, D), ref_k)
    cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": 0.5}
    half = get_rope(cfg, D)
    pq, _ = half(pos, q, k)
    assert torch.equal(pq.view(T, H, D)[..., 8:], q.view(T, H, D)[..., 8:])
    assert not torch.allclose(pq.view(T, H, D)[..., :8], q.view(T, H, D)[..., :8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    torch.manual_seed(0)
    ref = LlamaRMSNorm(32, eps=1e-5)
    ref.weight.data = torch.randn(32)
    ours = RMSNorm(32, eps=1e-5)
    ours.weight.data.copy_(ref.weight.data)
    ref, ours = ref.to(dtype), ours.to(dtype)
    x = (torch.randn(4, 32) * 3).to(dtype)
    torch.testing.assert_close(ours(x), ref(x).detach(), atol=0, rtol=0)

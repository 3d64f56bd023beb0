"""The attention backend registry: what "auto" picks, what a forced name refuses, that the
choice is logged once, and that the backends agree on a mixed batch."""
from __future__ import annotations

import logging

import pytest
import torch

from vllm.model_executor.forward_context import set_forward_context
from vllm.model_executor.layers.attention import (AttentionQuery, attention_backend_names,
                                                  select_attention_backend)
from vllm.platforms import platform_for

from .test_attention import BS, D, HKV, HQ, NB, make_attention, mixed_batch, run_mixed_batch


@pytest.fixture(autouse=True)
def _no_triton_interpreter(monkeypatch):
    """The registry as a CPU install sees it: without TRITON_INTERPRET (which tests/conftest.py
    sets), triton_paged does not run on CPU (tests/.../test_triton_paged.py covers it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _query(dtype=torch.float32, contiguous=True, device="cpu") -> AttentionQuery:
    return AttentionQuery(platform_for(device), dtype, D, contiguous)


def _non_contiguous_cache(dtype=torch.float32) -> torch.Tensor:
    """[2, NB, BS, HKV, D] cut from a larger cache: each half is contiguous (the torch backend
    writes through .view), the whole is not (the C kernel reads it from one base pointer)."""
    cache = torch.zeros(2, NB + 3, BS, HKV, D, dtype=dtype)[:, :NB]
    assert not cache.is_contiguous()
    return cache


def test_builtin_names():
    assert set(attention_backend_names()) >= {"cpu_paged", "torch_sdpa"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_picks_the_c_kernel_for_a_contiguous_kernel_dtype_cache(dtype):
    assert select_attention_backend(_query(dtype)).name == "cpu_paged"
    attn = make_attention("auto")
    attn.kv_cache = torch.zeros(2, NB, BS, HKV, D, dtype=dtype)
    assert attn.impl.name == "cpu_paged"


def test_auto_picks_torch_for_float16_and_for_a_non_contiguous_cache():
    assert select_attention_backend(_query(torch.float16)).name == "torch_sdpa"
    assert select_attention_backend(_query(contiguous=False)).name == "torch_sdpa"
    attn = make_attention("auto")
    attn.kv_cache = torch.zeros(2, NB, BS, HKV, D, dtype=torch.float16)
    assert attn.impl.name == "torch_sdpa"
    attn.kv_cache = _non_contiguous_cache()
    assert attn.impl.name == "torch_sdpa"


def test_auto_off_cpu_and_on_a_platform_without_a_list():
    """CUDA lists triton_paged (triton is a test dependency), then torch_sdpa for what it
    refuses; a device type without a platform ("meta") lists nothing and falls through to the
    backends that run anywhere. Pure selection: no device is touched."""
    assert select_attention_backend(_query(device="cuda")).name == "triton_paged"
    assert select_attention_backend(_query(contiguous=False, device="cuda")).name == "torch_sdpa"
    assert select_attention_backend(_query(device="meta")).name == "torch_sdpa"
    with pytest.raises(ValueError, match=r"it runs on \['cpu'\], not 'cuda'"):
        select_attention_backend(_query(device="cuda"), "cpu_paged")


def test_binding_rechooses_and_none_clears():
    attn = make_attention("auto")
    attn.kv_cache = torch.zeros(2, NB, BS, HKV, D)
    assert attn.impl.name == "cpu_paged"
    attn.kv_cache = torch.zeros(2, NB, BS, HKV, D, dtype=torch.float16)
    assert attn.impl.name == "torch_sdpa"
    attn.kv_cache = None
    assert attn.kv_cache is None and attn.impl is None


def test_forcing_the_c_kernel_on_float16_names_the_reason_and_the_alternatives():
    with pytest.raises(ValueError, match=r"attention_backend='cpu_paged' cannot run a contiguous "
                                         r"torch.float16 KV cache on cpu .*torch.float16.*"
                                         r"backends that would: \['torch_sdpa'\]"):
        select_attention_backend(_query(torch.float16), "cpu_paged")
    attn = make_attention("cpu_paged")                     # the name is valid: builds
    with pytest.raises(ValueError, match=r"'cpu_paged'.*\['torch_sdpa'\]"):
        attn.kv_cache = torch.zeros(2, NB, BS, HKV, D, dtype=torch.float16)
    assert attn.impl is None


def test_forcing_the_c_kernel_on_a_non_contiguous_cache_is_refused():
    with pytest.raises(ValueError, match=r"needs a contiguous KV cache.*\['torch_sdpa'\]"):
        select_attention_backend(_query(contiguous=False), "cpu_paged")


def test_unknown_name_lists_the_registered_names():
    pattern = r"attention_backend='flash' is invalid: must be 'auto' or one of \[.*'cpu_paged'"
    with pytest.raises(ValueError, match=pattern):
        select_attention_backend(_query(), "flash")
    with pytest.raises(ValueError, match=pattern):                 # at build, not at bind
        make_attention("flash")


def test_choice_is_logged_once(vllm_log):
    vllm_log.set_level(logging.INFO, logger="vllm")
    for _ in range(3):
        make_attention("auto").kv_cache = torch.zeros(2, NB, BS, HKV, D)
    make_attention("auto").kv_cache = torch.zeros(2, NB, BS, HKV, D, dtype=torch.float16)
    msgs = [r.getMessage() for r in vllm_log.records if "Attention backend" in r.getMessage()]
    assert msgs == [
        f"Attention backend cpu_paged (requested 'auto') for a contiguous torch.float32 KV cache "
        f"on cpu (head_dim={D})",
        f"Attention backend torch_sdpa (requested 'auto') for a contiguous torch.float16 KV "
        f"cache on cpu (head_dim={D})"]


def test_without_c_kernels_auto_picks_torch(torch_paths):
    assert select_attention_backend(_query()).name == "torch_sdpa"
    with pytest.raises(ValueError, match=r"kernels are not built.*\['torch_sdpa'\]"):
        select_attention_backend(_query(), "cpu_paged")
    attn = make_attention("auto")
    attn.kv_cache = torch.zeros(2, NB, BS, HKV, D)
    assert attn.impl.name == "torch_sdpa"


def test_both_backends_agree_on_a_mixed_batch():
    """3 decodes, a chunked prefill with history and a fresh prefill: the C kernel and the
    torch backend give the same attention and write the same cache."""
    c_attn, c_out, ref, _, _ = run_mixed_batch("cpu_paged")
    t_attn, t_out, _, _, _ = run_mixed_batch("torch_sdpa")
    torch.testing.assert_close(c_out, t_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(c_attn.kv_cache, t_attn.kv_cache)


def test_forced_torch_backend_is_the_naive_attention():
    attn, out, ref, k_new, slots = run_mixed_batch("torch_sdpa", seed=1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(attn.kv_cache[0].view(-1, HKV, D)[slots], k_new)


def test_c_kernel_backend_runs_the_torch_ops_under_torch_compile():
    """A ctypes call cannot be traced: compiled, cpu_paged gives exactly the torch backend's
    bits (eager, the two differ in the last bits, so a kernel call would show)."""
    outs = {}
    for backend in ("cpu_paged", "torch_sdpa"):
        attn = make_attention(backend)
        attn.kv_cache = torch.zeros(2, NB, BS, HKV, D)
        md, q, k, v, ref, _ = mixed_batch(attn)
        compiled = torch.compile(lambda q, k, v: attn(q, k, v), backend="aot_eager")
        with set_forward_context(md):
            outs[backend] = compiled(q, k, v).view(-1, HQ, D)
        torch.testing.assert_close(outs[backend], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(outs["cpu_paged"], outs["torch_sdpa"])

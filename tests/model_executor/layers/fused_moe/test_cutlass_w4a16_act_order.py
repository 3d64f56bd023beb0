"""GPTQ act order (``desc_act``) on the "cutlass_w4a16" backend (not yet passed on a GPU): ``pack``
sorts each expert's input columns by group and keeps the permutation in g_idx's place; the
backend gathers each pair's activations by its expert's permutation. Checked on CPU through the
op's stand-in: the packed bytes against the method's dequantized weights (un-permuted here), the
layer against the torch backend (which reads g_idx as loaded), and cached == uncached bitwise.

The experts' gate and up share one permutation, as GPTQ makes them (both ordered by the same
Hessian diagonal): here every column of gate and up has the norm 0.1 * c[k] * sqrt(N) (entries
+-0.1 * c[k]), so ``quantize_gptq``'s norm order is c's order for both."""
from __future__ import annotations

import pytest
import torch
from model_executor.layers.fused_moe.cutlass_w4a16_standin import standin_ops
from model_executor.layers.fused_moe.test_cutlass_w4a16 import (BF16, E, H, N, TOP_K,
                                                                assert_close_to, gpu_config,
                                                                inputs, read_packed,
                                                                skip_unless_runs)
from model_executor.tiny_checkpoints import layer_config

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.fused_moe import cutlass_w4a16 as cw
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.gptq import GptqMoEMethod, quantize_gptq

GS = 64


def act_order_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up [N, H] with one column order (c's); down [H, N] with its own."""
    g = torch.Generator().manual_seed(seed)
    c = torch.linspace(0.5, 1.5, H)[torch.randperm(H, generator=g)]
    signs = (torch.randint(0, 2, (2, N, H), generator=g) * 2 - 1).float()
    gate, up = signs * 0.1 * c
    down = torch.randn(H, N, generator=g) * 0.1
    return gate, up, down


def quantized_expert(method, seed: int, sym: bool) -> dict[str, torch.Tensor]:
    """One expert's layer tensors, as the loader fuses them (w13 = [gate; up])."""
    return method.expert_from_checkpoint(
        *(quantize_gptq(w, GS, sym, desc_act=True) for w in act_order_weights(seed)))


def test_packed_columns_are_the_methods_weights_sorted_by_group():
    sym = True
    method = GptqMoEMethod(GS, sym, True, "gptq")
    t = quantized_expert(method, 1, sym)
    assert not torch.equal(t["w13_g_idx"][0], torch.arange(H, dtype=torch.int32) // GS)
    want13, want2 = method.dequantize(t, torch.float32)
    packed = cw.pack_gptq_for_cutlass(method, t)
    for p, want in (("w13", want13), ("w2", want2)):
        perm = packed[f"{p}_g_idx"][0].long()
        assert torch.equal(packed[f"{p}_g_idx"], perm.int().expand_as(t[f"{p}_g_idx"]))
        assert torch.equal(perm.sort().values, torch.arange(perm.numel()))
        # Sorted column j is loaded column perm[j]; its group is j // GS.
        assert torch.equal(t[f"{p}_g_idx"][0][perm].long(), torch.arange(perm.numel()) // GS)
        got = read_packed(packed, p, GS)
        assert_close_to(got[:, perm.argsort()], want, bound=0.01)


def test_gather_columns_in_chunks():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 16, generator=g)
    perms = torch.stack([torch.randperm(16, generator=g) for _ in range(3)]).int()
    slot = torch.tensor([0, 2, 2, 1, 0, 1, 2])
    want = torch.stack([a[r, perms[slot[r]].long()] for r in range(7)])
    for rows in (1, 3, 1024):
        assert torch.equal(cw.gather_columns(a, perms, slot, rows=rows), want)


def build(backend: str, sym: bool, cache: int = 0, ops=None, device: str = "cpu") -> FusedMoE:
    """A bf16 FusedMoE layer of act-order GPTQ experts; ``ops``: cutlass_w4a16 over them."""
    method = GptqMoEMethod(GS, sym, True, "gptq")
    config = (layer_config(cache, moe_backend=backend) if device == "cpu"
              else gpu_config(backend, cache))
    # The weights on the CPU, before the device context: a CPU generator cannot draw there.
    weights = [act_order_weights(100 + e) for e in range(E)]
    with set_current_vllm_config(config), torch.device(device):
        layer = FusedMoE(E, TOP_K, H, N, params_dtype=BF16, quant_method=method)
        if ops is not None:
            layer.quant_method.kernel = cw.CutlassW4A16Experts(layer.activation, ops)
            layer.quant_method.kernel.bind_scheme(method)
        for e, (gate, up, down) in enumerate(weights):
            for shard, kind, w in (("w1", "w13", gate), ("w3", "w13", up), ("w2", "w2", down)):
                for s, t in quantize_gptq(w, GS, sym, desc_act=True).items():
                    layer.load_expert_weight(f"{kind}_{s}", method.load_transform(s, kind, t),
                                             e, shard)
    layer.finish_loading(torch.device(device))
    return layer


def test_layer_close_to_the_torch_backend():
    sym = True
    ref = build("torch", sym)
    got = build("torch", sym, ops=standin_ops())
    assert got.quant_method.kernel.act_order
    for T in (1, 6, 16):
        x, logits = inputs(T, 40 + T)
        assert_close_to(got(x, logits), ref(x, logits))


def test_without_the_gather_the_layer_is_wrong():
    """The gather is what makes it right: the same packed experts with it switched off."""
    ref = build("torch", True)
    got = build("torch", True, ops=standin_ops())
    got.quant_method.kernel.act_order = False
    x, logits = inputs(8, 3)
    want, bad = ref(x, logits).float(), got(x, logits).float()
    assert ((bad - want).norm() / want.norm()).item() > 0.3


def test_cached_equals_uncached_bitwise():
    plain = build("torch", True, ops=standin_ops())
    cached = build("torch", True, cache=2, ops=standin_ops())
    assert cached.expert_cache is not None
    for T in (1, 9):
        x, logits = inputs(T, 70 + T)
        assert torch.equal(cached(x, logits), plain(x, logits))


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [0, 2])
def test_act_order_matches_the_torch_backend_on_gpu(cache):
    skip_unless_runs()
    ref, got = build("torch", True, device="cuda"), build("cutlass_w4a16", True, cache, None,
                                                          "cuda")
    assert got.quant_method.backend_name == "cutlass_w4a16"
    for T in (1, 7, 64):
        x, logits = inputs(T, T, "cuda")
        assert_close_to(got(x, logits), ref(x, logits))

"""Test helpers (imported by name; no package): tiny random Hugging Face checkpoints and a minimal paged-KV driver for our models."""
from __future__ import annotations

import random

import torch
import transformers

from vllm.config import (CacheConfig, DeviceConfig, KernelConfig, ModelConfig, MoECacheConfig,
                         SchedulerConfig, VllmConfig)
from vllm.model_executor.forward_context import AttentionMetadata, set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.recurrent_state import recurrent_layers

_COMMON = dict(vocab_size=160, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)

TINY = {
    "Qwen3MoeForCausalLM": lambda **kw: transformers.Qwen3MoeConfig(**{
        **_COMMON, "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 24,
        "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": True, **kw}),
    "MixtralForCausalLM": lambda **kw: transformers.MixtralConfig(**{
        **_COMMON, "intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2,
        "rope_theta": 10000.0, **kw}),
    "Qwen2MoeForCausalLM": lambda **kw: transformers.Qwen2MoeConfig(**{
        **_COMMON, "intermediate_size": 64, "moe_intermediate_size": 24, "num_experts": 8,
        "num_experts_per_tok": 2, "shared_expert_intermediate_size": 40, **kw}),
    "Qwen3ForCausalLM": lambda **kw: transformers.Qwen3Config(**{
        **_COMMON, "head_dim": 16, "intermediate_size": 64, **kw}),
    "LlamaForCausalLM": lambda **kw: transformers.LlamaConfig(**{
        **_COMMON, "intermediate_size": 64, **kw}),
    # MLA: one latent of kv_lora_rank 16 + rope 8 per token; HF's eager MLA needs as many kv
    # heads as heads. V3: q LoRA, 4 groups of 2 experts (2 kept), yarn with both mscales.
    "DeepseekV3ForCausalLM": lambda **kw: transformers.DeepseekV3Config(**{
        **_COMMON, "num_key_value_heads": 4, "intermediate_size": 64,
        "moe_intermediate_size": 24, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "n_shared_experts": 1,
        "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12,
        "v_head_dim": 10, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
            "mscale_all_dim": 0.8, "original_max_position_embeddings": 64}, **kw}),
    # V2-Lite-like: no q LoRA, softmax greedy routing, 2 shared experts.
    "DeepseekV2ForCausalLM": lambda **kw: transformers.DeepseekV2Config(**{
        **_COMMON, "num_key_value_heads": 4, "intermediate_size": 64,
        "moe_intermediate_size": 24, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "n_shared_experts": 2, "kv_lora_rank": 16,
        "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10,
        **kw}),
    # Sizes multiples of 32 (MXFP4 blocks); 4 layers alternating sliding (window 8) / full;
    # GPT-OSS's YaRN (truncate False) scaled down to the tiny context.
    "GptOssForCausalLM": lambda **kw: transformers.GptOssConfig(**{
        **_COMMON, "hidden_size": 64, "head_dim": 16, "intermediate_size": 32,
        "num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
        "sliding_window": 8, "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}, **kw}),
    # Hybrid Gated DeltaNet / gated attention: layers 0-2 linear attention, 3 full (GQA, partial
    # rotary 0.25); 2 key heads serve 4 value heads; layer 2 keeps a dense MLP.
    "Qwen3NextForCausalLM": lambda **kw: transformers.Qwen3NextConfig(**{
        **_COMMON, "num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 64,
        "moe_intermediate_size": 24, "shared_expert_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "mlp_only_layers": [2], "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
        "linear_conv_kernel_dim": 4, **kw}),
    "Qwen3_5MoeForCausalLM": lambda **kw: transformers.Qwen3_5MoeTextConfig(**{
        **_COMMON, "num_hidden_layers": 4, "head_dim": 16, "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, **kw}),
}


def _randomise_constants(model) -> None:
    """Give parameters HF initialises to constants random values, so a load that mixes them up
    (or a missing 1 + w) shows: DeltaNet A_log / dt_bias, every norm weight."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")) or "norm" in name.rsplit(".", 2)[-2]:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))


RANDOMISE = {"Qwen3NextForCausalLM": _randomise_constants,
             "Qwen3_5MoeForCausalLM": _randomise_constants}
"""arch -> fn(hf_model): applied by ``build_checkpoint`` before saving."""


def build_checkpoint(arch: str, path, dtype: torch.dtype = torch.float32, seed: int = 0,
                     max_shard_size=None, **overrides):
    """Save a random tiny ``arch`` model to ``path``; return the (eager-attention, fp32) HF model."""
    torch.manual_seed(seed)
    config = TINY[arch](**overrides)
    config._attn_implementation = "eager"
    model = getattr(transformers, arch)(config).eval()
    if arch in RANDOMISE:
        RANDOMISE[arch](model)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.to(dtype).save_pretrained(str(path), **kwargs)
    return model.float()


def layer_config(cache_size: int = 0, policy: str = "auto",
                 moe_backend: str = "auto", cpu_compute: str = "off") -> VllmConfig:
    """A CPU config without a model, for building single layers under it."""
    return VllmConfig(None, CacheConfig(), SchedulerConfig(),
                      MoECacheConfig(cache_size=cache_size, policy=policy,
                                     cpu_compute=cpu_compute), DeviceConfig("cpu"),
                      kernel_config=KernelConfig(moe_backend=moe_backend))


def make_vllm_config(path, dtype: str = "float32") -> VllmConfig:
    return VllmConfig(ModelConfig(str(path), dtype=dtype), CacheConfig(), SchedulerConfig(),
                      MoECacheConfig(), DeviceConfig("cpu"))


@torch.no_grad()
def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32 logits of one sequence (each position sees only its prefix)."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


class PagedDriver:
    """Runs our model step by step over a paged KV cache, like a (tiny) model runner.

    Blocks are handed out from a shuffled free list so block tables are non-contiguous. For a
    model with recurrent layers it also binds a state pool of ``num_slots`` slots and gives each
    seq id its own slot (from a shuffled list, first come) for its lifetime; ``release(sid)``
    forgets a sequence (its blocks and slot go back, e.g. to replay it from token 0).
    """

    def __init__(self, model, num_blocks: int = 48, block_size: int = 4, dtype=torch.float32,
                 num_slots: int = 8):
        self.model, self.block_size = model, block_size
        for m in model.modules():
            if isinstance(m, Attention):
                m.kv_cache = torch.zeros(m.kv_cache_shape(num_blocks, block_size), dtype=dtype)
        self.free = list(range(1, num_blocks))      # block 0 doubles as table padding
        random.Random(0).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.recurrent = recurrent_layers(model)
        for m in self.recurrent:
            m.bind_state(num_slots)
        self.free_slots = list(range(num_slots)) if self.recurrent else []
        random.Random(1).shuffle(self.free_slots)
        self.slots: dict[str, int] = {}

    def release(self, sid: str) -> None:
        """Forget ``sid``: blocks and state slot back to the free lists, progress to zero."""
        self.free += self.tables.pop(sid, [])
        if sid in self.slots:
            self.free_slots.append(self.slots.pop(sid))
        self.computed.pop(sid, None)

    @torch.no_grad()
    def step(self, chunks: list[tuple[str, list[int]]], num_decodes: int = 0):
        """chunks: (seq_id, new token ids), decodes first. Returns {seq_id: logits [n, vocab]}."""
        ids, pos, slots, lens, qlens = [], [], [], [], []
        for sid, toks in chunks:
            done = self.computed.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block_size < done + len(toks):
                table.append(self.free.pop())
            for p in range(done, done + len(toks)):
                slots.append(table[p // self.block_size] * self.block_size + p % self.block_size)
            ids += toks
            pos += range(done, done + len(toks))
            lens.append(done + len(toks))
            qlens.append(len(toks))
            if self.recurrent and sid not in self.slots:
                self.slots[sid] = self.free_slots.pop()
        width = max(len(self.tables[sid]) for sid, _ in chunks)
        tables = [self.tables[sid] + [0] * (width - len(self.tables[sid])) for sid, _ in chunks]
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables),
            seq_lens=torch.tensor(lens), query_start_loc=torch.tensor([0] + qlens).cumsum(0),
            seq_lens_cpu=lens, query_lens_cpu=qlens, num_decodes=num_decodes,
            block_size=self.block_size)
        if self.recurrent:
            md.state_slots = torch.tensor([self.slots[sid] for sid, _ in chunks])
            md.has_initial_state = [n < c for n, c in zip(qlens, lens)]   # start_pos > 0
        with set_forward_context(md):
            hidden = self.model(torch.tensor(ids), torch.tensor(pos))
        logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for (sid, toks), n in zip(chunks, qlens):
            out[sid] = logits[start:start + n]
            start += n
            self.computed[sid] = self.computed.get(sid, 0) + n
        return out

"""The MoE expert cache: ``CachedWeightProvider`` and the identity provider (``provider.py``),
over the host store, device slots, residency, policies and copy engine of this package."""
from vllm.model_executor.layers.fused_moe.expert_cache.expert_plan import ExpertPlan
from vllm.model_executor.layers.fused_moe.expert_cache.provider import (CachedWeightProvider,
                                                                        IdentityProvider,
                                                                        WeightProvider,
                                                                        cache_enabled,
                                                                        make_weight_provider)

__all__ = ["CachedWeightProvider", "ExpertPlan", "IdentityProvider", "WeightProvider",
           "cache_enabled", "make_weight_provider"]

"""The engine collector of /metrics on a made-up snapshot: which expert-cache series it exports."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from vllm.entrypoints.openai.metrics import _EngineCollector


def _render(moe: dict | None) -> str:
    collector = _EngineCollector("m")
    collector.snapshot = {"running": 1, "waiting": 0, "kv_usage": 0.5, "free_blocks": 3,
                          "total_blocks": 6, "preemptions": 0, "moe": moe}
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def _moe(**extra) -> dict:
    per_layer = {"hits": [5, 6], "misses": [1, 2], "evictions": [0, 1],
                 "bytes_copied": [10, 20], "link_bytes_copied": [8, 15],
                 "hit_rate": [5 / 6, 0.75], **extra}
    return {"per_layer": per_layer}


def test_cpu_compute_counters_only_when_the_engine_has_them():
    plain = _render(_moe())
    assert 'vllm:moe_expert_cache_hits_total{layer="1",model_name="m"} 6.0' in plain
    assert 'vllm:moe_expert_cache_link_bytes_copied_total{layer="1",model_name="m"} 15.0' in plain
    assert "cpu_pairs" not in plain
    text = _render(_moe(cpu_pairs=[7, 0], cpu_expert_calls=[3, 0]))
    assert 'vllm:moe_expert_cache_cpu_pairs_total{layer="0",model_name="m"} 7.0' in text
    assert 'vllm:moe_expert_cache_cpu_expert_calls_total{layer="0",model_name="m"} 3.0' in text


def test_no_cache_no_expert_series():
    assert "moe_expert_cache" not in _render(None)

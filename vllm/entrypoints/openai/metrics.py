"""Prometheus metrics of one server (its own CollectorRegistry, so several servers can live in
one process, e.g. in tests).

Counters that the server sees happen (HTTP requests by status, tokens, finish reasons) are
incremented as they happen. Engine state (running/waiting requests, KV usage, expert-cache
counters per MoE layer) is read at scrape time: ``render`` takes a snapshot in the engine
thread between steps, so it is consistent and never races the engine.
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vllm.engine.llm_engine import LLMEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_CACHE_COUNTERS = (("hits", "expert lookups served from a device slot"),
                   ("misses", "expert lookups that needed a host-to-device copy"),
                   ("evictions", "resident experts replaced by another"),
                   ("bytes_copied", "bytes of expert weights copied host-to-device"),
                   ("link_bytes_copied", "bytes those copies read over the host link (fewer "
                    "with moe_expert_link_compression)"))
_CPU_COUNTERS = (("cpu_pairs", "(token, expert) pairs of missing experts computed on the CPU "
                  "(moe_expert_cpu_compute)"),
                 ("cpu_expert_calls", "(step, expert) calls computed on the CPU instead of a "
                  "copy"))


def engine_snapshot(engine: LLMEngine) -> dict:
    """Engine state for one scrape; run it in the engine thread (``AsyncLLM.call``)."""
    sched = engine.scheduler
    return {"running": sched.num_running, "waiting": sched.num_waiting,
            "kv_usage": sched.kv_usage, "free_blocks": sched.block_manager.num_free_blocks,
            "total_blocks": sched.block_manager.num_blocks,
            "preemptions": sched.num_preemptions_total,
            "moe": engine.get_moe_cache_stats()}


class _EngineCollector(Collector):
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: dict | None = None

    def collect(self) -> Iterable:
        s = self.snapshot
        if s is None:
            return
        labels = ["model_name"]
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in the running batch.", s["running"]),
                ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s["waiting"]),
                ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                 s["kv_usage"]),
                ("vllm:num_free_kv_blocks", "Free KV-cache blocks.", s["free_blocks"]),
                ("vllm:num_kv_blocks", "KV-cache blocks in total.", s["total_blocks"])):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], value)
            yield g
        c = CounterMetricFamily("vllm:num_preemptions", "Requests preempted (recomputed).",
                                labels=labels)
        c.add_metric([self.model_name], s["preemptions"])
        yield c
        moe = s["moe"]
        if moe is None:
            return
        per_layer = moe["per_layer"]
        cpu = _CPU_COUNTERS if "cpu_pairs" in per_layer else ()
        for field, doc in _CACHE_COUNTERS + cpu:
            c = CounterMetricFamily(f"vllm:moe_expert_cache_{field}", f"Expert cache: {doc}.",
                                    labels=labels + ["layer"])
            for i, v in enumerate(per_layer[field]):
                c.add_metric([self.model_name, str(i)], v)
            yield c
        g = GaugeMetricFamily("vllm:moe_expert_cache_hit_rate",
                              "Expert cache: hits / (hits + misses) since start.",
                              labels=labels + ["layer"])
        for i, v in enumerate(per_layer["hit_rate"]):
            g.add_metric([self.model_name, str(i)], v)
        yield g


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        m = [model_name]
        self.http_requests = Counter(
            "vllm:http_requests", "HTTP requests to the API by route and status code.",
            ["model_name", "route", "status"], registry=self.registry)
        self._model = m
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                                     ["model_name"], registry=self.registry).labels(*m)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Generated tokens of finished requests.",
                                         ["model_name"], registry=self.registry).labels(*m)
        self.request_success = Counter(
            "vllm:request_success", "Finished completions by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        self.request_aborted = Counter(
            "vllm:request_aborted", "Requests aborted before finishing (client disconnects).",
            ["model_name"], registry=self.registry).labels(*m)
        self._engine = _EngineCollector(model_name)
        self.registry.register(self._engine)

    def count_http(self, route: str, status: int) -> None:
        self.http_requests.labels(self._model[0], route, str(status)).inc()

    def count_finished(self, prompt_tokens: int, completions) -> None:
        """Record one finished prompt: its tokens and each completion's finish reason."""
        self.prompt_tokens.inc(prompt_tokens)
        for c in completions:
            self.generation_tokens.inc(len(c.token_ids))
            self.request_success.labels(self._model[0], c.finish_reason or "unknown").inc()

    async def render(self, async_llm) -> bytes:
        """Prometheus text exposition, with a fresh engine snapshot."""
        self._engine.snapshot = await async_llm.call(engine_snapshot)
        return generate_latest(self.registry)

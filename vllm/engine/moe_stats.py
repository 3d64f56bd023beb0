"""Expert-cache statistics: totals + per-layer lists, a periodic one-line log, and a summary at
shutdown. Counters stay on the device; they are read only here, when asked or when logging."""
from __future__ import annotations

import time

from vllm.config import MoECacheConfig
from vllm.logger import init_logger

logger = init_logger(__name__)

_FIELDS = ("hits", "misses", "evictions", "bytes_copied", "link_bytes_copied")
"""``link_bytes_copied``: what the copies read over the host link (less than ``bytes_copied``,
the slots' bytes, with ``moe_expert_link_compression``)."""
_PREFETCH_FIELDS = ("prefetch_predicted", "prefetch_loads", "prefetch_used", "prefetch_wasted",
                    "prefetch_recalled", "prefetch_needed", "prefetch_bytes",
                    "prefetch_wasted_bytes")
"""With ``moe_expert_prefetch`` on (``expert_cache/prefetch.py``); ``bytes_copied`` includes
``prefetch_bytes``."""
_CPU_FIELDS = ("cpu_pairs", "cpu_expert_calls")
"""With ``moe_expert_cpu_compute`` on (``expert_cache/host_compute.py``): pairs and
(step, expert) calls the CPU computed instead of a miss (neither hits nor misses)."""


class MoEStatsReporter:
    def __init__(self, runner, moe_config: MoECacheConfig, log_interval_s: float = 10.0):
        self.runner = runner
        self.config = moe_config
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()

    def stats(self) -> dict | None:
        """{"hits", "misses", "evictions", "bytes_copied", "hit_rate", "num_layers",
        "per_layer": {field: [per MoE layer, model order]}}; None when no layer is cached.
        With prefetch on, also the ``_PREFETCH_FIELDS`` and "prefetch_recall" (recalled /
        needed; per layer None where nothing predicted it, e.g. the first MoE layer); with CPU
        compute on, the ``_CPU_FIELDS``."""
        layers = self.runner.moe_cache_stats()
        if layers is None:
            return None
        fields = _FIELDS + (_PREFETCH_FIELDS if "prefetch_loads" in layers[0] else ()) + \
            (_CPU_FIELDS if "cpu_pairs" in layers[0] else ())
        per_layer = {f: [int(s[f]) for s in layers] for f in fields}
        per_layer["hit_rate"] = [float(s["hit_rate"]) for s in layers]
        totals = {f: sum(per_layer[f]) for f in fields}
        lookups = totals["hits"] + totals["misses"]
        totals["hit_rate"] = totals["hits"] / lookups if lookups else 0.0
        if "prefetch_loads" in totals:
            per_layer["prefetch_recall"] = [s["prefetch_recall"] for s in layers]
            needed = totals["prefetch_needed"]
            totals["prefetch_recall"] = totals["prefetch_recalled"] / needed if needed else None
        return {**totals, "num_layers": len(layers), "per_layer": per_layer}

    def summary_line(self) -> str | None:
        s = self.stats()
        if s is None:
            return None
        policy = next(m.expert_cache.policy_name for m in self.runner.moe_layers
                      if m.expert_cache is not None)
        return (f"expert cache ({self.config.cache_size} slots x {s['num_layers']} layers, "
                f"policy {policy}): hit_rate={s['hit_rate']:.3f} hits={s['hits']} "
                f"misses={s['misses']} evictions={s['evictions']} "
                f"copied={s['bytes_copied'] / 2**20:.1f} MiB" + _prefetch_summary(s) +
                (f" cpu: pairs={s['cpu_pairs']} expert_calls={s['cpu_expert_calls']}"
                 if "cpu_pairs" in s else ""))

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.log_interval_s:
            return
        self._last_log = now
        line = self.summary_line()
        if line:
            logger.info(line)

    def close(self) -> None:
        line = self.summary_line()
        if line:
            logger.info("at shutdown: %s", line)


def _prefetch_summary(s: dict) -> str:
    if "prefetch_loads" not in s:
        return ""
    recall = "n/a" if s["prefetch_recall"] is None else f"{s['prefetch_recall']:.3f}"
    return (f" prefetch: recall={recall} loads={s['prefetch_loads']} "
            f"used={s['prefetch_used']} wasted={s['prefetch_wasted_bytes'] / 2**20:.1f} MiB")

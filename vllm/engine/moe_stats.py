"""Expert-cache statistics: totals + per-layer lists, a periodic one-line log, and a summary at
shutdown. Counters stay on the device; they are read only here, when asked or when logging."""
from __future__ import annotations

import time

from vllm.config import MoECacheConfig
from vllm.logger import init_logger

logger = init_logger(__name__)

_FIELDS = ("hits", "misses", "evictions", "bytes_copied")


class MoEStatsReporter:
    def __init__(self, runner, moe_config: MoECacheConfig, log_interval_s: float = 10.0):
        self.runner = runner
        self.config = moe_config
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()

    def stats(self) -> dict | None:
        """{"hits", "misses", "evictions", "bytes_copied", "hit_rate", "num_layers",
        "per_layer": {field: [per MoE layer, model order]}}; None when no layer is cached."""
        layers = self.runner.moe_cache_stats()
        if layers is None:
            return None
        per_layer = {f: [int(s[f]) for s in layers] for f in _FIELDS}
        per_layer["hit_rate"] = [float(s["hit_rate"]) for s in layers]
        totals = {f: sum(per_layer[f]) for f in _FIELDS}
        lookups = totals["hits"] + totals["misses"]
        totals["hit_rate"] = totals["hits"] / lookups if lookups else 0.0
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
                f"copied={s['bytes_copied'] / 2**20:.1f} MiB")

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

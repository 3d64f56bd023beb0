"""Block sizes of the Triton fused-MoE GEMMs (``fused_moe.py``), read from JSON tables.

``configs/<device name>.json`` (the CUDA device name with spaces as underscores, e.g.
``NVIDIA_H100_80GB_HBM3.json``) or, for a device without one, ``configs/fused_moe_default.json``.
A table maps ``"default"`` or ``"N=<intermediate size>"`` to a list of entries tried in order;
the first whose ``max_m`` (the call's token count) is >= M, or null, applies. Never keyed by the
expert count: a cached layer's kernels see its N slots, not its E experts, and the block sizes
(BLOCK_K fixes the order of the f32 sums) must be the uncached layer's for bitwise-equal outputs
(``tools/tune_fused_moe.py`` writes these tables).

NOTHING HERE IS TUNED: no value has been measured on a GPU yet (the tuner has not run; the
kernels first ran, on these values, on an H100 on 2026-11-26). The H100 table holds plausible,
clearly labelled starting values.
"""
from __future__ import annotations

import functools
import json
import os
import re

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
DEFAULT_TABLE = "fused_moe_default.json"
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
"""What an entry gives (plus its ``max_m``)."""


def table_file_name(device_name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "NVIDIA_H100_80GB_HBM3.json"."""
    return device_name.strip().replace(" ", "_").replace("/", "_") + ".json"


def _check_entry(entry: dict, where: str) -> dict[str, int]:
    missing = [k for k in CONFIG_KEYS if k not in entry]
    if missing:
        raise ValueError(f"{where}: entry {entry} lacks {missing}")
    cfg = {k: entry[k] for k in CONFIG_KEYS}
    for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = cfg[k]
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{where}: {k}={v!r} is invalid: must be a power of two >= 16")
    for k in ("GROUP_M", "num_warps", "num_stages"):
        if not isinstance(cfg[k], int) or cfg[k] < 1:
            raise ValueError(f"{where}: {k}={cfg[k]!r} is invalid: must be an int >= 1")
    return cfg


@functools.lru_cache(maxsize=None)
def load_table(device_name: str = "") -> tuple[str, dict[str, list[tuple[int | None, dict]]]]:
    """(file name, {key: [(max_m, config)]}) for ``device_name`` (its file, else the default);
    checked once per file."""
    name = table_file_name(device_name) if device_name else DEFAULT_TABLE
    if not os.path.isfile(os.path.join(CONFIG_DIR, name)):
        name = DEFAULT_TABLE
    with open(os.path.join(CONFIG_DIR, name)) as f:
        raw = json.load(f)
    table = {}
    for key, entries in raw.items():
        if key.startswith("_"):
            continue
        if key != "default" and not re.fullmatch(r"N=[1-9][0-9]*", key):
            raise ValueError(f"{name}: key {key!r} is invalid: must be 'default' or "
                             "'N=<intermediate size>' (never the expert count: a cached layer "
                             "must choose the uncached layer's block sizes)")
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{name}: {key!r} must be a non-empty list of entries")
        table[key] = [(e.get("max_m"), _check_entry(e, f"{name} {key!r}")) for e in entries]
        if table[key][-1][0] is not None:
            raise ValueError(f"{name}: the last entry of {key!r} must have max_m null")
    if "default" not in table:
        raise ValueError(f"{name}: no 'default' entry list")
    return name, table


def get_moe_config(intermediate_size: int, num_tokens: int,
                   device_name: str = "") -> dict[str, int]:
    """Block sizes for a layer of ``intermediate_size`` run on ``num_tokens`` tokens on
    ``device_name`` (a copy)."""
    _, table = load_table(device_name)
    entries = table.get(f"N={intermediate_size}", table["default"])
    for max_m, cfg in entries:
        if max_m is None or num_tokens <= max_m:
            return dict(cfg)
    raise AssertionError("unreachable: the last entry has max_m null")

"""Shared by the benchmarks: writing the ``--out`` JSON, running with a set thread count."""
from __future__ import annotations

import json
import os

import torch


def write_json(path: str | None, obj: dict) -> None:
    """``--out``: the JSON, whole or (``"partial": true``) the rows measured so far; nothing
    without a path. Each call replaces the file atomically (written beside it, then renamed),
    so a run killed mid-write still leaves its previous write."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(obj) + "\n")
    os.replace(tmp, path)


def with_threads(threads: int, fn, *args):
    """``fn(*args)`` with torch's CPU threads set to ``threads``, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)

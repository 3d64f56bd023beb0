"""Shared by the benchmarks: writing the ``--out`` JSON."""
from __future__ import annotations

import json
import os


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

"""Padded batch sizes of decode graphs, shared by the CPU graphs (``worker/cpu_graphs.py``), the
CUDA graphs (``worker/cuda_graphs.py``) and the validation of ``cuda_graph_sizes``.

A decode step of B sequences replays the graph of the smallest graph size >= B; its rows past B
are padding. vLLM's ladder of sizes is 1, 2, 4, then multiples of 8 (at most 7 padding rows).
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence


def ladder_size(batch: int) -> int:
    """The smallest size of vLLM's ladder (1, 2, 4, 8, 16, 24, ...) that holds ``batch``."""
    if batch <= 2:
        return batch
    return 4 if batch <= 4 else -(-batch // 8) * 8


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    """The ladder's sizes below ``max_num_seqs``, then ``max_num_seqs`` itself, so every decode
    step has a graph: 256 -> [1, 2, 4, 8, ..., 248, 256]; 6 -> [1, 2, 4, 6]."""
    sizes: list[int] = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size = ladder_size(size + 1)
    return sizes + [max_num_seqs]


def padded_size(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest of ``sizes`` (sorted ascending) >= ``batch``, or None when ``batch`` is
    above the largest (that step runs eagerly)."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def check_graph_sizes(sizes: object, max_num_seqs: int) -> list[int]:
    """``cuda_graph_sizes`` validated: None -> ``default_graph_sizes(max_num_seqs)``; else a
    non-empty list of integers in [1, max_num_seqs], returned sorted without duplicates. A size
    above max_num_seqs is refused (ValueError) rather than dropped: no decode step has more
    sequences, so it could only be a mistake."""
    if sizes is None:
        return default_graph_sizes(max_num_seqs)
    name = "cuda_graph_sizes"
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes:
        raise ValueError(f"{name}={sizes!r} is invalid: must be a non-empty list of batch sizes "
                         "(or None for the default; enforce_eager=True turns CUDA graphs off)")
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
    if bad:
        raise ValueError(f"{name}={list(sizes)!r} is invalid: every size must be an integer >= 1, "
                         f"not {bad[0]!r}")
    above = sorted(s for s in set(sizes) if s > max_num_seqs)
    if above:
        raise ValueError(f"{name}={list(sizes)!r} is invalid: sizes must be <= max_num_seqs="
                         f"{max_num_seqs} (no decode step has more sequences), got {above}")
    return sorted(set(sizes))

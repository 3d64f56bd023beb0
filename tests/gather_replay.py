"""A CUDA-graph check shared by the expert gathers' ``gpu`` tests: a gather captured after a
warm-up (no host sync allowed in either) replays with the plan tensors refilled in place."""
from __future__ import annotations

import torch


def check_graph_replay(gather, srcs, dsts, plan, new_plan, reference) -> None:
    """``gather(srcs, dsts, *plan)`` warmed up and captured; dsts zeroed, ``plan``'s tensors
    refilled with ``new_plan``'s, the graph replayed: each dst must equal ``reference(src,
    zeros, *new_plan)``."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        gather(srcs, dsts, *plan)                  # warm-up (the Triton twin makes its table)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gather(srcs, dsts, *plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for d in dsts:
        d.zero_()
    for t, v in zip(plan, new_plan):
        t.copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    for src, dst in zip(srcs, dsts):
        assert torch.equal(dst.cpu(), reference(src, torch.zeros_like(dst.cpu()), *new_plan))

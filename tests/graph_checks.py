"""A check shared by the CPU- and CUDA-graph tests: every replay equals an eager forward."""
from __future__ import annotations

import torch


def check_replays_against_eager(llm) -> list[int]:
    """Wraps ``llm``'s decode graphs so each replay's logits (padded or exact) are compared
    bitwise with an eager forward of the same step's B rows. Returns the list the checked batch
    sizes are appended to as generation runs."""
    from vllm.model_executor.forward_context import set_forward_context
    runner = llm.llm_engine.runner
    graphs, checked = runner.decode_graphs, []
    orig = graphs.logits

    def check(input_ids, positions, md, ids=None):
        got = orig(input_ids, positions, md, ids=ids)
        if got is not None:
            got = got.clone()
            tokens = input_ids if ids is None else ids.to(input_ids.device)
            with set_forward_context(md):         # rewrites the same KV values in place
                want = runner.model.compute_logits(runner.model(tokens, positions))
            assert torch.equal(got, want)
            checked.append(input_ids.shape[0])
        return got
    graphs.logits = check
    return checked


def record_block_ids(runner) -> set[int]:
    """Wraps ``runner._prepare_inputs`` so every KV block id a scheduled sequence holds is added
    to the returned set as steps run (the blocks real rows may write)."""
    used: set[int] = set()
    orig = runner._prepare_inputs

    def spy(seqs):
        used.update(b for s in seqs for b in s.block_ids)
        return orig(seqs)
    runner._prepare_inputs = spy
    return used

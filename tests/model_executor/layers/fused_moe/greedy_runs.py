"""One greedy run of a checkpoint through ``LLM`` for the backend end-to-end tests."""
from __future__ import annotations


def greedy_run(path, **kw):
    """Three prompts, 5 greedy tokens each, on CPU in float32 with ``LLM(path, **kw)`` ->
    (token ids per prompt, logprob of each chosen token, the MoE layers' backend names, llm)."""
    from vllm import LLM, SamplingParams
    llm = LLM(path, device="cpu", dtype="float32", **kw)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    outs = llm.generate([[5, 17, 99, 3], [250, 7], list(range(40, 64))], params)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    backends = {m.quant_method.backend_name for m in llm.llm_engine.runner.moe_layers}
    return tokens, logprobs, backends, llm

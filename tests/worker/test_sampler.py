import math

import pytest
import torch

from vllm.core.sched_output import ScheduledSequence
from vllm.sampling_params import SamplingParams
from vllm.worker.sampler import (Sampler, SamplingMetadata, TokenMasks, apply_min_p,
                                 apply_penalties, apply_top_k_top_p)

V = 50


def seq(rid, sp, prompt=(1, 2, 3), outputs=(), do_sample=True):
    return ScheduledSequence(req_id=rid, token_ids=[0], start_pos=0, block_ids=[0],
                             do_sample=do_sample, sampling_params=sp,
                             prompt_token_ids=list(prompt), output_token_ids=list(outputs))


def meta(seqs, generators=None, eos=None):
    return SamplingMetadata.build(seqs, {} if generators is None else generators, "cpu",
                                  eos_token_id=eos)


# ---- plain references, written independently of the sampler (per row, Python loops) ----
def ref_allowed_top_k(row: torch.Tensor, k: int) -> set[int]:
    vals = sorted(row.tolist(), reverse=True)
    kth = vals[k - 1]
    return {i for i, v in enumerate(row.tolist()) if v >= kth}


def ref_allowed_top_p(row: torch.Tensor, p: float) -> set[int]:
    probs = torch.softmax(row.double(), -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, total = set(), 0.0
    for i in order:
        kept.add(i)
        total += probs[i]
        if total >= p:
            break
    return kept


def ref_allowed_min_p(row: torch.Tensor, min_p: float) -> set[int]:
    probs = torch.softmax(row.double(), -1).tolist()
    return {i for i, q in enumerate(probs) if q >= min_p * max(probs)}


def kept(x: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(x)).flatten().tolist())


def test_greedy_is_argmax_and_skips_non_sampling_sequences():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    seqs = [seq("a", SamplingParams(temperature=0)), seq("skip", SamplingParams(), do_sample=False),
            seq("b", SamplingParams(temperature=0, top_k=3)), seq("c", SamplingParams(temperature=0))]
    md = meta(seqs)
    assert md.req_ids == ["a", "b", "c"]
    out = Sampler()(logits, md)
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    assert all(t.logprob is None for t in out)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k_mask_matches_reference(k):
    torch.manual_seed(k)
    x = torch.randn(4, V)
    masked = apply_top_k_top_p(x.clone(), torch.tensor([k, 0, k, 1]), None)
    for r, kk in enumerate([k, 0, k, 1]):
        want = ref_allowed_top_k(x[r], kk) if kk else set(range(V))
        assert kept(masked[r]) == want
        assert torch.equal(masked[r][list(want)], x[r][list(want)])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1.0])
def test_top_p_mask_matches_reference(p):
    torch.manual_seed(int(p * 100))
    x = torch.randn(5, V) * 2
    masked = apply_top_k_top_p(x.clone(), None, torch.full((5,), p))
    for r in range(5):
        assert kept(masked[r]) == ref_allowed_top_p(x[r], p)


def test_top_k_then_top_p_matches_reference():
    torch.manual_seed(3)
    x = torch.randn(3, V) * 2
    masked = apply_top_k_top_p(x.clone(), torch.tensor([10, 10, 10]), torch.full((3,), 0.7))
    for r in range(3):
        restricted = x[r].clone()
        top = ref_allowed_top_k(x[r], 10)
        restricted[[i for i in range(V) if i not in top]] = float("-inf")
        assert kept(masked[r]) == ref_allowed_top_p(restricted, 0.7)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3])
def test_min_p_mask_matches_reference(min_p):
    torch.manual_seed(7)
    x = torch.randn(4, V) * 2
    masked = apply_min_p(x.clone(), torch.full((4,), min_p))
    for r in range(4):
        assert kept(masked[r]) == ref_allowed_min_p(x[r], min_p)


def test_samples_stay_inside_masks_and_follow_distribution():
    torch.manual_seed(0)
    row = torch.randn(V) * 2
    n = 4000
    sp = SamplingParams(temperature=0.7, top_k=12, top_p=0.8)
    out = Sampler()(row.expand(n, V).clone(), meta([seq(f"r{i}", sp) for i in range(n)]))
    ids = torch.tensor([t.token_id for t in out])
    scaled = row / 0.7
    allowed = ref_allowed_top_k(scaled, 12)
    restricted = scaled.clone()
    restricted[[i for i in range(V) if i not in allowed]] = float("-inf")
    allowed = ref_allowed_top_p(restricted, 0.8)
    assert set(ids.tolist()) <= allowed
    # Empirical frequencies match the renormalised probabilities (loose 5-sigma bound).
    probs = torch.full((V,), float("-inf"))
    probs[list(allowed)] = scaled[list(allowed)]
    probs = probs.softmax(-1)
    freq = torch.bincount(ids, minlength=V).float() / n
    sigma = (probs * (1 - probs) / n).sqrt()
    assert torch.all((freq - probs).abs() <= 5 * sigma + 1e-3)


def test_seeded_rows_do_not_depend_on_batch_composition():
    torch.manual_seed(0)
    steps = [torch.randn(4, V) for _ in range(5)]
    sp = SamplingParams(temperature=1.0, seed=1234)
    # The seeded request "s" alone ...
    alone, gens = [], {}
    for logits in steps:
        alone.append(Sampler()(logits[2:3].clone(), meta([seq("s", sp)], gens))[0].token_id)
    # ... and at row 2 of a mixed batch, with a different global RNG state.
    mixed, gens = [], {}
    for logits in steps:
        seqs = [seq("x", SamplingParams()), seq("y", SamplingParams(seed=5)), seq("s", sp),
                seq("z", SamplingParams(temperature=0))]
        torch.manual_seed(99)
        mixed.append(Sampler()(logits.clone(), meta(seqs, gens))[2].token_id)
    assert alone == mixed
    assert set(gens) == {"s", "y"}  # generators are created for seeded rows only


def test_different_seeds_give_different_tokens():
    flat = torch.zeros(1, 1000)  # uniform: two seeds agree with probability 1/1000
    sp = SamplingParams(temperature=1.0, seed=1234)
    a = [Sampler()(flat.clone(), meta([seq("s", sp)], {}))[0].token_id for _ in range(2)]
    b = Sampler()(flat.clone(), meta([seq("s", sp.clone(seed=77))], {}))[0].token_id
    assert a[0] == a[1] and a[0] != b


def ref_penalties(row, prompt, outputs, rep, pres, freq):
    row = row.clone()
    seen = set(prompt) | set(outputs)
    for t in seen:
        row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t in set(outputs):
        row[t] -= pres + freq * outputs.count(t)
    return row


def test_penalties_match_reference():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    cases = [((1, 2, 3, 3), (4, 4, 5, 1), 1.3, 0.5, 0.2),
             ((7,), (), 0.8, 0.0, 0.0),
             ((9, 10), (10, 10, 10, 11), 1.0, -0.5, 1.5)]
    seqs = [seq(f"r{i}", SamplingParams(repetition_penalty=r, presence_penalty=p,
                                         frequency_penalty=f), prompt=pr, outputs=o)
            for i, (pr, o, r, p, f) in enumerate(cases)]
    got = apply_penalties(logits.clone(), meta(seqs))
    for i, (pr, o, r, p, f) in enumerate(cases):
        want = ref_penalties(logits[i], list(pr), list(o), r, p, f)
        torch.testing.assert_close(got[i], want)


def test_penalties_change_greedy_choice():
    logits = torch.zeros(1, V)
    logits[0, 4] = 1.0
    logits[0, 6] = 0.9
    sp = SamplingParams(temperature=0, frequency_penalty=0.5)
    assert Sampler()(logits, meta([seq("a", sp, outputs=(4,))]))[0].token_id == 6
    assert Sampler()(logits, meta([seq("a", sp)]))[0].token_id == 4


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(3, V)
    logits[:, 7] = 10.0  # eos
    logits[:, 8] = 9.0  # stop token
    logits[:, 9] = 8.0
    sp = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[8])
    seqs = [seq("a", sp, outputs=(1,)), seq("b", sp, outputs=(1, 2)),
            seq("c", sp.clone(ignore_eos=True), outputs=())]
    out = Sampler()(logits.clone(), meta(seqs, eos=7))
    assert [t.token_id for t in out] == [9, 7, 7]


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(2)
    logits = torch.randn(3, V) * 3
    seqs = [seq("a", SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5)),
            seq("b", SamplingParams(temperature=0, logprobs=0)),
            seq("c", SamplingParams(temperature=1.0))]
    out = Sampler()(logits.clone(), meta(seqs))
    ref = torch.log_softmax(logits.double(), -1)
    for i in range(2):
        t = out[i]
        assert math.isclose(t.logprob, ref[i, t.token_id].item(), abs_tol=1e-5)
        assert t.rank == int((ref[i] > ref[i, t.token_id]).sum()) + 1
    vals, idx = torch.topk(ref[0], 3)
    assert [tid for tid, _ in out[0].top_logprobs] == idx.tolist()
    assert [lp for _, lp in out[0].top_logprobs] == pytest.approx(vals.tolist(), abs=1e-5)
    assert out[1].top_logprobs == [] and out[1].rank == 1
    assert out[2].logprob is None and out[2].top_logprobs is None


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, V), meta([seq("a", SamplingParams())]))


def test_metadata_is_reused_only_while_nothing_in_it_changes():
    """A decode step of the same requests reuses the last step's metadata; a new row order, a
    prefill (a new request, maybe with a reused id), penalties or pending min_tokens masks do
    not."""
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3)
    a, b = seq("a", greedy, outputs=[5]), seq("b", hot, outputs=[6, 7])
    md = meta([a, b], eos=0)
    assert md.reusable_for([a, b])
    assert md.reusable_for([a, b, seq("c", greedy, outputs=[1], do_sample=False)])
    assert not md.reusable_for([b, a]) and not md.reusable_for([a])
    assert not md.reusable_for([a, seq("b", hot)])                     # "b" is a new prefill
    pen = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert not meta([seq("a", pen, outputs=[5])]).reusable_for([seq("a", pen, outputs=[5])])
    mt = SamplingParams(temperature=0.0, min_tokens=4)
    row = seq("a", mt, outputs=[5])
    assert not meta([row], eos=0).reusable_for([row])                 # EOS masked until 4
    assert meta([seq("a", mt, outputs=[5, 6, 7, 8])], eos=0).reusable_for(
        [seq("a", mt, outputs=[5, 6, 7, 8, 9])])


def test_advanced_metadata_samples_as_metadata_built_afresh():
    """Penalties and min_tokens over four decode steps: the metadata advanced step by step
    (output tokens appended as a column, min_tokens pairs recomputed) masks and penalises as
    one built from the step's sequences (the build is the reference: its padding puts each
    row's tokens first)."""
    pen = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4,
                         frequency_penalty=0.2, min_tokens=3, stop_token_ids=[7, 4 * V])
    plain = SamplingParams(temperature=0.0, min_tokens=2)
    outs = {"a": [5], "b": [9, 9, 11]}
    md = meta([seq("a", pen, outputs=outs["a"]), seq("b", plain, outputs=outs["b"])], eos=2)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        outs = {"a": outs["a"] + [3 + step], "b": outs["b"] + [step]}
        seqs = [seq("a", pen, outputs=outs["a"]), seq("b", plain, outputs=outs["b"])]
        md = md.advance(seqs, eos_token_id=2)
        fresh = meta(seqs, eos=2)
        logits = torch.randn(2, V, generator=g)
        assert md.min_tokens_max == fresh.min_tokens_max
        got = apply_penalties(logits.clone(), md)
        want = apply_penalties(logits.clone(), fresh)
        assert torch.equal(got, want), step
        assert Sampler()(logits, md) == Sampler()(logits, fresh)
        assert md.output_lens == [len(outs["a"]), len(outs["b"])]
    assert md.min_tokens_rows is None        # both rows are past min_tokens by now
    # A row that gained two tokens since (a step it skipped sampling) is built afresh.
    skipped = [seq("a", pen, outputs=outs["a"] + [1, 1]), seq("b", plain, outputs=outs["b"] + [1])]
    assert md.advance(skipped) is None


def test_token_masks_unpack_xgrammar_bitmasks():
    """Bit b of word w allows token 32 w + b (xgrammar's layout, packed here by hand with
    int32 wrap-around for bit 31); rows not named are unconstrained; the words past V are
    ignored."""
    allowed = {0: {3, 31, 32, 49}, 2: {40}}
    words = torch.zeros(2, 2, dtype=torch.int32)
    for j, toks in enumerate(allowed.values()):
        for t in toks | {63}:                              # 63 is past V = 50
            w = int(words[j, t // 32]) | (1 << (t % 32))
            words[j, t // 32] = w - (1 << 32) if w >= 1 << 31 else w
    masks = TokenMasks(rows=list(allowed), bitmask=words)
    unpacked = masks.allowed(V, torch.device("cpu"))
    assert [set(torch.nonzero(r).flatten().tolist()) for r in unpacked] == list(allowed.values())
    greedy = SamplingParams(temperature=0.0)
    logits = torch.zeros(3, V)
    logits[:, 7] = 5.0                                     # the favourite, allowed nowhere
    logits[0, 31] = 1.0
    md = meta([seq(r, greedy) for r in "abc"])
    assert [t.token_id for t in Sampler()(logits, md, masks)] == [31, 7, 40]


def test_min_tokens_masks_without_a_host_read_when_ids_fit(monkeypatch):
    """Stop ids inside the vocabulary index the logits directly; one past it is dropped (a
    boolean index, whose host read is only paid then)."""
    sp = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[3])
    logits = torch.zeros(1, V)
    logits[0, 3] = 1.0
    md = meta([seq("a", sp, outputs=[1])], eos=4)
    assert md.min_tokens_max == 4
    assert Sampler()(logits, md)[0].token_id != 3
    far = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[3, V + 10])
    md = meta([seq("a", far, outputs=[1])], eos=4)
    assert md.min_tokens_max == V + 10
    assert Sampler()(logits, md)[0].token_id != 3


def test_engine_tokens_do_not_depend_on_reused_metadata(tiny_model_factory, monkeypatch):
    """Greedy, seeded, penalised and min_tokens requests finishing at different steps: the
    same tokens with every step's metadata built afresh."""
    from vllm import LLM
    path = tiny_model_factory("Qwen3MoeForCausalLM")
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 200, (int(n),), generator=g).tolist()}
               for n in torch.randint(2, 20, (6,), generator=g)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0 if i % 3 == 0 else 0.9,
                             seed=i, min_tokens=2 * (i % 2), ignore_eos=i % 2 == 0,
                             repetition_penalty=1.0 + 0.5 * (i % 4 == 1),
                             frequency_penalty=0.3 * (i == 2))
              for i in range(6)]
    reused = LLM(path, max_num_seqs=4).generate(prompts, params)
    monkeypatch.setattr(SamplingMetadata, "advance", lambda self, seqs, eos=None: None)
    fresh = LLM(path, max_num_seqs=4).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in reused] == [o.outputs[0].token_ids for o in fresh]

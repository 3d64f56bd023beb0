"""Batched token sampling with vLLM semantics.

Order of operations on the [n, V] logits (one row per sequence with ``do_sample``):
raw logprobs (log_softmax of the unmodified logits, vLLM's "raw_logprobs") -> min_tokens
mask (EOS / stop tokens -> -inf) -> repetition penalty (HF style, prompt + output tokens) ->
presence / frequency penalties (output tokens) -> greedy rows take the argmax here ->
temperature -> top-k -> top-p -> min-p -> sample.

Sampling is an exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` is a draw from
``probs``. Seeded rows draw ``q`` from their own ``torch.Generator`` only, so their tokens do
not depend on what else is in the batch; unseeded rows share the global generator.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from vllm.core.sched_output import SampledToken, ScheduledSequence
from vllm.kernels.cpu.ops import argmax_rows
from vllm.platforms import native_kernels, platform_for

_PAD = -1  # padding id in the token tensors; mapped to an extra dropped column


@dataclass
class TokenMasks:
    """Tokens allowed to some of a step's sampled rows (guided decoding): ``bitmask``
    [m, ceil(V / 32)] int32 for the rows ``rows`` (indices into the step's sampled
    sequences), bit b of word w set when token 32 w + b is allowed (xgrammar's layout); other
    rows are unconstrained. Packed, it moves to the device in a 32nd of a bool mask's bytes."""
    rows: list[int]
    bitmask: torch.Tensor

    def allowed(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[m, vocab] bool on ``device``, unpacked there."""
        words = self.bitmask.to(device, non_blocking=True)
        bits = torch.arange(32, dtype=torch.int32, device=device)
        return ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]


@dataclass
class SamplingMetadata:
    req_ids: list[str]
    """Row order: the runner's logits rows follow this (the do_sample sequences, in order)."""
    temperature: torch.Tensor
    """[n] float32; 1.0 on greedy rows so the division is a no-op there."""
    greedy: torch.Tensor
    """[n] bool."""
    all_greedy: bool
    top_k: torch.Tensor | None
    """[n] int64, 0 = disabled; None when no row uses top-k."""
    top_p: torch.Tensor | None
    """[n] float32; None when every row has top_p == 1."""
    min_p: torch.Tensor | None
    """[n] float32; None when every row has min_p == 0."""
    repetition_penalty: torch.Tensor | None
    """[n] float32; None when every row has 1.0 (then the two below are None too)."""
    presence_penalty: torch.Tensor | None
    frequency_penalty: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    """[n, Lp] int64 padded with -1; only when some row has a repetition penalty."""
    output_token_ids: torch.Tensor | None
    """[n, Lo] int64 padded with -1; only when some row has any penalty."""
    min_tokens_rows: torch.Tensor | None
    """[M] int64 row of each (row, token) pair to mask because min_tokens is not reached."""
    min_tokens_tokens: torch.Tensor | None
    """[M] int64 token id of each pair (EOS unless ignore_eos, plus stop_token_ids)."""
    num_logprobs: list[int | None]
    """Per row: top-k logprobs requested (0 = only the sampled token), None = no logprobs."""
    generators: list[torch.Generator | None]
    """Per row: the request's own generator when it has a seed, else None (global RNG)."""
    output_lens: list[int] = field(default_factory=list)
    """Per row: how many output tokens ``output_token_ids`` holds (``advance`` appends one)."""
    min_tokens_max: int = -1
    """The largest id in ``min_tokens_tokens`` (-1: none), known on the host so the sampler
    drops ids past the vocabulary only when there is one, without a device-to-host read."""

    def reusable_for(self, seqs: list[ScheduledSequence]) -> bool:
        """Whether this metadata, built for an earlier step, is also the metadata of a step
        sampling ``seqs``: the same requests decoding in the same order (``_same_rows``) and
        nothing in it that changes from step to step (penalties read the output tokens;
        min_tokens masks change as outputs grow, and once a batch has none it never gets one
        back)."""
        return not self._changes_each_step and self._same_rows([s for s in seqs if s.do_sample])

    @property
    def _changes_each_step(self) -> bool:
        return self.output_token_ids is not None or self.min_tokens_rows is not None

    def _same_rows(self, rows: list[ScheduledSequence]) -> bool:
        """The same requests in the same order, each decoding (a request id reused by a new
        request arrives as a prefill, with no output yet)."""
        return len(rows) == len(self.req_ids) and all(
            s.req_id == r and s.num_tokens == 1 and s.output_token_ids
            for s, r in zip(rows, self.req_ids))

    def advance(self, seqs: list[ScheduledSequence],
                eos_token_id: int | dict[str, int | None] | None = None
                ) -> "SamplingMetadata | None":
        """The metadata of the step sampling ``seqs`` derived from this one (the step
        before's), or None when it must be built afresh. Itself when ``reusable_for``; when
        the same rows each gained exactly one output token, a copy with that token appended
        to ``output_token_ids`` as a column (one [n] upload: the prompt tensor and the
        per-row tensors are kept, so a penalised batch does not re-pad its prompts each step;
        a row's padding may now sit before its last token, which counts ignore) and the
        min_tokens pairs recomputed on the host."""
        rows = [s for s in seqs if s.do_sample]
        if not self._same_rows(rows):
            return None
        if not self._changes_each_step:
            return self                              # reusable_for
        lens = [len(s.output_token_ids) for s in rows]
        outputs = self.output_token_ids
        if outputs is not None:
            if lens != [n + 1 for n in self.output_lens]:
                return None
            last = torch.tensor([s.output_token_ids[-1] for s in rows], dtype=torch.int64)
            outputs = torch.cat([outputs, last.to(outputs.device).unsqueeze(1)], dim=1)
        mt_rows, mt_toks, mt_max = _min_tokens_tensors(rows, eos_token_id, self.greedy.device)
        return dataclasses.replace(self, output_token_ids=outputs, output_lens=lens,
                                   min_tokens_rows=mt_rows, min_tokens_tokens=mt_toks,
                                   min_tokens_max=mt_max)

    @property
    def max_num_logprobs(self) -> int | None:
        ks = [k for k in self.num_logprobs if k is not None]
        return max(ks) if ks else None

    @classmethod
    def build(cls, seqs: list[ScheduledSequence], generators: dict[str, torch.Generator],
              device: torch.device | str,
              eos_token_id: int | dict[str, int | None] | None = None) -> "SamplingMetadata":
        """Metadata for the sequences with ``do_sample`` (others are skipped), in order.

        ``generators`` maps request id -> generator; a seeded request missing from it gets a
        new generator seeded with its ``SamplingParams.seed``, stored back into the dict (the
        runner keeps the dict and drops ids listed in ``SchedulerOutput.finished_req_ids``).
        ``eos_token_id`` is one id for all rows or a per-request mapping (for min_tokens).
        """
        device = torch.device(device)
        rows = [s for s in seqs if s.do_sample]
        sps = [s.sampling_params for s in rows]
        greedy = [sp.greedy for sp in sps]
        rep = [sp.repetition_penalty for sp in sps]
        pres = [sp.presence_penalty for sp in sps]
        freq = [sp.frequency_penalty for sp in sps]
        any_rep = any(r != 1.0 for r in rep)
        any_pen = any_rep or any(pres) or any(freq)
        mt_rows, mt_toks, mt_max = _min_tokens_tensors(rows, eos_token_id, device)
        # Every per-row parameter in two uploads ([6, n] f32, [2, n] int64), sliced on the
        # device: a batch that changes builds this each step, and each upload blocks the host.
        # Through page-locked memory where there is some: a plain copy would wait for the
        # device to finish the step in flight (async scheduling builds this one ahead of it).
        upload = platform_for(device).upload
        floats = upload(torch.tensor([[1.0 if g else sp.temperature
                                       for g, sp in zip(greedy, sps)],
                                      [sp.top_p for sp in sps], [sp.min_p for sp in sps], rep,
                                      pres, freq], dtype=torch.float32), device)
        ints = upload(torch.tensor([greedy, [sp.top_k for sp in sps]], dtype=torch.int64),
                      device)
        return cls(
            req_ids=[s.req_id for s in rows],
            temperature=floats[0],
            greedy=ints[0].bool(),
            all_greedy=all(greedy),
            top_k=ints[1] if any(sp.top_k > 0 for sp in sps) else None,
            top_p=floats[1] if any(sp.top_p < 1.0 for sp in sps) else None,
            min_p=floats[2] if any(sp.min_p > 0.0 for sp in sps) else None,
            repetition_penalty=floats[3] if any_pen else None,
            presence_penalty=floats[4] if any_pen else None,
            frequency_penalty=floats[5] if any_pen else None,
            prompt_token_ids=_pad([s.prompt_token_ids for s in rows], device) if any_rep else None,
            output_token_ids=_pad([s.output_token_ids for s in rows], device) if any_pen else None,
            min_tokens_rows=mt_rows,
            min_tokens_tokens=mt_toks,
            num_logprobs=[sp.logprobs for sp in sps],
            generators=_row_generators(rows, generators, device),
            output_lens=[len(s.output_token_ids) for s in rows],
            min_tokens_max=mt_max,
        )


def _row_generators(rows: list[ScheduledSequence], generators: dict[str, torch.Generator],
                    device: torch.device) -> list[torch.Generator | None]:
    """Per row: its request's generator when seeded (made on its first sampled step and kept
    in ``generators``), else None."""
    gens: list[torch.Generator | None] = []
    for s in rows:
        seed = s.sampling_params.seed
        if seed is not None and not s.sampling_params.greedy and s.req_id not in generators:
            generators[s.req_id] = torch.Generator(device=device).manual_seed(seed)
        gens.append(generators.get(s.req_id) if seed is not None else None)
    return gens


def _pad(lists: list[list[int]], device: torch.device) -> torch.Tensor:
    """[n, max_len] int64 padded with -1 (at least one column so scatter has an index)."""
    tensors = [torch.tensor(x, dtype=torch.int64) for x in lists] + [torch.full((1,), _PAD)]
    return pad_sequence(tensors, batch_first=True, padding_value=_PAD)[:-1].to(device)


def _min_tokens_tensors(rows: list[ScheduledSequence], eos: int | dict[str, int | None] | None,
                        device: torch.device
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """The (row, token) pairs to mask as two [M] int64 tensors (None, None when M = 0) and
    the largest token id among them (-1 when none)."""
    mt_rows, mt_toks = _min_tokens_pairs(rows, eos)
    if not mt_rows:
        return None, None, -1
    pairs = torch.tensor([mt_rows, mt_toks], dtype=torch.int64).to(device)   # one upload
    return pairs[0], pairs[1], max(mt_toks)


def _min_tokens_pairs(rows: list[ScheduledSequence],
                      eos: int | dict[str, int | None] | None) -> tuple[list[int], list[int]]:
    mt_rows: list[int] = []
    mt_toks: list[int] = []
    for i, s in enumerate(rows):
        sp = s.sampling_params
        if len(s.output_token_ids) >= sp.min_tokens:
            continue
        row_eos = eos.get(s.req_id) if isinstance(eos, dict) else eos
        toks = set(sp.stop_token_ids or [])
        if row_eos is not None and not sp.ignore_eos:
            toks.add(row_eos)
        mt_rows.extend([i] * len(toks))
        mt_toks.extend(sorted(toks))
    return mt_rows, mt_toks


def _token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, L] ids padded with -1 -> [n, V] float32 occurrence counts."""
    idx = torch.where(ids < 0, vocab, ids).clamp(max=vocab)  # pad and out-of-vocab -> extra col
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """In place on [n, V] logits; returns them."""
    if md.output_token_ids is None:
        return logits
    vocab = logits.shape[1]
    out_counts = _token_counts(md.output_token_ids, vocab)  # [n, V]
    if md.prompt_token_ids is not None:
        seen = (_token_counts(md.prompt_token_ids, vocab) > 0) | (out_counts > 0)
        rep = md.repetition_penalty.unsqueeze(1)  # [n, 1]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    logits -= md.frequency_penalty.unsqueeze(1) * out_counts
    logits -= md.presence_penalty.unsqueeze(1) * (out_counts > 0).float()
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf all but the top-k (ties at the k-th value kept), then all but the smallest
    set whose probability reaches top_p (at least one token kept). [n, V] -> [n, V]."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(1, vocab)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))  # [n, 1] k-th largest
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - top_p).unsqueeze(1)  # tail mass that is not needed to reach p
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _exponential_noise(shape: tuple[int, int], gens: list[torch.Generator | None],
                       device: torch.device) -> torch.Tensor:
    """[n, V] Exp(1) noise; row i comes only from gens[i] when it is set."""
    q = torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    for i, g in enumerate(gens):
        if g is not None:
            q[i].exponential_(generator=g)
    return q.clamp_(min=torch.finfo(torch.float32).tiny)


class Sampler:
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata,
                 token_masks: TokenMasks | None = None) -> list[SampledToken]:
        token_ids, raw_logprobs = self.sample(logits, metadata, token_masks)
        return to_sampled_tokens(token_ids, raw_logprobs, metadata.num_logprobs)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
               token_masks: TokenMasks | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' tokens [n] int64 and, when a row asks for logprobs, the raw logprobs
        [n, V] f32, on the logits' device, with no host read (but for a min_tokens stop id
        past the vocabulary): ``to_sampled_tokens`` reads them."""
        md = metadata
        n, vocab = logits.shape
        if n != len(md.req_ids):
            raise ValueError(f"logits have {n} rows but metadata has {len(md.req_ids)} "
                             "sequences to sample")
        # [n, V] f32. The masks and penalties below write in place: never into the caller's.
        in_place = (md.min_tokens_rows is not None or md.output_token_ids is not None
                    or token_masks is not None)
        logits = logits.to(torch.float32, copy=in_place)
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        if token_masks is not None:
            rows = torch.tensor(token_masks.rows, device=logits.device)
            allowed = token_masks.allowed(vocab, logits.device)
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        if md.min_tokens_rows is not None:
            rows, toks = md.min_tokens_rows, md.min_tokens_tokens
            if md.min_tokens_max >= vocab:   # a stop id past the vocabulary: never sampled
                ok = toks < vocab                # (a boolean index: a host read, rare)
                rows, toks = rows[ok], toks[ok]
            logits[rows, toks] = float("-inf")
        logits = apply_penalties(logits, md)
        token_ids = _argmax(logits)  # [n] greedy choice
        if not md.all_greedy:
            x = logits / md.temperature.unsqueeze(1)
            x = apply_top_k_top_p(x, md.top_k, md.top_p)
            x = apply_min_p(x, md.min_p)
            probs = x.softmax(dim=-1)
            q = _exponential_noise((n, vocab), md.generators, logits.device)
            sampled = (probs / q).argmax(dim=-1)
            token_ids = torch.where(md.greedy, token_ids, sampled)
        return token_ids, raw_logprobs


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """[n, V] f32 -> [n] int64; the C kernel on CPU (torch's argmax is slow on wide rows)."""
    if native_kernels(logits.dtype, logits.device) and logits.shape[1]:
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def to_sampled_tokens(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None,
                      num_logprobs: list[int | None]) -> list[SampledToken]:
    """``Sampler.sample``'s tensors as one SampledToken per row (a host read)."""
    if raw_logprobs is None:
        return [SampledToken(t) for t in token_ids.tolist()]
    return logprob_entries(token_ids, raw_logprobs, num_logprobs)


def logprob_entries(token_ids: torch.Tensor, raw_logprobs: torch.Tensor,
                    num_logprobs: list[int | None]) -> list[SampledToken]:
    """Row i: token_ids[i] with its logprob and rank in raw_logprobs [n, V], and the
    num_logprobs[i] best (token, logprob) pairs (None: the token alone, no logprobs)."""
    ids = token_ids.tolist()
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    ranks = ((raw_logprobs > chosen).sum(dim=-1) + 1).tolist()
    k = max((x for x in num_logprobs if x is not None), default=0)
    top_vals, top_ids = raw_logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    top_vals = top_vals.tolist() if k > 0 else None
    top_ids = top_ids.tolist() if k > 0 else None
    chosen = chosen.squeeze(1).tolist()
    out = []
    for i, t in enumerate(ids):
        nl = num_logprobs[i]
        if nl is None:
            out.append(SampledToken(t))
            continue
        top = list(zip(top_ids[i][:nl], top_vals[i][:nl])) if nl > 0 else []
        out.append(SampledToken(t, logprob=chosen[i], top_logprobs=top, rank=ranks[i]))
    return out


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, num_logprobs: list[int]
                    ) -> list[SampledToken]:
    """logits [m, V] at prompt positions, targets [m] the prompt tokens that follow them: each
    target's raw logprob (log_softmax in float32, as sampled tokens' logprobs) and rank, and
    the top num_logprobs[i] tokens."""
    raw = logits.to(torch.float32).log_softmax(dim=-1)
    return logprob_entries(targets, raw, num_logprobs)

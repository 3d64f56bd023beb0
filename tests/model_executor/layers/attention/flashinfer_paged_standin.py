"""A CPU stand-in for the two ``flashinfer`` paged-KV wrappers the ``flashinfer_paged`` backend
uses, written from FlashInfer 0.7.2's documented contract (``prefill.py`` / ``decode.py``
docstrings): pages ``indices[indptr[i]:indptr[i+1]]`` of ``page_size`` tokens, the last one
holding ``last_page_len[i]``; NHD planes [pages, page_size, kv_heads, head_dim] as a (k, v)
tuple; causal queries aligned to the end of their KV; ``window_left`` inclusive (keys >= p -
window_left); query head h reads kv head h // (Hq // Hkv). It attends in float64 with explicit
loops, records every call (to bind it to the real signatures), and, as FlashInfer's
``use_cuda_graph`` decode wrapper does, copies the plan into the caller's fixed buffers and runs
from them. ``api.in_graph`` set: a plan raises (plans must stay outside captured regions)."""
from __future__ import annotations

from types import SimpleNamespace

import torch


def attend_pages(q, k_cache, v_cache, qo_indptr, indptr, indices, last, page_size, window_left,
                 scale) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] float64 (module docstring)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    Hq, Hkv = q.shape[1], k_cache.shape[2]
    heads = torch.arange(Hq) // (Hq // Hkv)
    for i in range(len(indptr) - 1):
        pages = indices[int(indptr[i]):int(indptr[i + 1])].long()
        kv_len = (len(pages) - 1) * page_size + int(last[i])
        k = k_cache[pages].reshape(-1, Hkv, q.shape[2])[:kv_len].double()
        v = v_cache[pages].reshape(-1, Hkv, q.shape[2])[:kv_len].double()
        s, e = int(qo_indptr[i]), int(qo_indptr[i + 1])
        for j in range(e - s):
            p = j + kv_len - (e - s)                       # bottom-right causal
            lo = 0 if window_left < 0 else max(0, p - window_left)
            for h in range(Hq):
                scores = k[lo:p + 1, heads[h]] @ q[s + j, h].double() * scale
                out[s + j, h] = torch.softmax(scores, 0) @ v[lo:p + 1, heads[h]]
    return out


class _Wrapper:
    kind = ""

    def __init__(self, api, workspace, *args, **kwargs):
        self.api, self.init = api, kwargs
        api.calls.append((f"{self.kind}.__init__", (workspace, *args), kwargs))
        self.plan_args = None

    def plan(self, *args, **kwargs):
        self.api.calls.append((f"{self.kind}.plan", args, kwargs))
        if self.api.in_graph:
            raise AssertionError("plan() inside a captured region")
        self.plan_args = self._store(*args, **kwargs)

    def run(self, q, paged_kv_cache, *args, **kwargs):
        self.api.calls.append((f"{self.kind}.run", (q, paged_kv_cache, *args), kwargs))
        self.api.runs.append((self.kind, paged_kv_cache))
        a = self.plan_args
        k_cache, v_cache = paged_kv_cache
        return attend_pages(q, k_cache, v_cache, a["qo_indptr"], a["indptr"], a["indices"],
                            a["last"], a["page_size"], a["window_left"],
                            a["sm_scale"]).to(q.dtype)


class Prefill(_Wrapper):
    kind = "BatchPrefillWithPagedKVCacheWrapper"

    def _store(self, qo_indptr, indptr, indices, last, hq, hkv, d, page_size, *, causal=False,
               window_left=-1, sm_scale=None, **_):
        assert causal, "the backend's steps are causal"
        return dict(qo_indptr=qo_indptr.clone(), indptr=indptr.clone(), indices=indices.clone(),
                    last=last.clone(), page_size=page_size, window_left=window_left,
                    sm_scale=d ** -0.5 if sm_scale is None else sm_scale)


class Decode(_Wrapper):
    kind = "BatchDecodeWithPagedKVCacheWrapper"

    def _store(self, indptr, indices, last, hq, hkv, d, page_size, *, window_left=-1,
               sm_scale=None, **_):
        i = self.init
        if i.get("use_cuda_graph"):
            bufs = (i["paged_kv_indptr_buffer"], i["paged_kv_indices_buffer"],
                    i["paged_kv_last_page_len_buffer"])
            if len(last) != len(bufs[2]) or len(indices) > len(bufs[1]):
                raise ValueError("batch size or indices exceed the fixed buffers")
            bufs[0].copy_(indptr), bufs[1][:len(indices)].copy_(indices), bufs[2].copy_(last)
            indptr, indices, last = bufs                   # runs read the fixed buffers
        return dict(qo_indptr=torch.arange(len(last) + 1), indptr=indptr, indices=indices,
                    last=last, page_size=page_size, window_left=window_left,
                    sm_scale=d ** -0.5 if sm_scale is None else sm_scale)


def fake_flashinfer() -> SimpleNamespace:
    api = SimpleNamespace(calls=[], runs=[], in_graph=False)
    api.BatchPrefillWithPagedKVCacheWrapper = lambda *a, **k: Prefill(api, *a, **k)
    api.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: Decode(api, *a, **k)
    return api

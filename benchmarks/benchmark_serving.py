"""Online serving benchmark: drives a running `vllm serve` over HTTP and reports TTFT, TPOT,
end-to-end latency (p50/p90/p99) and throughput.

    vllm serve MODEL --port 8000 &
    python benchmarks/benchmark_serving.py --base-url http://127.0.0.1:8000 \
        --num-prompts 64 --input-len 32 --output-len 32 --max-concurrency 16 [--request-rate 8]

Requests are streaming /v1/completions with ignore_eos (every request produces exactly
--output-len tokens, so runs compare). Prompts are random words from a fixed list (seeded);
the prompt and output token counts reported are the server's own (stream usage), not guesses.
Arrivals: --request-rate R sends a Poisson process of R requests/s (inf = all at once);
--max-concurrency caps requests in flight. TTFT = time to the first streamed token;
TPOT = (latency - TTFT) / (output tokens - 1).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass

import httpx

WORDS = ("the of and to in is that for it as with was on be by at this from or have an are "
         "not but what all were when we there can more if no out so said use each which she "
         "do how their will up other about many then them these some her would make like him "
         "into time has look two write go see number way could people my than first water "
         "been call who oil its now find long down day did get come made may part").split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    start = time.perf_counter()
    ttft = None
    usage = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return Result(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result(False, error=str(event["error"])[:200])
                if ttft is None and any(c.get("text") for c in event.get("choices", [])):
                    ttft = time.perf_counter() - start
                usage = event.get("usage") or usage
    except httpx.HTTPError as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - start
    if usage is None:
        return Result(False, error="no usage in the stream")
    return Result(True, ttft if ttft is not None else latency, latency,
                  usage["prompt_tokens"], usage["completion_tokens"])


async def run(args) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get(args.base_url + "/v1/models")).json()["data"][0]["id"]
        url = args.base_url + "/v1/completions"
        prompts = make_prompts(args.num_prompts, args.input_len, args.seed)

        def body(p: str) -> dict:
            return {"model": model, "prompt": p, "max_tokens": args.output_len,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
        await one_request(client, url, {**body(prompts[0]), "max_tokens": 2})  # warm-up
        sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
        rng = random.Random(args.seed + 1)

        async def limited(p: str) -> Result:
            async with sem:
                return await one_request(client, url, body(p))
        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float]:
    """Mean and nearest-rank-interpolated p50/p90/p99 (linear between order statistics)."""
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan")}
    s = sorted(values)

    def q(p: float) -> float:
        pos = (len(s) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)
    return {"mean": sum(s) / len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(results: list[Result], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed, "output_token_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "mean_prompt_tokens": in_tokens / max(1, len(ok)),
        "mean_output_tokens": out_tokens / max(1, len(ok)),
        "ttft_ms": {k: v * 1e3 for k, v in percentiles([r.ttft for r in ok]).items()},
        "tpot_ms": {k: v * 1e3 for k, v in percentiles(tpot).items()},
        "e2e_ms": {k: v * 1e3 for k, v in percentiles([r.latency for r in ok]).items()},
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def print_summary(s: dict) -> None:
    print(f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s")
    print(f"mean prompt tokens {s['mean_prompt_tokens']:.1f}  mean output tokens "
          f"{s['mean_output_tokens']:.1f}")
    print(f"throughput: {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} "
          f"output tok/s, {s['total_token_throughput']:.1f} total tok/s")
    print(f"{'':8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (ms)")
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        v = s[name]
        print(f"{name[:-3].upper():8}" + "".join(f"{v[k]:10.1f}" for k in
                                                  ("mean", "p50", "p90", "p99")))
    for e in s["errors"]:
        print(f"error: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    p.add_argument("--input-len", type=int, default=32, help="words per prompt")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (default: inf = all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--json-out", default=None, help="also write the summary to this file")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error(f"--max-concurrency={args.max_concurrency} is invalid: must be >= 1")
    if not args.request_rate > 0:
        p.error(f"--request-rate={args.request_rate} is invalid: must be > 0 (inf allowed)")
    results, elapsed = asyncio.run(run(args))
    summary = summarize(results, elapsed)
    print_summary(summary)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), **summary}, f, indent=2, default=str)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

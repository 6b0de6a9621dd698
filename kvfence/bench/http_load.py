"""`kvfence bench --url URL`: N streaming requests, C at a time, against any OpenAI-compatible
server (kvfence, vLLM, llama.cpp's server, ...), reporting throughput, time to first token and
inter-token latency percentiles. The same workload against two servers gives ratios you can
quote; absolute times on a shared machine are noise.

Prompts are text built from a fixed word list, so any server accepts them; exact token counts
come from the server's `usage` (stream_options.include_usage) when it reports them. Output
length is asked for with max_tokens and `ignore_eos` (a vLLM/kvfence extension; other servers
ignore it and may stop early, which the report shows).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import ssl
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from kvfence.bench.stats import percentiles

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
          "point government company number group problem fact river mountain garden window music story "
          "paper letter morning evening table light water market city village ocean forest summer winter").split()


@dataclass
class Sample:
    ok: bool
    error: str | None = None
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    latency: float = 0.0


@dataclass
class Report:
    url: str
    model: str
    endpoint: str
    num_requests: int
    concurrency: int
    prompt_words: int
    max_tokens: int
    seconds: float
    ok: int
    errors: dict
    output_tokens: int
    prompt_tokens: int | None
    output_tps: float
    requests_per_s: float
    ttft_ms: dict
    itl_ms: dict
    tpot_ms: dict
    latency_ms: dict


def make_prompt(i: int, words: int, seed: int = 0) -> str:
    rng = random.Random(seed * 1_000_003 + i)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def sse_messages(response: httpx.Response):
    """The JSON messages of an OpenAI-style server-sent-event stream, up to [DONE]."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def _one(client: httpx.AsyncClient, url: str, body: dict, chat: bool, timeout: float) -> Sample:
    start = time.perf_counter()
    s = Sample(ok=False)
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                await r.aread()
                s.error = f"HTTP {r.status_code}"
                return s
            async for msg in sse_messages(r):
                if "error" in msg:
                    s.error = str(msg["error"].get("code") or "stream error")
                    return s
                if msg.get("usage"):
                    s.completion_tokens = msg["usage"].get("completion_tokens", s.completion_tokens)
                    s.prompt_tokens = msg["usage"].get("prompt_tokens")
                for ch in msg.get("choices", []):
                    text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    if text:
                        now = time.perf_counter()
                        if s.ttft is None:
                            s.ttft = now - start
                        s.chunk_times.append(now)
        s.ok = s.ttft is not None or s.completion_tokens > 0
        if not s.ok:
            s.error = "no output"
        if not s.completion_tokens:
            s.completion_tokens = len(s.chunk_times)  # server reported no usage: count chunks
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        s.error = type(e).__name__
    finally:
        s.latency = time.perf_counter() - start
    return s


class LoadError(RuntimeError):
    """The target cannot be benchmarked as asked: said in one line, not a traceback."""


async def run_load(url: str, num_requests: int, concurrency: int, prompt_words: int, max_tokens: int,
                   model: str | None = None, api_key: str | None = None, endpoint: str = "completions",
                   timeout: float = 600.0, seed: int = 0, verify: ssl.SSLContext | bool = True) -> Report:
    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout, verify=verify) as client:
        if model is None:
            r = await client.get(base + "/models")
            if r.status_code == 401:
                raise LoadError(f"{base}/models answered 401: the server wants an API key; pass --api-key KEY "
                                "(or set OPENAI_API_KEY)")
            try:
                r.raise_for_status()
                model = r.json()["data"][0]["id"]
            except (httpx.HTTPStatusError, ValueError, KeyError, IndexError, TypeError):
                raise LoadError(f"{base}/models answered {r.status_code} {r.text[:200]!r}: is that an "
                                "OpenAI-compatible server? (--model-name skips this question)") from None
        chat = endpoint == "chat"
        target = base + ("/chat/completions" if chat else "/completions")

        def body(i: int) -> dict:
            b = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                 "stream_options": {"include_usage": True}, "ignore_eos": True}
            p = make_prompt(i, prompt_words, seed)
            if chat:
                b["messages"] = [{"role": "user", "content": p}]
            else:
                b["prompt"] = p
            return b

        # warm-up, not measured; a prompt none of the measured requests shares
        await _one(client, target, {**body(num_requests + 1), "max_tokens": 2}, chat, timeout)
        gate = asyncio.Semaphore(concurrency)

        async def gated(i: int) -> Sample:
            async with gate:
                return await _one(client, target, body(i), chat, timeout)

        start = time.perf_counter()
        samples = await asyncio.gather(*(gated(i) for i in range(num_requests)))
        seconds = time.perf_counter() - start
    good = [s for s in samples if s.ok]
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            errors[s.error or "error"] = errors.get(s.error or "error", 0) + 1
    out = sum(s.completion_tokens for s in good)
    prompts = [s.prompt_tokens for s in good if s.prompt_tokens is not None]
    itl = [b - a for s in good for a, b in zip(s.chunk_times, s.chunk_times[1:])]
    tpot = [(s.chunk_times[-1] - s.chunk_times[0]) / (s.completion_tokens - 1)
            for s in good if s.completion_tokens > 1 and len(s.chunk_times) > 1]
    return Report(url, model, endpoint, num_requests, concurrency, prompt_words, max_tokens, round(seconds, 3),
                  len(good), errors, out, sum(prompts) if len(prompts) == len(good) else None,
                  round(out / seconds, 2), round(len(good) / seconds, 3),
                  percentiles([s.ttft for s in good if s.ttft is not None]), percentiles(itl), percentiles(tpot),
                  percentiles([s.latency for s in good]))


def format_report(r: Report) -> str:
    lines = [
        f"{r.url} model={r.model} endpoint={r.endpoint}: {r.num_requests} requests, {r.concurrency} concurrent, "
        f"~{r.prompt_words}-word prompts, max_tokens={r.max_tokens}, greedy",
        f"  {r.ok} ok, errors {r.errors or 'none'}, {r.seconds:.2f} s",
        f"  throughput  {r.output_tps:.1f} output tok/s, {r.requests_per_s:.2f} req/s"
        + (f", {r.prompt_tokens} prompt tokens" if r.prompt_tokens is not None else ""),
        f"  TTFT ms     {r.ttft_ms}",
        f"  ITL ms      {r.itl_ms}   (gaps between streamed chunks)",
        f"  TPOT ms     {r.tpot_ms}   (per output token after the first)",
        f"  latency ms  {r.latency_ms}",
    ]
    return "\n".join(lines)


def main(args) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)   # not one line per request
    conc = args.concurrency or args.num_requests
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        report = asyncio.run(run_load(args.url, args.num_requests, conc, args.prompt_tokens, args.output_tokens,
                                      args.model_name, key, args.endpoint, args.timeout,
                                      verify=args.tls_ca or True))
    except LoadError as e:
        print(f"error: {args.url}: {str(e) or type(e).__name__}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
        from kvfence.bench.plot import write_next_to

        write_next_to(args.json, asdict(report), f"kvfence bench --url {args.url}")
    return 0 if report.ok == report.num_requests else 1

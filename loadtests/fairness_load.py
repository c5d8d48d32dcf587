"""The fairness scenario's client: streamed completions, each tenant with its own key on its own adapter; a closed
loop that finds the saturation rate, and open-loop Poisson arrivals per tenant, fixed by the seed.

Every request is bounded by a timeout (counted), the requests in flight by a cap (arrivals past it are shed and
counted), and the wait after the last arrival by the timeout. Loopback only.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx

from loadtests.fairness_report import Record
from loadtests.generator import LOOPBACK


@dataclass(frozen=True)
class Caller:
    """A tenant as the client sees it: its API key and the adapter it calls."""

    tenant: str
    key: str
    model: str


@dataclass(frozen=True)
class Planned:
    at_s: float
    caller: Caller
    prompt: str
    max_tokens: int | None = None
    """None: the run's."""


def poisson_times(rate_rps: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration_s) of a Poisson process of rate_rps."""
    times, at = [], rng.expovariate(rate_rps)
    while at < duration_s:
        times.append(at)
        at += rng.expovariate(rate_rps)
    return times


def plan_arrivals(rates: dict[Caller, float], prompts: list[str], duration_s: float, seed: int,
                  own_prompts: dict[Caller, list[str]] | None = None, max_tokens: dict[Caller, int] | None = None,
                  bursts: dict[Caller, int] | None = None) -> list[Planned]:
    """Every tenant's arrivals and prompts from its own generator (seeded by the run's seed and the tenant's
    name), so a light tenant's requests are the same in every run, with or without the heavy one. A caller in
    `bursts` sends that many requests at once, its bursts a Poisson process of its rate over that many (its share,
    in bursts); one in `own_prompts` draws from its own; one in `max_tokens` asks that many."""
    plan = []
    for caller, rate in rates.items():
        rng = random.Random(f"{seed}/{caller.tenant}")
        burst = (bursts or {}).get(caller, 1)
        pool = (own_prompts or {}).get(caller, prompts)
        tokens = (max_tokens or {}).get(caller)
        plan += [Planned(t, caller, rng.choice(pool), tokens) for t in poisson_times(rate / burst, duration_s, rng)
                 for _ in range(burst)]
    return sorted(plan, key=lambda p: p.at_s)


def log(msg: str) -> None:
    """Progress on stderr, timestamped, so a long run shows where it is."""
    print(f"[loadtest {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def stream_one(client: httpx.AsyncClient, caller: Caller, prompt: str, max_tokens: int, rec: Record,
                     t0: float, timeout_s: float) -> None:
    """One streamed greedy completion into rec: status, first token, every text chunk's arrival, usage."""
    body = {"model": caller.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    headers = {"authorization": f"Bearer {caller.key}", "serve_multiplexed_model_id": caller.model}
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    rec.outcome = str(r.status_code)
                    return
                await _read_events(r, rec, start, t0)
                if rec.outcome == "unanswered":
                    rec.outcome = "incomplete"  # the stream ended without [DONE]
    except (TimeoutError, httpx.TimeoutException):
        rec.outcome = "timeout"
    except httpx.HTTPError as e:
        rec.outcome = type(e).__name__
    if rec.outcome != "200" and rec.chunk_s and not rec.tokens:
        rec.tokens = len(rec.chunk_s)  # cut off before its usage chunk: one token per text chunk


async def _read_events(r: httpx.Response, rec: Record, start: float, t0: float) -> None:
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            rec.outcome = "200" if rec.outcome == "unanswered" else rec.outcome
            return
        event = json.loads(data)
        if "error" in event:
            rec.outcome = "stream-error"
            continue
        now, choices = time.perf_counter(), event.get("choices", [])
        if any(c.get("text") for c in choices):
            rec.chunk_s.append(now - t0)
        if rec.ttft_s is None and (any(c.get("text") or c.get("finish_reason") for c in choices)
                                   or (event.get("usage") or {}).get("completion_tokens")):
            rec.ttft_s = now - start  # an answer whose tokens are no text (an end of text first) ends with its first
        if event.get("usage"):  # on every chunk (continuous_usage_stats): the counts so far
            rec.tokens = event["usage"]["completion_tokens"]
            rec.prompt_tokens = event["usage"].get("prompt_tokens", 0)
            rec.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _client(url: str, max_in_flight: int, timeout_s: float) -> httpx.AsyncClient:
    if urlparse(url).hostname not in LOOPBACK:
        raise ValueError(f"load tests target loopback only, not {url}")
    limits = httpx.Limits(max_connections=max_in_flight + 8, max_keepalive_connections=64)
    return httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits)


async def saturation(url: str, callers: list[Caller], prompts: list[str], max_tokens: int, concurrency: int,
                     probe_s: float, timeout_s: float, seed: int) -> dict:
    """Closed loop of `concurrency` workers, each cycling through the tenants, their starts spread over the first
    third of probe_s (which fills the batch); requests/s over the last two thirds, from the tokens streamed there
    over the tokens a request gets. Spread, rows join and finish a few a step, as the open loop's Poisson arrivals
    do; started at once, they ran in lockstep waves of max_batch (one step writing every prompt, then decode
    alone), a traffic the runs never send, and a window counting whole completions moved by a wave: this probe
    gave 4.40 then 3.62 req/s on one machine."""
    rng, records = random.Random(f"{seed}/probe"), []
    skip = probe_s / 3
    async with _client(url, concurrency, timeout_s) as client:
        t0 = time.perf_counter()

        async def worker(i: int) -> None:
            await asyncio.sleep(i * skip / concurrency)
            for n in range(1_000_000):  # bounded; ends on time long before
                if time.perf_counter() >= t0 + probe_s:
                    return
                caller = callers[(i + n) % len(callers)]
                rec = Record(caller.tenant, time.perf_counter() - t0)
                await stream_one(client, caller, rng.choice(prompts), max_tokens, rec, t0, timeout_s)
                records.append(rec)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return {**probe_rate(records, skip, probe_s), "concurrency": concurrency, "probe_s": probe_s}


def probe_rate(records: list[Record], start_s: float, end_s: float) -> dict:
    """Requests/s served in [start_s, end_s]: the tokens streamed there (a request straddling an end counts the
    tokens on its side) over the tokens an answered request got."""
    ok = [r for r in records if r.outcome == "200" and r.tokens]
    per_request = sum(r.tokens for r in ok) / len(ok) if ok else 0.0
    tokens = sum(r.chunk_tokens() for r in records for at in r.chunk_s if start_s <= at <= end_s)
    tokens_per_s = tokens / (end_s - start_s)
    return {"completed_rps": tokens_per_s / per_request if per_request else 0.0, "tokens_per_s": tokens_per_s,
            "requests": len(records), "not_ok": sum(r.outcome != "200" for r in records),
            "tokens_per_request": per_request}


async def open_loop(url: str, plan: list[Planned], max_tokens: int, timeout_s: float, max_in_flight: int,
                    progress_s: float = 15.0) -> list[Record]:
    """Send the plan at its times; then wait for what is in flight (each request ends by its timeout)."""
    records = [Record(p.caller.tenant, p.at_s) for p in plan]
    in_flight: set[asyncio.Task] = set()
    async with _client(url, max_in_flight, timeout_s) as client:
        t0 = next_log = time.perf_counter()
        for p, rec in zip(plan, records):
            await asyncio.sleep(max(0.0, t0 + p.at_s - time.perf_counter()))
            if time.perf_counter() >= next_log + progress_s:
                next_log = time.perf_counter()
                log(f"  {p.at_s:.0f} s: {len(in_flight)} in flight")
            if len(in_flight) >= max_in_flight:
                rec.outcome = "shed"
                continue
            task = asyncio.create_task(stream_one(client, p.caller, p.prompt, p.max_tokens or max_tokens, rec, t0,
                                                  timeout_s))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            log(f"  arrivals done; waiting for {len(in_flight)} in flight (at most {timeout_s:g} s)")
            await asyncio.wait(set(in_flight), timeout=timeout_s + 5)
        for task in set(in_flight):  # past their own timeout: should not happen; counted as unanswered
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
    return records

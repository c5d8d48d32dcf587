"""The tenants scenario's load: open-loop Poisson arrivals of `/v1/completions` over N tenants drawn from a
power law (Zipf, S-LoRA's alpha = 1) or uniformly, real prompts (Debian fortunes), 16-64 generated tokens each.

A measurement is a fixed window: requests arrive for `duration_s`; what is answered 200 inside the window counts
(throughput = those / the window), what is still unanswered when it closes is counted and cancelled, never
waited for. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from loadtests.generator import LOOPBACK, zipf_weights
from serve.bench.report import percentile

DISTRIBUTIONS = ("zipf", "uniform")
MAX_PROMPT_CHARS = 200
"""Short real prompts (about 10-50 tokens): the work is generation, as in S-LoRA's decode-bound runs."""


@dataclass(frozen=True)
class TenantLoad:
    rate_rps: float = 4.0
    duration_s: float = 45.0
    distribution: str = "zipf"
    alpha: float = 1.0
    min_tokens: int = 16
    max_tokens: int = 64
    seed: int = 0


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """A window's flags, with TenantLoad's defaults: --duration, --rate, --min-tokens, --max-tokens."""
    d = TenantLoad()
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of arrivals per measurement")
    p.add_argument("--rate", type=float, default=d.rate_rps, help="offered requests/s (above every system's ceiling)")
    p.add_argument("--min-tokens", type=int, default=d.min_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)


@dataclass(frozen=True)
class Planned:
    at_s: float
    model: str
    prompt: str
    max_tokens: int


def draw_tenants(n: int, k: int, distribution: str, alpha: float, rng: random.Random) -> list[int]:
    """k tenant indices in [0, n): Zipf (weight of the i-th most popular proportional to 1 / i^alpha, which
    tenant is i-th shuffled by rng) or uniform."""
    if distribution == "uniform":
        return [rng.randrange(n) for _ in range(k)]
    if distribution != "zipf":
        raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, got {distribution!r}")
    order = list(range(n))
    rng.shuffle(order)
    return rng.choices(order, zipf_weights(n, alpha), k=k)


def plan_requests(names: list[str], prompts: list[str], load: TenantLoad) -> list[Planned]:
    """The window's arrivals, fixed by the seed: the same for every system measured with it."""
    rng = random.Random(load.seed)
    times, at = [], rng.expovariate(load.rate_rps)
    while at < load.duration_s:
        times.append(at)
        at += rng.expovariate(load.rate_rps)
    picks = draw_tenants(len(names), len(times), load.distribution, load.alpha, rng)
    return [Planned(t, names[i], rng.choice(prompts), rng.randint(load.min_tokens, load.max_tokens))
            for t, i in zip(times, picks)]


def fortune_prompts(max_chars: int = MAX_PROMPT_CHARS) -> list[str]:
    """Held-out Debian fortunes (the test split) of at most max_chars, in a fixed order."""
    from serve.data.datasets import fortunes

    return sorted({q for q in fortunes("test") if len(q) <= max_chars})


@dataclass
class Window:
    """Every planned request's outcome: "200", another status, a transport error, or "unanswered"."""

    duration_s: float
    outcomes: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    served: list[str] = field(default_factory=list)
    """Model of each request answered 200 in the window."""
    completion_tokens: int = 0

    def summary(self) -> dict:
        counts = Counter(self.outcomes)
        ok = counts.get("200", 0)
        return {"sent": len(self.outcomes), "ok": ok, "unanswered": counts.get("unanswered", 0),
                "errors": len(self.outcomes) - ok - counts.get("unanswered", 0), "outcomes": dict(counts),
                "throughput_rps": ok / self.duration_s, "tokens_per_s": self.completion_tokens / self.duration_s,
                "completion_tokens": self.completion_tokens, "p50_s": percentile(self.latencies_s, 0.5),
                "p99_s": percentile(self.latencies_s, 0.99), "distinct_served": len(set(self.served))}


async def _send(client: httpx.AsyncClient, req: Planned, window: Window, i: int) -> None:
    body = {"model": req.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    try:
        r = await client.post("/v1/completions", json=body, headers={"serve_multiplexed_model_id": req.model})
    except httpx.HTTPError as e:
        window.outcomes[i] = type(e).__name__
        return
    window.outcomes[i] = str(r.status_code)
    if r.status_code == 200:
        window.latencies_s.append(time.perf_counter() - t0)
        window.served.append(req.model)
        window.completion_tokens += r.json()["usage"]["completion_tokens"]


async def run_window(url: str, plan: list[Planned], duration_s: float, timeout_s: float = 600.0) -> Window:
    """Send the plan at its times; when duration_s has passed, cancel what is unanswered and count it."""
    if urlparse(url).hostname not in LOOPBACK:
        raise ValueError(f"load tests target loopback only, not {url}")
    window = Window(duration_s, outcomes=["unanswered"] * len(plan))
    limits = httpx.Limits(max_connections=len(plan) + 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start, tasks = time.perf_counter(), []
        for i, req in enumerate(plan):
            await asyncio.sleep(max(0.0, start + req.at_s - time.perf_counter()))
            tasks.append(asyncio.create_task(_send(client, req, window, i)))
        await asyncio.sleep(max(0.0, start + duration_s - time.perf_counter()))
        frozen = Window(duration_s, list(window.outcomes), list(window.latencies_s), list(window.served),
                        window.completion_tokens)  # what the window holds when it closes
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return frozen

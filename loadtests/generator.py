"""An open-loop load generator: Poisson arrivals at a fixed rate for a fixed time, each request for a
Zipf-chosen variant, bounded in-flight requests and a per-request timeout; loopback only."""

import asyncio
import random
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def free_port() -> int:
    """A free port on loopback for Serve's HTTP proxy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LoadSpec:
    rate_rps: float = 20.0
    duration_s: float = 30.0
    zipf_s: float = 1.1
    max_in_flight: int = 64
    timeout_s: float = 30.0
    seed: int = 0


@dataclass
class LoadResult:
    latencies_s: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    sent: int = 0

    def summary(self) -> dict:
        ok = sorted(self.latencies_s)

        def pct(p: float) -> float:
            return ok[min(len(ok) - 1, int(p * len(ok)))] if ok else float("nan")

        return {"sent": self.sent, "ok": len(ok), "errors": self.sent - len(ok), "statuses": self.statuses,
                "throughput_rps": len(ok) / self.wall_s if self.wall_s else 0.0,
                "p50_s": pct(0.50), "p95_s": pct(0.95), "p99_s": pct(0.99),
                "mean_s": statistics.fmean(ok) if ok else float("nan")}


@contextmanager
def loopback_serve() -> Iterator[str]:
    """Ray on 2 CPUs and Serve's HTTP proxy on a free loopback port for the block: -> its URL; both shut down
    after it, whatever happened."""
    import serve.deployments  # noqa: F401  (Ray on loopback: before ray is imported)
    import ray
    from ray import serve

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (i + 1) ** s for i in range(n)]
    total = sum(w)
    return [x / total for x in w]


async def run_load(url: str, variants: list[str], texts: dict[str, list[str]], spec: LoadSpec) -> LoadResult:
    """texts: per variant, the inputs to draw from. Every request is POST /v1/classify."""
    if urlparse(url).hostname not in LOOPBACK:
        raise ValueError(f"load tests target loopback only, not {url}")
    rng = random.Random(spec.seed)
    order = variants[:]
    rng.shuffle(order)  # which variant is hot is arbitrary, but fixed by the seed
    weights = zipf_weights(len(order), spec.zipf_s)
    n = int(spec.rate_rps * spec.duration_s)
    gaps = [rng.expovariate(spec.rate_rps) for _ in range(n)]
    picks = rng.choices(order, weights, k=n)
    result = LoadResult(sent=n)
    gate = asyncio.Semaphore(spec.max_in_flight)
    limits = httpx.Limits(max_connections=spec.max_in_flight)

    async with httpx.AsyncClient(base_url=url, timeout=spec.timeout_s, limits=limits) as client:
        async def one(model: str) -> None:
            async with gate:
                body = {"model": model, "input": rng.choice(texts[model])}
                t0 = time.perf_counter()
                try:
                    r = await client.post("/v1/classify", json=body, headers={"serve_multiplexed_model_id": model})
                    key = str(r.status_code)
                    if r.status_code == 200:
                        result.latencies_s.append(time.perf_counter() - t0)
                except httpx.HTTPError as e:
                    key = type(e).__name__
                result.statuses[key] = result.statuses.get(key, 0) + 1

        start = time.perf_counter()
        tasks, at = [], start
        for gap, model in zip(gaps, picks):
            at += gap
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(model)))
        await asyncio.gather(*tasks)
        result.wall_s = time.perf_counter() - start
    return result

"""`manyfold bench generation`: what continuous batching buys a causal LM base and its variants.

One engine on the demo store's SmolLM2 (the base and every model the store serves on it: its FM-Delta fine-tunes,
PiSSA adapters and EMR tasks, all resident after a warm-up),
the same open-loop Poisson arrivals of chat completions spread over those models, run twice side by side:
  one-at-a-time   max_batch_size 1: every request generates alone (each variant still its own group)
  continuous      max_batch_size 16: a variant's requests share one running batch, joining between steps
Reported per mode: completed requests, generated tokens per second, latency p50/p99, rows per forward.
"""

import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from serve.bench.report import machine
from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams

PROMPTS = ["Give me one short piece of advice.", "Tell me about the sea.", "What is a good breakfast?",
           "Write one line about autumn.", "Why do cats sleep so much?", "Name a famous bridge."]
MODES = {"one-at-a-time": 1, "continuous": 16}


async def _load(engine: Engine, models: list[str], rate: float, duration_s: float, max_tokens: int,
                seed: int) -> dict:
    rng = random.Random(seed)
    n = int(rate * duration_s)
    arrivals = [(rng.expovariate(rate), rng.choice(models), rng.choice(PROMPTS)) for _ in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    latencies: list[float] = []
    tokens = 0

    async def one(model: str, prompt: str) -> None:
        nonlocal tokens
        t0 = time.perf_counter()
        gen = await engine.complete(model, params, messages=[{"role": "user", "content": prompt}])
        latencies.append(time.perf_counter() - t0)
        tokens += gen.completion_tokens

    forwards_before = (engine.batch_sizes.count, engine.batch_sizes.total)
    start = at = time.perf_counter()
    tasks = []
    for gap, model, prompt in arrivals:
        at += gap
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(model, prompt)))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    forwards = engine.batch_sizes.count - forwards_before[0]
    rows = engine.batch_sizes.total - forwards_before[1]
    lat = sorted(latencies)
    return {"requests": len(lat), "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "p50_s": statistics.median(lat), "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "rows_per_forward": rows / forwards if forwards else 0.0}


def run_generation_bench(store_dir: Path | None, out: Path, rate: float = 4.0, duration_s: float = 30.0,
                         max_tokens: int = 24, seed: int = 0) -> list[dict]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if store_dir is None:
        from serve.demo import build_demo_store

        store_dir = build_demo_store().root
    rows = []
    for mode, batch in MODES.items():
        engine = Engine(ServeConfig(store=store_dir, batch={"max_batch_size": batch}), bases=["smollm2"])
        variants = [v for v in engine.catalog.snapshot.manifest.variants.values() if v.base == "smollm2"]
        models = ["smollm2", *(m for v in variants for m in v.models())]  # an EMR group serves its tasks
        kinds = {k: sum(v.kind == k for v in variants for _ in v.models()) for k in sorted({v.kind for v in variants})}

        async def measure() -> dict:
            for m in models:  # decode the variants and warm every code path before the clock starts
                await engine.complete(m, SamplingParams(max_tokens=2), prompt="Hello")
            return await _load(engine, models, rate, duration_s, max_tokens, seed)

        rows.append({"mode": mode, "max_batch_size": batch, "models": models, "kinds": kinds,
                     **asyncio.run(measure())})
    print(f"machine: {machine()}")
    print(f"SmolLM2-135M base + {len(rows[0]['models']) - 1} variants ({rows[0]['kinds']}), chat completions of "
          f"{max_tokens} greedy tokens, Poisson {rate} req/s for {duration_s} s, uniform over the models")
    print(f"{'mode':<15} {'done':>6} {'tok/s':>8} {'p50 s':>8} {'p99 s':>8} {'rows/fwd':>9}")
    for r in rows:
        print(f"{r['mode']:<15} {r['requests']:>6} {r['tokens_per_s']:>8.1f} {r['p50_s']:>8.2f} {r['p99_s']:>8.2f} "
              f"{r['rows_per_forward']:>9.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "rate_rps": rate, "duration_s": duration_s,
                               "max_tokens": max_tokens, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return rows

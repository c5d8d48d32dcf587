"""`python -m loadtests.burst`: what a burst of requests over adapters of mixed ranks and targets costs against the
same burst on the base, over HTTP (issue 34's check).

A store holds SmolLM2-135M-Instruct (the packaged model, fp32) and 8 LoRA adapters: four of rank 16 on every
linear layer, four of rank 8 on q_proj and v_proj (trained-looking random weights: A ~ 1/sqrt(in), B small;
throughput does not depend on what they learned). The server runs on Ray on loopback (2 CPUs, its replica with 2
torch threads, batches of 16 rows). A burst is 16 greedy completions of 24 tokens sent at once, request i on
adapter i % 8 (or every request on the base), prompts the held-out fortunes; the two bursts take turns,
`--repeats` times each, after one warm-up of each. Printed: each burst's median seconds and generated tokens, and
the adapters' burst over the base's. JSON: bench-results/burst.json.
"""

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from loadtests.generator import loopback_serve

BASE = "smollm2"
ADAPTERS = 8
REQUESTS = 16
TOKENS = 24


def build_store(log=print) -> tuple[Path, list[str]]:
    """The store, built once under $MANYFOLD_HOME/burst."""
    from serve.bench.engine_models import ALL_LINEARS, TARGETS, module_dims, write_adapter
    from serve.data.cache import home
    from serve.data.models import smollm2_dir
    from serve.store.store import Store
    from serve.variants import variant_kind

    root = home() / "burst"
    names = [f"burst-{i}" for i in range(ADAPTERS)]
    if (root / "built.json").is_file():
        return root / "store", names
    store = Store(root / "store", create=True)
    store.add_base(BASE, smollm2_dir())
    for i, name in enumerate(names):
        wide = i < ADAPTERS // 2
        dims = module_dims(smollm2_dir(), ALL_LINEARS if wide else TARGETS)
        variant_kind("lora").add(store, name, BASE, write_adapter(root / "adapters" / name, dims, 16 if wide else 8,
                                                                  seed=i))
    (root / "built.json").write_text(json.dumps({"names": names}) + "\n")
    log(f"store: {root / 'store'} with {len(names)} adapters")
    return root / "store", names


async def burst(url: str, models: list[str], prompts: list[str]) -> tuple[float, int]:
    """Seconds for every request at once, and the tokens they generated."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        async def one(model: str, prompt: str) -> int:
            r = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt,
                                                                "max_tokens": TOKENS, "temperature": 0})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(m, p) for m, p in zip(models, prompts)))
        return time.perf_counter() - t0, sum(tokens)


def main(argv: list[str] | None = None) -> dict:
    from ray import serve

    from loadtests.tenant_load import fortune_prompts
    from serve.app import build_app
    from serve.bench.report import machine
    from serve.config import ServeConfig

    p = argparse.ArgumentParser(prog="python -m loadtests.burst", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench-results/burst.json")
    args = p.parse_args(argv)
    store, names = build_store()
    prompts = fortune_prompts()[:REQUESTS]
    plans = {"base": [BASE] * REQUESTS, "adapters": [names[i % ADAPTERS] for i in range(REQUESTS)]}
    runs: dict[str, list[tuple[float, int]]] = {k: [] for k in plans}
    with loopback_serve() as url:
        config = ServeConfig(store=store, deployment={"num_cpus": 2, "torch_threads": 2},
                             batch={"max_batch_size": REQUESTS})
        serve.run(build_app(config), name="burst", route_prefix="/", logging_config={"log_level": "WARNING"})
        for label, models in plans.items():  # warm: every adapter loaded and staged once
            asyncio.run(burst(url, models, prompts))
        for _ in range(args.repeats):
            for label, models in plans.items():
                runs[label].append(asyncio.run(burst(url, models, prompts)))
    median = {k: statistics.median(s for s, _ in v) for k, v in runs.items()}
    report = {"machine": machine(), "requests": REQUESTS, "max_tokens": TOKENS, "adapters": ADAPTERS,
              "runs": runs, "median_s": median, "ratio": median["adapters"] / median["base"]}
    print(f"burst of {REQUESTS} greedy requests of {TOKENS} tokens over HTTP, median of {args.repeats} ({machine()})")
    for label, v in runs.items():
        print(f"  {label:<9} {median[label]:6.2f} s   tokens {[n for _, n in v]}   runs {[round(s, 2) for s, _ in v]}")
    print(f"  adapters / base: {report['ratio']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()

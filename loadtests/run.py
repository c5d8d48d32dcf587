"""Manyfold against two baselines under the same Zipf load at the same memory budget; JSON + PNG + table.

    python -m loadtests.run [--scenario full|top2|mixed] [--variants N] [--rate R] [--duration 30] [--budget-models 4] [--repeats 3]
    python -m loadtests.run --scenario tenants [--tenants 5,100,1000,2000] [--systems manyfold,peft,multiplex] ...
    python -m loadtests.run --scenario neuzip [--tenants 8] [--duration 45] [--decoded-mib 0|N|auto] ...
    python -m loadtests.run --scenario fleet [--adapters 8] [--repeats 3]
    python -m loadtests.run --scenario fairness [--duration 60] [--seed 0] [--out bench-results/fairness]
    python -m loadtests.run --scenario structured [--requests 16] [--out bench-results/structured-serve.json]
    python -m loadtests.run --scenario prefix [--system-tokens 1024] [--out bench-results/prefix-serve.json]
    python -m loadtests.run --scenario invariance [--prompts 2] [--out bench-results/invariance.json]
    python -m loadtests.run --scenario nodeloss [--rounds 5] [--out bench-results/nodeloss.json]

Every system gets `budget-models` full models' worth of weight memory: Manyfold holds the base plus a variant
cache of the rest; the LRU baseline and Ray's multiplexing hold that many full fine-tunes. With 20 variants and
a budget of 4, most of the variant set is always cold. Scenario "mixed" (52 variants by default) is about 3/4 LoRA
adapters and 1/4 top-two-layer full fine-tunes; the baselines load each adapter merged into a full model.

Scenario "fairness" (loadtests/fairness.py) measures whether one tenant's flood starves the others: eight tenants by
API key on their own LoRA adapters of SmolLM2 behind `manyfold serve`, seven light ones at 70% of saturation in all,
alone and beside a heavy one at ten times a light one's rate, under `batch.fairness: fcfs` and `vtc`; per tenant its
time to first token (p50/p99), tokens/s and refusals, and its tokens received per second.
"""

import argparse
import asyncio
import importlib
import json
import platform
import re
import sys
import threading
import time
from pathlib import Path

import serve.deployments  # noqa: F401  (Ray on loopback: set before ray is imported)
import psutil
import ray
from ray import serve

from loadtests.baselines import LruServer, multiplex_server
from loadtests.generator import LoadSpec, free_port, run_load
from loadtests.variants import (BASE, SCENARIOS, build_loadtest_store, mix, mix_text, variant_plan,
                                variant_task)
from serve.app import BOARD, build_app
from serve.bench.report import machine
from serve.config import ServeConfig
from serve.data.datasets import CLASSIFICATION

MIB = 1 << 20


class PeakMemory:
    """Peak summed RSS of one Serve application's model replicas, and apart from them its other replicas (an
    HTTP ingress, Manyfold's residency board), every 0.25 s."""

    def __init__(self, app: str):
        self.app, self.peak, self.peak_front, self._stop = app, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> tuple[int, int]:
        models = front = 0
        for p in psutil.process_iter(["cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                if f"ServeReplica:{self.app}:Ingress" in cmd or f"ServeReplica:{self.app}:{BOARD}" in cmd:
                    front += p.memory_info().rss
                elif f"ServeReplica:{self.app}:" in cmd:
                    models += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return models, front

    def _run(self) -> None:
        while not self._stop.is_set():
            models, front = self._rss()
            self.peak, self.peak_front = max(self.peak, models), max(self.peak_front, front)
            self._stop.wait(0.25)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def manyfold_hit_rate(url: str) -> float:
    import httpx

    text = httpx.get(f"{url}/metrics").text
    counts = {m[0]: float(m[1]) for m in re.findall(r'manyfold_cache_events_total\{event="(\w+)"\} ([0-9.e+]+)', text)}
    total = counts.get("hit", 0) + counts.get("miss", 0)
    return counts.get("hit", 0) / total if total else float("nan")


def baseline_hit_rate(url: str) -> float:
    import httpx

    s = httpx.get(f"{url}/stats", headers={"serve_multiplexed_model_id": "x"}).json()
    total = s["hits"] + s["misses"]
    return s["hits"] / total if total else float("nan")


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["throughput_rps"])[(len(runs) - 1) // 2]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["system"] for r in rows]
    a.bar(names, [r["throughput_rps"] for r in rows], color=["#3b7", "#888", "#bbb"])
    a.set_ylabel("completed requests / s")
    a.set_title("throughput")
    width = 0.25
    for i, key in enumerate(("p50_s", "p95_s", "p99_s")):
        b.bar([x + i * width for x in range(len(rows))], [r[key] * 1000 for r in rows], width, label=key[:3])
    b.set_xticks([x + width for x in range(len(rows))], names)
    b.set_ylabel("latency (ms)")
    b.set_yscale("log")
    b.set_title("latency")
    b.legend()
    r = rows[0]
    fig.suptitle(f"{r['variants']} variants ({r['scenario']}: {mix_text(r['mix'], short=True)}), Zipf s={r['zipf_s']}, "
                 f"{r['rate_rps']} req/s offered, budget {r['budget_models']} models")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


OWN_MODULES = {
    "tenants": "tenants",  # LoRA tenants on SmolLM2
    "fleet": "fleet",  # cold and warm starts from S3
    "neuzip": "neuzip",  # SmolLM2 plain and as NeuZip
    "fairness": "fairness",  # a tenant's flood, FCFS and VTC
    "prefix": "prefix",  # system prompts, cached or not
    "invariance": "invariance",  # the same answer in any batch
    "nodeloss": "nodeloss",  # a worker removed under load
    "structured": "structured",  # structured outputs, tools
}
"""Scenarios run by a module of their own (loadtests/<module>.py, its main(argv)), by --scenario."""


def main(argv: list[str] | None = None) -> list[dict] | dict:
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--scenario")
    own = OWN_MODULES.get(pre.parse_known_args(argv)[0].scenario)
    if own is not None:  # a scenario with options of its own
        return importlib.import_module(f"loadtests.{own}").main(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", type=int, default=None, help="default: 20, or 52 for mixed")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="full",
                   help="variants train every weight (full), only the top two layers and the head (top2), or "
                        "mixed: 3/4 LoRA adapters, 1/4 top2 full fine-tunes; tenants: LoRA tenants of SmolLM2 "
                        "(its own options: --scenario tenants --help); neuzip: SmolLM2 plain against NeuZip "
                        "(--scenario neuzip --help); fleet: cold and warm starts from S3 (--scenario fleet --help); "
                        "fairness: a heavy tenant beside seven light ones, FCFS against VTC (--scenario fairness "
                        "--help); structured: JSON schemas, tool calls and vLLM's extras through the clients "
                        "(--scenario structured --help); prefix: tenants' system prompts with prefix caching and "
                        "without (--scenario prefix --help); invariance: the same answers alone and eight at once "
                        "(--scenario invariance --help); nodeloss: a worker removed under load, five times "
                        "(--scenario nodeloss --help)")
    p.add_argument("--rate", type=float, default=None, help="offered requests per second (default: 8, or "
                   f"{SCENARIOS['mixed'].rate_rps:g} for mixed)")
    p.add_argument("--max-chars", type=int, default=None, help="each input is the start of a test text, at most "
                   f"this many characters (default: 2000, or {SCENARIOS['mixed'].max_chars} for mixed)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load per system")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--budget-models", type=int, default=4)
    p.add_argument("--systems", default="manyfold,lru,multiplex")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every system in turn; the table shows "
                   "each system's median run by throughput, the JSON every run")
    p.add_argument("--out", default="bench-results/loadtest")
    args = p.parse_args(argv)
    scenario = SCENARIOS[args.scenario]
    args.variants = scenario.variants if args.variants is None else args.variants
    args.rate = scenario.rate_rps if args.rate is None else args.rate
    args.max_chars = scenario.max_chars if args.max_chars is None else args.max_chars

    store, plain = build_loadtest_store(args.variants, scenario=args.scenario)
    plan = variant_plan(args.variants, args.scenario)
    variants = [v.name for v in plan]
    test_texts = {task: [e.text[:args.max_chars] for e in CLASSIFICATION[task]("test").examples[:200]]
                  for task in {variant_task(v) for v in variants}}
    texts = {v: test_texts[variant_task(v)] for v in variants}
    base_bytes = store.base(BASE).params * 4
    model_bytes = max(base_bytes, *(store.variant(v).raw_bytes for v in variants))  # a full model; adapters are tiny
    budget = args.budget_models * model_bytes
    spec = LoadSpec(rate_rps=args.rate, duration_s=args.duration, zipf_s=args.zipf)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    apps = {
        "manyfold": lambda: build_app(ServeConfig(
            store=store.root, deployment={"num_cpus": 1},
            cache={"device_mib": max(1, (budget - base_bytes) // MIB), "cpu_mib": 0})),
        "lru": lambda: LruServer.bind(str(plain), budget),
        "multiplex": lambda: multiplex_server(str(plain), args.budget_models).bind(),
    }
    runs = []
    try:
        for name, round_ in [(n, r) for r in range(args.repeats) for n in args.systems.split(",")]:
            serve.run(apps[name](), name=name, route_prefix="/", logging_config={"log_level": "WARNING"})
            asyncio.run(run_load(url, variants[:1], texts, LoadSpec(rate_rps=2, duration_s=1)))  # warm up
            with PeakMemory(name) as mem:
                result = asyncio.run(run_load(url, variants, texts, spec))
            hit = manyfold_hit_rate(url) if name == "manyfold" else baseline_hit_rate(url)
            runs.append({"system": name, "round": round_, **result.summary(), "cache_hit_rate": hit, "peak_rss_mib": mem.peak / MIB,
                         "peak_front_rss_mib": mem.peak_front / MIB, "scenario": args.scenario,
                         "mix": mix(plan), "max_chars": args.max_chars,
                         "variants": args.variants, "zipf_s": args.zipf, "rate_rps": args.rate,
                         "duration_s": args.duration, "budget_models": args.budget_models,
                         "budget_mib": budget / MIB})
            serve.delete(name)
            time.sleep(2)
    finally:
        serve.shutdown()
        ray.shutdown()
    rows = [median_run([r for r in runs if r["system"] == name]) for name in args.systems.split(",")]

    print(f"machine: {machine()}; {platform.platform()}")
    print(f"{args.variants} MiniLM fine-tunes ({scenario.what}), Zipf s={args.zipf}, {args.rate} req/s offered for "
          f"{args.duration} s, weight budget {args.budget_models} models ({budget / MIB:.0f} MiB)")
    print(f"mix: {mix_text(mix(plan), scenario.top_layers)}; inputs: test texts cut to {args.max_chars} characters")
    if args.repeats > 1:
        print(f"{args.repeats} rounds, systems in turn; each system's median run by rps (every run: "
              + ", ".join(f"{n} " + "/".join(f"{r['throughput_rps']:.1f}" for r in runs if r["system"] == n)
                          for n in args.systems.split(",")) + " rps)")
    print(f"{'system':<10} {'ok':>5} {'err':>4} {'rps':>6} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'hit':>6} "
          f"{'model RSS MiB':>14} {'front MiB':>10}")
    for r in rows:
        print(f"{r['system']:<10} {r['ok']:>5} {r['errors']:>4} {r['throughput_rps']:>6.1f} {r['p50_s'] * 1000:>8.0f} "
              f"{r['p95_s'] * 1000:>8.0f} {r['p99_s'] * 1000:>8.0f} {r['cache_hit_rate']:>6.1%} "
              f"{r['peak_rss_mib']:>14.0f} {r['peak_front_rss_mib']:>10.0f}")
    print("rps: completed requests per second of wall time; hit: share of requests served without a load or "
          "decode; model RSS: peak summed RSS of the model replicas; front: Manyfold's HTTP ingress and "
          "residency-board replicas")
    out = Path(f"{args.out}-{args.scenario}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine(), "rows": rows, "runs": runs}, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return rows


if __name__ == "__main__":
    main()

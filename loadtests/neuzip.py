"""`python -m loadtests.run --scenario neuzip`: SmolLM2-135M served plain (bf16) and as a lossless NeuZip base
(k = 7), with the same LoRA tenants, one after the other on the same Ray on loopback at the same CPU share and
torch threads, each at saturation: open-loop Poisson arrivals above what either completes, over a fixed window
(loadtests/tenant_load.py), so each throughput is a ceiling. Per system: req/s, tokens/s, p50 and p99 latency,
the base's resident weight bytes as the replica reports them (manyfold_base_weight_bytes) and the replica's
peak RSS. Table on stdout, JSON under bench-results/ (neuzip-load.json).

The two stores (MANYFOLD_HOME/neuzip-load/) hold the same base under the same name, once as bf16 safetensors
and once in NeuZip form, and the same tenants (the tenants scenario's S1 adapters, trained once and cached), so
that one request plan serves both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import sys
import time
from pathlib import Path

from loadtests.generator import loopback_serve
from loadtests.tenant_adapters import WORKLOADS, TrainSpec, derive_tenants, trained_sources
from loadtests.tenant_load import TenantLoad, add_load_arguments, fortune_prompts, plan_requests, run_window
from loadtests.tenants import PeakRss

MIB = 1 << 20
SYSTEMS = ("plain", "neuzip")
BASE = "smollm2"
WEIGHT_BYTES = re.compile(r'^manyfold_base_weight_bytes\{base="([^"]+)"\} (\S+)$', re.M)
PLAN_BYTES = re.compile(r'^manyfold_memory_plan_bytes\{part="([^"]+)"\} (\S+)$', re.M)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.run --scenario neuzip", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["neuzip"], default="neuzip")
    p.add_argument("--tenants", type=int, default=8, help="LoRA tenants (S1: q,v at ranks 8/16) on each base")
    add_load_arguments(p)
    p.add_argument("--max-batch", type=int, default=64, help="rows per batch: decode steps run this wide")
    p.add_argument("--decoded-mib", default="0", help="the NeuZip base's neuzip_decoded_mib (a number, or auto "
                   "with --memory-target-mib)")
    p.add_argument("--memory-target-mib", type=int, default=None, help="each replica's memory_target_mib")
    p.add_argument("--num-cpus", type=float, default=2.0)
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="rounds of both systems in turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/neuzip-load")
    args = p.parse_args(argv)
    args.decoded_mib = args.decoded_mib if args.decoded_mib == "auto" else int(args.decoded_mib)
    return args


def build_stores(tenants: int, seed: int, log=print) -> tuple[dict[str, Path], list[str]]:
    """({system: store root}, tenant names), built once: SmolLM2 cast to bf16, stored plain and as NeuZip k = 7,
    each with the same tenants."""
    from serve.codecs.neuzip_file import add_base, cast_to_bf16
    from serve.data.cache import home
    from serve.data.models import smollm2_dir
    from serve.store.model_dir import NOT_COPIED
    from serve.store.store import Store
    from serve.variants import variant_kind

    root = home() / "neuzip-load" / f"n{tenants}-seed{seed}"
    roots = {s: root / s for s in SYSTEMS}
    built = root / "built.json"
    if built.is_file():
        return roots, json.loads(built.read_text())["names"]
    shutil.rmtree(root, ignore_errors=True)
    bf16 = root / "bf16"
    shutil.copytree(smollm2_dir(), bf16, ignore=shutil.ignore_patterns(*NOT_COPIED))
    cast_to_bf16(bf16)
    workload = WORKLOADS["S1"]
    names = derive_tenants(trained_sources(workload, TrainSpec(), log), workload, tenants, root / "tenants", seed)
    for system, store_root in roots.items():
        store = Store(store_root, create=True)
        if system == "plain":
            store.add_base(BASE, bf16)
        else:
            add_base(store, BASE, bf16, 7)
        for name in names:
            variant_kind("lora").add(store, name, BASE, root / "tenants" / name)
        log(f"{system}: {store_root} with {len(names)} tenants")
    shutil.rmtree(root / "tenants")
    built.write_text(json.dumps({"names": names, "built_at": time.strftime("%Y-%m-%d %H:%M")}) + "\n")
    return roots, names


def app(args: argparse.Namespace, system: str, store: Path):
    from serve.app import build_app
    from serve.config import ServeConfig

    deployment = {"num_cpus": args.num_cpus, "torch_threads": args.torch_threads, "graceful_shutdown_timeout_s": 2}
    if args.memory_target_mib is not None:
        deployment["memory_target_mib"] = args.memory_target_mib
    return build_app(ServeConfig(store=store, deployment=deployment, batch={"max_batch_size": args.max_batch},
                                 neuzip_decoded_mib=args.decoded_mib if system == "neuzip" else 0))


def measure(args: argparse.Namespace, system: str, store: Path, names: list[str], url: str) -> dict:
    """Start the system fresh, warm it (one request per tenant), then one window with its peak RSS."""
    import httpx
    from ray import serve

    t = time.perf_counter()
    serve.run(app(args, system, store), name=system, route_prefix="/", logging_config={"log_level": "WARNING"})
    start_s = time.perf_counter() - t
    prompts = fortune_prompts()
    for name in names:
        httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": prompts[0], "max_tokens": 4},
                   timeout=300).raise_for_status()
    load = TenantLoad(args.rate, args.duration, "uniform", 1.0, args.min_tokens, args.max_tokens, args.seed)
    with PeakRss(system) as mem:
        window = asyncio.run(run_window(url, plan_requests(names, prompts, load), args.duration))
    text = httpx.get(f"{url}/metrics", timeout=30).text
    weights = {b: float(v) for b, v in WEIGHT_BYTES.findall(text)}
    plan = {part: float(v) for part, v in PLAN_BYTES.findall(text)}  # neuzip_decoded_mib: auto
    serve.delete(system)
    return {"system": system, **window.summary(), "weight_bytes": weights.get(BASE), "start_s": start_s,
            "peak_rss_mib": mem.peak / MIB, "memory_plan": plan or None}


def main(argv: list[str] | None = None) -> dict:
    from serve.bench.report import machine

    args = parse_args(argv)
    roots, names = build_stores(args.tenants, args.seed)
    runs = []
    with loopback_serve() as url:
        for round_ in range(args.repeats):
            for system in SYSTEMS:
                runs.append({"round": round_, **measure(args, system, roots[system], names, url)})
                print(f"[neuzip {time.strftime('%H:%M:%S')}] {system}: {runs[-1]['ok']} ok, "
                      f"{runs[-1]['throughput_rps']:.2f} req/s", file=sys.stderr, flush=True)
                time.sleep(2)
    report = {"machine": machine(), "command": "python -m loadtests.run " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv),
              "spec": vars(args), "tenants": names, "runs": runs}
    print_report(report)
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report


def print_report(report: dict) -> None:
    a = report["spec"]
    print(f"\nSmolLM2-135M plain (bf16) and lossless NeuZip (k = 7, neuzip_decoded_mib {a['decoded_mib']}) with "
          f"{a['tenants']} LoRA tenants each, {a['rate']} req/s offered for {a['duration']} s, {a['min_tokens']}-"
          f"{a['max_tokens']} tokens each, batches up to {a['max_batch']} rows, on {report['machine']}")
    print(f"{'system':<8}{'round':>6}{'ok':>5}{'req/s':>8}{'x plain':>8}{'tok/s':>8}{'p50 s':>8}{'p99 s':>8}"
          f"{'weights MB':>12}{'x plain':>8}{'peak RSS MiB':>14}")
    for r in report["runs"]:
        plain = next(p for p in report["runs"] if p["system"] == "plain" and p["round"] == r["round"])
        print(f"{r['system']:<8}{r['round']:>6}{r['ok']:>5}{r['throughput_rps']:>8.2f}"
              f"{r['throughput_rps'] / plain['throughput_rps']:>8.2f}{r['tokens_per_s']:>8.1f}{r['p50_s']:>8.2f}"
              f"{r['p99_s']:>8.2f}{r['weight_bytes'] / 1e6:>12.1f}{r['weight_bytes'] / plain['weight_bytes']:>8.2f}"
              f"{r['peak_rss_mib']:>14.0f}")
    for r in report["runs"]:
        if r.get("memory_plan"):
            print(f"{r['system']} round {r['round']}, memory plan (MiB): "
                  + ", ".join(f"{k} {v / MIB:.0f}" for k, v in r["memory_plan"].items()))

"""`python -m loadtests.run --scenario tenants`: S-LoRA's Table 3 on this machine. N LoRA tenants of SmolLM2-135M
(S1: q,v at ranks 8/16; S2: q,k,v,o at ranks 64/32/16/8), each request for a tenant drawn from a power law or
uniformly, served by Manyfold, by PEFT's mixed batch and by Ray Serve's multiplexing of merged models, one after
the other in one process on the same Ray on loopback, at the same memory budget, CPU share and torch threads.

Every measurement is a fixed window of open-loop Poisson arrivals offered above what any system completes, so
each throughput is a ceiling; each system starts fresh for each window. Table on stdout, JSON and PNG under
bench-results/ (tenants.json, tenants.png).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtests.generator import loopback_serve
from loadtests.tenant_adapters import (WORKLOADS, TrainSpec, build_tenant_store, built_record, trained_dir,
                                       trained_summary)
from loadtests.tenant_load import (DISTRIBUTIONS, TenantLoad, add_load_arguments, fortune_prompts, plan_requests,
                                   run_window)
from loadtests.tenant_report import engine_seconds, estimate, plot, print_report, time_split

MIB = 1 << 20
SYSTEMS = ("manyfold", "peft", "multiplex")


@dataclass(frozen=True)
class Cell:
    """One measurement: a system on a workload's N tenants under one distribution."""

    system: str
    workload: str
    tenants: int
    distribution: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Every knob of the run as a flag: the defaults are the full run."""
    p = argparse.ArgumentParser(prog="python -m loadtests.run --scenario tenants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["tenants"], default="tenants")
    p.add_argument("--tenants", default="5,100,1000,2000", help="N values, comma-separated")
    p.add_argument("--workloads", default="S1,S2", help="S1 (q,v r8/16) and S2 (q,k,v,o r64/32/16/8, N <= 100)")
    p.add_argument("--distributions", default="zipf,uniform")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--baseline-max-tenants", type=int, default=100, help="peft and multiplex run at N <= this")
    add_load_arguments(p)
    p.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of tenant popularity")
    p.add_argument("--adapter-mib", type=float, default=256.0, help="Manyfold's LoRA pool (slots.adapter_mib)")
    p.add_argument("--cache-device-mib", type=int, default=256)
    p.add_argument("--cache-cpu-mib", type=int, default=256)
    p.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs of each system's model replica")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=16, help="rows per batch, every system")
    p.add_argument("--batch-wait-s", type=float, default=0.005, help="baselines' wait for more rows")
    p.add_argument("--train-steps", type=int, default=TrainSpec.steps, help="steps of each trained adapter")
    p.add_argument("--noise", type=float, default=0.1, help="per-tenant perturbation, times each tensor's std")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/tenants", help="writes OUT.json and OUT.png")
    p.add_argument("--estimate", action="store_true", help="print the plan and its estimated time, then stop")
    args = p.parse_args(argv)
    args.tenants = [int(n) for n in args.tenants.split(",")]
    args.workloads, args.systems = args.workloads.split(","), args.systems.split(",")
    args.distributions = args.distributions.split(",")
    for name, given, known in (("workload", args.workloads, WORKLOADS), ("system", args.systems, SYSTEMS),
                               ("distribution", args.distributions, DISTRIBUTIONS)):
        if unknown := [g for g in given if g not in known]:
            p.error(f"unknown {name} {', '.join(unknown)} (known: {', '.join(known)})")
    return args


def plan_cells(args: argparse.Namespace) -> tuple[list[Cell], list[dict]]:
    """(cells to measure, cells skipped with why): S2 stops at its max N, the baselines at baseline_max."""
    cells, skipped = [], []
    for w in args.workloads:
        for n in args.tenants:
            if n > WORKLOADS[w].max_tenants:
                continue
            for system in args.systems:
                for dist in args.distributions:
                    if system != "manyfold" and n > args.baseline_max_tenants:
                        skipped.append({**asdict(Cell(system, w, n, dist)), "why":
                                        f"N > --baseline-max-tenants {args.baseline_max_tenants}"})
                    else:
                        cells.append(Cell(system, w, n, dist))
    return cells, skipped


def budget_mib(args: argparse.Namespace) -> float:
    """Adapter memory every system gets beyond the base's weights: Manyfold's pool plus both cache tiers."""
    return args.adapter_mib + args.cache_device_mib + args.cache_cpu_mib


def manyfold_app(args: argparse.Namespace, store: str):
    """Manyfold as `manyfold serve` builds it, with the run's CPU share, threads, batch and adapter memory."""
    from serve.app import build_app
    from serve.config import ServeConfig

    return build_app(ServeConfig(
        store=store, deployment={"num_cpus": args.num_cpus, "torch_threads": args.torch_threads,
                                 "graceful_shutdown_timeout_s": 2},
        cache={"device_mib": args.cache_device_mib, "cpu_mib": args.cache_cpu_mib},
        batch={"max_batch_size": args.max_batch}, slots={"adapter_mib": args.adapter_mib}))


def baseline_app(args: argparse.Namespace, system: str, record: dict):
    """peft or multiplex over the store's own adapter directories and base, with the same settings as Manyfold."""
    from loadtests.merged_server import merged_server
    from loadtests.peft_server import peft_server
    from serve.store.store import Store

    store = Store(record["store"])
    base_dir = str(store.base_dir("smollm2"))
    paths = {n: str(store.variant_dir(n)) for n in record["names"]}
    common = (args.max_batch, args.batch_wait_s, args.num_cpus, args.torch_threads)
    if system == "peft":
        return peft_server(base_dir, paths, int(budget_mib(args) * MIB), *common).options(
            graceful_shutdown_timeout_s=2).bind()
    models = merged_models(args, record["base_bytes"])
    return merged_server(base_dir, paths, models, *common).options(graceful_shutdown_timeout_s=2).bind()


def merged_models(args: argparse.Namespace, base_bytes: int) -> int:
    """Merged full models that fit the base's bytes plus the adapter budget (at least one)."""
    return max(1, int((base_bytes + budget_mib(args) * MIB) // base_bytes))


class PeakRss:
    """Peak summed RSS, every 0.25 s, of one Serve application's replicas among this process's descendants (the
    Ray this run started; never another run's): its model replicas, and apart from them Manyfold's ingress and
    residency board. Keeps each process's peak too."""

    def __init__(self, app: str):
        from serve.app import BOARD

        self.front = (f"ServeReplica:{app}:Ingress", f"ServeReplica:{app}:{BOARD}")
        self.app, self.peak, self.peak_front, self.per_process = app, 0, 0, {}
        self.peak_server = 0
        """The whole server: every process of this run's Ray (its daemons, Serve's controller and proxy, the app)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        from serve.bench.report import process_tree_rss

        models = front = 0
        tree = process_tree_rss(os.getpid())
        self.peak_server = max(self.peak_server, sum(rss for pid, (_, rss) in tree.items() if pid != os.getpid()))
        for pid, (cmd, rss) in tree.items():
            if (marker := f"ServeReplica:{self.app}:") not in cmd:
                continue
            key = f"{pid} {cmd.split(marker, 1)[1].split()[0].split('.')[0]}"  # pid and deployment
            self.per_process[key] = max(self.per_process.get(key, 0), rss)
            if any(f in cmd for f in self.front):
                front += rss
            else:
                models += rss
        self.peak, self.peak_front = max(self.peak, models), max(self.peak_front, front)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self._sample()

    def __enter__(self) -> "PeakRss":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure(cell: Cell, args: argparse.Namespace, record: dict, prompts: list[str], url: str) -> dict:
    """Start the system fresh, warm it with one request, then one window with its peak RSS and, for Manyfold,
    its engine-time counters read before and after."""
    import httpx
    from ray import serve

    app = manyfold_app(args, record["store"]) if cell.system == "manyfold" else baseline_app(args, cell.system, record)
    t = time.perf_counter()
    serve.run(app, name=cell.system, route_prefix="/", logging_config={"log_level": "WARNING"})
    start_s = time.perf_counter() - t
    warm = {"model": record["names"][0], "prompt": prompts[0], "max_tokens": 4, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json=warm, timeout=300,
               headers={"serve_multiplexed_model_id": warm["model"]}).raise_for_status()
    load = TenantLoad(args.rate, args.duration, cell.distribution, args.alpha, args.min_tokens, args.max_tokens,
                      args.seed)
    plan = plan_requests(record["names"], prompts, load)
    before = engine_seconds(url) if cell.system == "manyfold" else None
    with PeakRss(cell.system) as mem:
        window = asyncio.run(run_window(url, plan, args.duration))
    after = engine_seconds(url) if cell.system == "manyfold" else None
    stats = None if cell.system == "manyfold" else httpx.get(f"{url}/stats", timeout=60).json()
    t = time.perf_counter()
    serve.delete(cell.system)
    row = {**asdict(cell), **window.summary(), "distinct_sent": len({p.model for p in plan}),
           "peak_rss_mib": mem.peak / MIB, "peak_front_rss_mib": mem.peak_front / MIB,
           "peak_server_rss_mib": mem.peak_server / MIB,
           "peak_rss_by_process_mib": {k: v / MIB for k, v in mem.per_process.items()}, "start_s": start_s,
           "teardown_s": time.perf_counter() - t, "time_split": time_split(before, after)}
    if stats is not None:  # loads, evictions, rows per batch: how the baseline held its adapters
        row["server_stats"] = stats
    if cell.system == "multiplex":
        row["merged_models"] = merged_models(args, record["base_bytes"])
    return row


def build_stores(args: argparse.Namespace, cells: list[Cell]) -> dict[tuple[str, int], dict]:
    """Every (workload, N) store the cells need, built once and cached."""
    from serve.store.store import Store

    spec = TrainSpec(steps=args.train_steps)
    records = {}
    for w, n in dict.fromkeys((c.workload, c.tenants) for c in cells):
        record = build_tenant_store(WORKLOADS[w], n, args.seed, args.noise, spec, log=_log)
        record["base_bytes"] = Store(record["store"]).base("smollm2").params * 4
        records[w, n] = record
    return records


def _log(msg: str) -> None:
    print(f"[tenants {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict:
    """Print the plan and its estimate, build what is not cached, measure every cell, report."""
    args = parse_args(argv)
    cells, skipped = plan_cells(args)
    spec = TrainSpec(steps=args.train_steps)
    uncached = [(w, n) for w, n in dict.fromkeys((c.workload, c.tenants) for c in cells)
                if built_record(WORKLOADS[w], n, args.seed, args.noise, spec) is None]
    untrained = sum(not (trained_dir(WORKLOADS[w], r, spec) / "adapter_model.safetensors").is_file()
                    for w in dict.fromkeys(w for w, _ in uncached) for r in WORKLOADS[w].ranks)
    print(estimate(cells, uncached, untrained, args), flush=True)
    if args.estimate:
        return {}
    t0 = time.perf_counter()
    records = build_stores(args, cells)
    build_s = time.perf_counter() - t0
    trained = {w: trained_summary(WORKLOADS[w], TrainSpec(steps=args.train_steps)) for w in args.workloads}
    rows = run_cells(cells, args, records)
    report = {"command": "python -m loadtests.run " + " ".join(sys.argv[1:] if argv is None else argv),
              "spec": {k: v for k, v in vars(args).items() if k != "estimate"}, "budget_mib": budget_mib(args),
              "trained": trained,
              "stores": {f"{w}-n{n}": {k: v for k, v in r.items() if k != "names"} for (w, n), r in records.items()},
              "build_s": build_s, "run_s": time.perf_counter() - t0 - build_s, "rows": rows, "skipped": skipped}
    return write_report(report, Path(args.out))


def run_cells(cells: list[Cell], args: argparse.Namespace, records: dict) -> list[dict]:
    """Ray on loopback once; every cell in turn on it."""
    prompts = fortune_prompts()
    rows = []
    with loopback_serve() as url:
        from ray import serve

        for i, cell in enumerate(cells, 1):
            _log(f"{i}/{len(cells)}: {cell.system} {cell.workload} N={cell.tenants} {cell.distribution}")
            try:
                rows.append(measure(cell, args, records[cell.workload, cell.tenants], prompts, url))
            except Exception as e:  # one cell's failure is its row; the run goes on to the next
                rows.append({**asdict(cell), "failed": f"{type(e).__name__}: {e}"})
                _log(f"  failed: {rows[-1]['failed']}")
                if cell.system in serve.status().applications:
                    serve.delete(cell.system)
                continue
            _log(f"  {rows[-1]['ok']} ok, {rows[-1]['unanswered']} unanswered, {rows[-1]['errors']} errors, "
                 f"{rows[-1]['throughput_rps']:.2f} req/s")
            time.sleep(2)
    return rows


def write_report(report: dict, out: Path) -> dict:
    """The table on stdout, then OUT.json and OUT.png."""
    from serve.bench.report import machine

    report = {"machine": machine(), **report}
    print_report(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return report

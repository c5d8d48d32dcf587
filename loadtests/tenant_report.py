"""The tenants scenario's reading and writing: Manyfold's engine-time counters and their split, the time
estimate printed before a run, the table and the plot."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ENGINE_SECONDS = re.compile(r'^manyfold_engine_seconds_total\{([^}]*)\} (\S+)$', re.M)
PARTS = ("step", "forward", "lora", "staging", "scheduling")
"""manyfold_engine_seconds_total's parts (serve/metrics.py, serve/engine/model.py): step, a generation step on the
compute thread (attaching new rows' adapters, their prefill, one decode forward, sampling); forward, inside step,
every model forward; lora, inside forward, the LoRA shrink/expand ops; staging, inside step but not forward,
writing adapters into the pool; scheduling, event-loop time between one step's end and the next one's start.
forward also counts encoders' forwards, outside any step: a tenants store holds the causal base alone."""
WINDOW_OVERHEAD_S = {"manyfold": 18.0, "peft": 12.0, "multiplex": 13.0}
"""Start, warm-up request, teardown and pause of one system around each window (13-19 s, 11 s and 11-14 s
measured on the 2-core machine at N <= 100)."""
TRAIN_S = 60.0
"""One trained source adapter, 24 steps of batch 4 x 64 tokens on SmolLM2: about 1.3 s a step on a quiet 2-core
machine; 106 s and 200 s measured for S1's two while other work shared it."""
STORE_S = 10.0
"""A store's fixed cost: copying the base (540 MB) and starting the registration command (about 5 s of imports)."""
STORE_S_PER_ADAPTER = {"S1": 0.03, "S2": 0.08}
"""Deriving, writing and registering one tenant's adapter (measured at N = 100: S1 1.3 s + 0.8 s, S2 3.6 s + 2.9 s)."""


def engine_seconds(url: str) -> dict[str, float] | None:
    """{part: seconds} of manyfold_engine_seconds_total at GET /metrics (summed over other labels); None when
    the server has no such metric."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for labels, value in ENGINE_SECONDS.findall(text):
        part = re.search(r'part="([^"]*)"', labels)
        if part:
            out[part.group(1)] = out.get(part.group(1), 0.0) + float(value)
    return out or None


def time_split(before: dict | None, after: dict | None) -> dict | None:
    """Shares of engine time over a window, step plus scheduling: base (forwards less their LoRA ops), lora,
    staging, other (the rest of a step: sampling, bookkeeping) and scheduling; None without the counters."""
    if before is None or after is None or "step" not in after or "forward" not in after:
        return None
    d = {p: after.get(p, 0.0) - before.get(p, 0.0) for p in PARTS}
    total = d["step"] + d["scheduling"]
    if total <= 0:
        return None
    seconds = {"base": d["forward"] - d["lora"], "lora": d["lora"], "staging": d["staging"],
               "other": d["step"] - d["forward"] - d["staging"], "scheduling": d["scheduling"]}
    return {"seconds": seconds, "total_s": total, "shares": {k: v / total for k, v in seconds.items()}}


def estimate(cells: list, uncached: list[tuple[str, int]], untrained: int, args: argparse.Namespace) -> str:
    """The plan in one line, with its estimated wall time (constants above): uncached stores to build and
    untrained source adapters to train first."""
    run_s = sum(args.duration + WINDOW_OVERHEAD_S[c.system] for c in cells)
    build_s = sum(STORE_S + n * STORE_S_PER_ADAPTER[w] for w, n in uncached)
    build_s += TRAIN_S * untrained * args.train_steps / 24
    by_system = {s: sum(c.system == s for c in cells) for s in dict.fromkeys(c.system for c in cells)}
    stores = f" ({', '.join(f'{w} N={n}' for w, n in uncached)})" if uncached else ""
    return (f"plan: {len(cells)} windows of {args.duration:.0f} s at {args.rate:g} req/s offered ("
            + ", ".join(f"{s} {k}" for s, k in by_system.items()) + f"); {untrained} source adapters to train, "
            f"{len(uncached)} stores to build{stores}; estimated {(run_s + build_s) / 60:.0f} min (measuring "
            f"{run_s / 60:.0f}, building {build_s / 60:.0f})")


def print_report(report: dict) -> None:
    s = report["spec"]
    print(f"machine: {report['machine']}")
    print(f"SmolLM2-135M fp32, LoRA tenants: S1 q,v ranks 8/16; S2 q,k,v,o ranks 64/32/16/8; {s['rate']:g} req/s "
          f"offered (Poisson) for {s['duration']:.0f} s per window, {s['min_tokens']}-{s['max_tokens']} greedy tokens "
          f"each, prompts: Debian fortunes; zipf: alpha {s['alpha']:g}")
    print(f"every system: {s['num_cpus']:g} CPU, {s['torch_threads']} torch threads, batches of {s['max_batch']}, "
          f"base + {report['budget_mib']:.0f} MiB for adapters (Manyfold: pool {s['adapter_mib']:g} + cache "
          f"{s['cache_device_mib']} device / {s['cache_cpu_mib']} cpu MiB)")
    for key, st in report["stores"].items():
        print(f"{key}: {st['tenants']:,} adapters ({st['adapter_bytes'] / 2**20:.0f} MiB) registered with one command "
              f"in {st['register']['seconds']:.1f} s, Python start-up included (`{st['register']['command']}`, "
              f"store built {st['built_at']}; it said: {st['register']['output']})")
    cols = ("system", "wl", "dist", "N", "adapters", "ok", "unans", "err", "req/s", "tok/s", "p50 s", "p99 s",
            "RSS MiB", "front")
    print(f"{cols[0]:<10}{cols[1]:<4}{cols[2]:<8}" + "".join(f"{c:>9}" for c in cols[3:]))
    for r in report["rows"]:
        if "failed" in r:
            print(f"{r['system']:<10}{r['workload']:<4}{r['distribution']:<8}{r['tenants']:>9}  failed: {r['failed']}")
            continue
        print(f"{r['system']:<10}{r['workload']:<4}{r['distribution']:<8}{r['tenants']:>9}"
              f"{str(r['distinct_served']) + '/' + str(r['distinct_sent']):>9}{r['ok']:>9}{r['unanswered']:>9}"
              f"{r['errors']:>9}{r['throughput_rps']:>9.2f}{r['tokens_per_s']:>9.1f}{r['p50_s']:>9.2f}"
              f"{r['p99_s']:>9.2f}{r['peak_rss_mib']:>9.0f}{r['peak_front_rss_mib']:>9.0f}")
    for r in report["skipped"]:
        print(f"{r['system']:<10}{r['workload']:<4}{r['distribution']:<8}{r['tenants']:>9}  skipped: {r['why']}")
    print("adapters: distinct tenants answered / sent in the window; ok: answered 200 inside the window; unans: "
          "still unanswered when it closed (cancelled, counted); req/s, tok/s: ok requests and their generated "
          "tokens / window; p50, p99: latency of the ok requests; RSS: peak summed RSS of the model replica "
          "processes; front: Manyfold's ingress and residency board")
    rows = [r for r in report["rows"] if "failed" not in r]
    print_holding(report, rows)
    print_memory_growth(rows)
    print_time_split(rows)


def print_holding(report: dict, rows: list[dict]) -> None:
    """How each baseline held its adapters within the budget, window by window."""
    budget = report["budget_mib"]
    for r in rows:
        st = r.get("server_stats")
        if st is None:
            continue
        need = report["stores"][f"{r['workload']}-n{r['tenants']}"]["adapter_bytes"] / 2**20
        if r["system"] == "peft":
            how = (f"all {r['tenants']} adapters fit ({need:.0f} of {budget:.0f} MiB)" if need <= budget else
                   f"{need:.0f} MiB of adapters > {budget:.0f} MiB: LRU")
        else:
            how = f"at most {r['merged_models']} merged models"
        print(f"{r['system']} {r['workload']} {r['distribution']} N={r['tenants']}: {how}; {st['loads']} loads"
              + (f", {st['evictions']} evictions" if "evictions" in st else "")
              + f", {st['rows_per_batch']:.1f} rows per batch")


def print_memory_growth(rows: list[dict]) -> None:
    """Manyfold's peak RSS (its model replica, and the whole server) at each N, per workload and distribution: memory
    should follow the adapters it holds (bounded by the budget), not those registered."""
    many = [r for r in rows if r["system"] == "manyfold"]
    for key in dict.fromkeys((r["workload"], r["distribution"]) for r in many):
        line = sorted((r for r in many if (r["workload"], r["distribution"]) == key), key=lambda r: r["tenants"])
        if len(line) > 1:
            print(f"Manyfold peak RSS (model replica; whole server), {key[0]} {key[1]}: "
                  + ", ".join(f"N={r['tenants']:,} {r['peak_rss_mib']:,.0f}; {r.get('peak_server_rss_mib', 0):,.0f} MiB"
                              for r in line))


def print_time_split(rows: list[dict]) -> None:
    """Where Manyfold's engine time went at the largest N measured, per workload and distribution."""
    many = [r for r in rows if r["system"] == "manyfold"]
    for key in dict.fromkeys((r["workload"], r["distribution"]) for r in many):
        r = max((r for r in many if (r["workload"], r["distribution"]) == key), key=lambda r: r["tenants"])
        head = f"Manyfold engine time, {r['workload']} {r['distribution']} N={r['tenants']}:"
        split = r["time_split"]
        if split is None:
            print(f"{head} not available (no manyfold_engine_seconds_total counters at /metrics)")
            continue
        print(f"{head} " + ", ".join(f"{k} {v:.1%}" for k, v in split["shares"].items())
              + f" of {split['total_s']:.1f} s")


def plot(report: dict, path: Path) -> None:
    """Throughput and p99 against N (log), a line per system, workload and distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"manyfold": "#3b7", "peft": "#37c", "multiplex": "#c73"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = [r for r in report["rows"] if "failed" not in r]
    for key in dict.fromkeys((r["system"], r["workload"], r["distribution"]) for r in rows):
        line = sorted((r for r in rows if (r["system"], r["workload"], r["distribution"]) == key),
                      key=lambda r: r["tenants"])
        style = {"color": colors.get(key[0], "#888"), "linestyle": "-" if key[2] == "zipf" else "--",
                 "marker": "o" if key[1] == "S1" else "s", "label": " ".join(key)}
        n = [r["tenants"] for r in line]
        a.plot(n, [r["throughput_rps"] for r in line], **style)
        b.plot(n, [r["p99_s"] for r in line], **style)
    for ax, label in ((a, "completed requests / s"), (b, "p99 latency of completed requests (s)")):
        ax.set_xscale("log")
        ax.set_xlabel("adapters (N)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    s = report["spec"]
    fig.suptitle(f"LoRA tenants of SmolLM2-135M, {s['rate']:g} req/s offered for {s['duration']:.0f} s; "
                 f"{report['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

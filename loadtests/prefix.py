"""`python -m loadtests.run --scenario prefix`: what a tenant's system prompt costs through `manyfold serve`, with
prefix caching and without (issue 61).

Eight tenants by API key on their own LoRA adapters of SmolLM2-135M (the fairness scenario's store), each with a
system prompt of its own (1,024 tokens of the packaged BBC news articles, drawn per tenant) in front of every
request, user turns of 32 to 128 tokens (other articles), streamed greedy completions of 16 tokens, Poisson
arrivals per tenant, the same in both runs. The server runs once with `batch.prefix_caching: true` and once with
false (restarted between: a config setting). Per run: each tenant's first request's time to first token and its
later ones' (p50, p99 over the tenants), the tokens the server read from its cache (usage.prompt_tokens_details),
vLLM's prefix-cache counters from /metrics, tokens/s. The check: with caching, a tenant's later requests reach
their first token at least 5x sooner (p50) than its first. Table on stdout; bench-results/prefix-serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import time
from pathlib import Path

import httpx

from loadtests.fairness import TENANTS, Server, build_store, model_of, server_config, warm
from loadtests.fairness_load import Caller, Planned, log, open_loop, poisson_times
from loadtests.fairness_report import Record
from loadtests.generator import free_port
from serve.bench.report import machine, percentile


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.run --scenario prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["prefix"], default="prefix")
    p.add_argument("--system-tokens", type=int, default=1024, help="each tenant's system prompt, in SmolLM2's tokens")
    p.add_argument("--requests", type=int, default=5, help="requests a tenant sends (Poisson over --duration)")
    p.add_argument("--duration", type=float, default=90.0, help="seconds over which the requests arrive")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take in all (counted)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/prefix-serve.json")
    return p.parse_args(argv)


def prompts(system_tokens: int, seed: int) -> tuple[dict[str, str], list[str]]:
    """(each tenant's system prompt, the user turns): SmolLM2's tokens of the BBC news articles, decoded."""
    from transformers import AutoTokenizer

    from serve.bench.engine_traffic import news_prompts
    from serve.data.models import smollm2_dir

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    articles = news_prompts(tok, 4 * system_tokens)
    rng = random.Random(f"{seed}/prefix")
    long = [a for a in articles if len(a) >= system_tokens]
    system = {t: tok.decode(rng.choice(long)[:system_tokens]) for t in TENANTS}
    turns = [tok.decode(a[:rng.randint(32, 128)]) for a in rng.sample(articles, 200)]
    return system, turns


def plan(callers: list[Caller], system: dict[str, str], turns: list[str], args: argparse.Namespace) -> list[Planned]:
    """Every tenant's arrivals (its own seed), each its system prompt and a user turn."""
    out = []
    for c in callers:
        rng = random.Random(f"{args.seed}/{c.tenant}")
        times = poisson_times(args.requests / args.duration, args.duration, rng)
        while len(times) < 2:  # a first request and at least one later one
            times = poisson_times(args.requests / args.duration, args.duration, rng)
        out += [Planned(t, c, f"{system[c.tenant]}\n\nQuestion: {rng.choice(turns)}\nAnswer:") for t in times]
    return sorted(out, key=lambda p: p.at_s)


def prefix_counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {"queries": 0.0, "hits": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for s in family.samples:
            for key in out:
                if s.name == f"vllm:prefix_cache_{key}_total":
                    out[key] += s.value
    return out


def summary(records: list[Record], duration_s: float) -> dict:
    """Each tenant's first answered request against its later ones; the run's tokens/s and cached tokens."""
    first, later = [], []
    for tenant in TENANTS:
        mine = sorted((r for r in records if r.tenant == tenant and r.outcome == "200" and r.ttft_s is not None),
                      key=lambda r: r.sent_s)  # an answer with no text (its tokens all whitespace) has no first token
        first += [mine[0].ttft_s] if mine else []
        later += [r.ttft_s for r in mine[1:]]
    ok = [r for r in records if r.outcome == "200"]
    end = max([duration_s, *(c for r in records for c in r.chunk_s)])
    return {"requests": len(records), "ok": len(ok), "not_ok": len(records) - len(ok),
            "ttft_first_p50_s": percentile(first, 0.5), "ttft_first_p99_s": percentile(first, 0.99),
            "ttft_later_p50_s": percentile(later, 0.5), "ttft_later_p99_s": percentile(later, 0.99),
            "first_over_later_p50": percentile(first, 0.5) / max(percentile(later, 0.5), 1e-9),
            "cached_tokens": sum(r.cached_tokens for r in ok), "tokens_per_s": sum(r.tokens for r in ok) / end}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    store = build_store(args.seed)
    callers = [Caller(t, f"sk-{secrets.token_hex(12)}", model_of(t)) for t in TENANTS]
    system, turns = prompts(args.system_tokens, args.seed)
    planned = plan(callers, system, turns, args)
    runs = {}
    for caching in (True, False):
        name = "caching on" if caching else "caching off"
        config = server_config(store, free_port(), callers, "vtc", 256)
        config["batch"]["prefix_caching"] = caching
        with Server(config, args.start_timeout) as url:
            warm(url, callers, "Hello")
            before = prefix_counters(url)
            log(f"{name}: {len(planned)} requests over {args.duration:g} s")
            records = asyncio.run(open_loop(url, planned, args.max_tokens, args.timeout, 512))
            after = prefix_counters(url)
        counters = {k: after[k] - before[k] for k in after}
        runs[name] = {**summary(records, args.duration), "prefix_cache": counters,
                      "hit_rate": counters["hits"] / max(1.0, counters["queries"])}
        log(f"{name}: {json.dumps(runs[name])}")
    on, off = runs["caching on"], runs["caching off"]
    report = {"scenario": "prefix", "machine": machine(), "tenants": len(TENANTS), "system_tokens": args.system_tokens,
              "requests_per_tenant": args.requests, "duration_s": args.duration, "max_tokens": args.max_tokens,
              "runs": runs, "seconds": time.perf_counter() - t0,
              "checks": {"later_5x_sooner_p50": on["first_over_later_p50"] >= 5,
                         "tokens_per_s_on_over_off": on["tokens_per_s"] / max(off["tokens_per_s"], 1e-9)}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{len(TENANTS)} tenants on their own LoRA adapters of SmolLM2, system prompts of {args.system_tokens} "
          f"tokens, user turns of 32-128, {args.requests} requests a tenant over {args.duration:g} s, "
          f"{args.max_tokens} tokens each; {report['machine']}")
    print(f"{'run':<13}{'ok':>5}{'TTFT first p50':>16}{'p99 (s)':>9}{'later p50':>11}{'p99 (s)':>9}{'first/later':>13}"
          f"{'hit rate':>10}{'cached tokens':>15}{'tokens/s':>10}")
    for name, r in runs.items():
        print(f"{name:<13}{r['ok']:>5}{r['ttft_first_p50_s']:>16.2f}{r['ttft_first_p99_s']:>9.2f}"
              f"{r['ttft_later_p50_s']:>11.2f}{r['ttft_later_p99_s']:>9.2f}{r['first_over_later_p50']:>12.1f}x"
              f"{r['hit_rate']:>10.0%}{r['cached_tokens']:>15}{r['tokens_per_s']:>10.2f}")
    print(f"checks: {json.dumps(report['checks'])}")
    return report

"""`python -m loadtests.run --scenario invariance`: does a request's answer depend on what else is in its batch?
(issue 62)

Through `manyfold serve` on 127.0.0.1, over the demo store's two SmolLM2-135M bases (plain, fp32; and lossless
NeuZip, bf16) and a variant of every kind on each: a LoRA adapter, a PiSSA adapter, a full fine-tune (FM-Delta),
an EMR task (the plain base's group), and each base itself. Every request is a greedy completion with its log
probabilities (the sampled token's and the top 2) over a prompt of its own (held-out fortunes and news articles,
8 to about 300 tokens), sent one at a time, then the same requests eight at once (four on each base, every kind
mixed). The server's step takes at most 64 prompt tokens (batch.max_step_tokens), so eight at once cut their
prompts into other chunks than one alone. Run with `engine.batch_invariant` off (the default), then on (the
server restarted between: a config setting). Per run: how many of the requests gave another text, other tokens'
log probabilities or other top log probabilities at once than alone, which, and the wall time. The check: with the
option on, none. Table on stdout; bench-results/invariance.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

import httpx

from loadtests.fairness import Server
from loadtests.fairness_load import log
from loadtests.generator import free_port
from serve.bench.report import finish, machine

RUNS = ("off", "on")
LORA = "-lora"
"""The LoRA adapter on each base: the tenants scenario's trained q,v rank-8 adapter (loadtests/tenant_adapters.py)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.run --scenario invariance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["invariance"], default="invariance")
    p.add_argument("--prompts", type=int, default=2, help="prompts per model (9 models)")
    p.add_argument("--at-once", type=int, default=8, help="requests sent together")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-step-tokens", type=int, default=64, help="the server's batch.max_step_tokens")
    p.add_argument("--runs", default=",".join(RUNS), help="of off,on: engine.batch_invariant")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", default="bench-results/invariance.json")
    args = p.parse_args(argv)
    args.runs = [r for r in RUNS if r in args.runs.split(",")]
    if not args.runs:
        p.error(f"--runs names none of {', '.join(RUNS)}")
    return args


def build_store() -> tuple[Path, list[str]]:
    """The demo store (built once, serve/demo.py) linked file by file into MANYFOLD_HOME/invariance/store (the
    demo's own store is left as it is), with a LoRA adapter on each SmolLM2 base; -> (the store, the models asked
    for: every kind on each base)."""
    from loadtests import tenant_adapters as adapters
    from serve.data.cache import home
    from serve.data.models import smollm2_dir
    from serve.demo import LM_BASE, NZ_BASE, build_demo_store, nz_name
    from serve.store.store import Store
    from serve.variants import variant_kind

    demo = build_demo_store(log=log)
    root = home() / "invariance" / "store"
    if not (root / "manifest.json").is_file():
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(demo.root, root, copy_function=os.link)  # the store writes by rename: links stay the demo's
    store = Store(root)
    workload = adapters.WORKLOADS["S1"]
    source = adapters.train_source(smollm2_dir(), workload, 8, adapters.trained_dir(workload, 8), log=log)
    for base in (LM_BASE, NZ_BASE):
        if base + LORA not in store.manifest.variants:
            variant_kind("lora").add(store, base + LORA, base, source)
    kinds = [LM_BASE, LM_BASE + LORA, "smollm2-fortunes-pissa", "smollm2-fortunes", "smollm2-emr/fortunes"]
    return root, kinds + [nz_name(k) for k in kinds if not k.startswith("smollm2-emr")]


def prompts(n: int) -> list[str]:
    """Held-out fortunes and the packaged news articles' openings, short and long in turn."""
    from loadtests.tenant_load import fortune_prompts
    from serve.data.datasets import bbc_topics

    news = [e.text[:1200] for e in bbc_topics("test").examples[:n]]
    fortunes = fortune_prompts()[:n]
    return [p for pair in zip(fortunes, news) for p in pair][:n]


async def complete(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    r = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0, "logprobs": 2})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    return {"text": choice["text"], "tokens": lp["tokens"], "logprobs": lp["token_logprobs"], "top": lp["top_logprobs"]}


async def answers(url: str, requests: list[tuple[str, str]], at_once: int, max_tokens: int) -> list[dict]:
    """Each request's answer, `at_once` of them in flight together (1: one at a time)."""
    out: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for i in range(0, len(requests), at_once):
            out += await asyncio.gather(*(complete(http, m, p, max_tokens) for m, p in requests[i:i + at_once]))
    return out


def interleaved(models: list[str], texts: list[str]) -> list[tuple[str, str]]:
    """(model, prompt) for every model and prompt, the two bases' models taking turns, so that each group sent at
    once holds both bases and every kind."""
    plain = [m for m in models if not m.startswith("smollm2-nz")]
    nz = [m for m in models if m.startswith("smollm2-nz")]
    order = [m for pair in zip(plain, nz) for m in pair] + plain[len(nz):] + nz[len(plain):]
    return [(m, p) for k, p in enumerate(texts) for m in order[k % len(order):] + order[:k % len(order)]]


def measure(name: str, url: str, requests: list[tuple[str, str]], args: argparse.Namespace) -> dict:
    t = time.perf_counter()
    alone = asyncio.run(answers(url, requests, 1, args.max_tokens))
    alone_s = time.perf_counter() - t
    t = time.perf_counter()
    together = asyncio.run(answers(url, requests, args.at_once, args.max_tokens))
    together_s = time.perf_counter() - t
    differ = []
    for (model, prompt), a, b in zip(requests, alone, together):
        parts = [k for k in ("text", "logprobs", "top") if a[k] != b[k]]
        if parts:
            first = next((i for i, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"])) if x != y), None)
            differ.append({"model": model, "prompt_chars": len(prompt), "differs_in": parts,
                           "first_logprob_differing": first, "text_alone": a["text"], "text_at_once": b["text"]})
    tokens = sum(len(a["tokens"]) for a in alone)
    log(f"batch_invariant {name}: {len(differ)} of {len(requests)} differ at once from alone; alone {alone_s:.1f} s, "
        f"at once {together_s:.1f} s")
    return {"requests": len(requests), "differ": len(differ), "texts_differ": sum("text" in d["differs_in"]
                                                                                 for d in differ),
            "alone_s": alone_s, "at_once_s": together_s, "tokens": tokens,
            "at_once_tok_s": tokens / together_s, "differing": differ}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    store, models = build_store()
    requests = interleaved(models, prompts(args.prompts))
    runs = {}
    for name in args.runs:
        config = {"store": str(store), "host": "127.0.0.1", "port": free_port(), "drain_timeout_s": 5,
                  "batch": {"max_batch_size": 16, "max_step_tokens": args.max_step_tokens},
                  "engine": {"batch_invariant": name == "on"}, "deployment": {"graceful_shutdown_timeout_s": 2}}
        log(f"starting manyfold serve, engine.batch_invariant {name}")
        with Server(config, args.start_timeout) as url:
            asyncio.run(answers(url, [(m, "Hello") for m in models], len(models), 2))  # every variant resident
            runs[name] = measure(name, url, requests, args)
    report = {"machine": machine(), "command": "python -m loadtests.run " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv),
              "spec": vars(args), "models": models, "runs": runs, "wall_s": time.perf_counter() - t0}
    if "on" in runs:
        report["check"] = {"invariant_when_on": runs["on"]["differ"] == 0}
    return finish(report, Path(args.out), print_table)


def print_table(report: dict) -> None:
    print(f"\n{len(report['models'])} models ({', '.join(report['models'])}); greedy, logprobs 2, "
          f"{report['spec']['max_tokens']} tokens; {report['spec']['at_once']} at once against one at a time")
    print(f"{'batch_invariant':<16}{'requests':>9}{'differ':>8}{'texts differ':>14}{'alone s':>9}{'at once s':>11}"
          f"{'at once tok/s':>15}")
    for name, r in report["runs"].items():
        print(f"{name:<16}{r['requests']:>9}{r['differ']:>8}{r['texts_differ']:>14}{r['alone_s']:>9.1f}"
              f"{r['at_once_s']:>11.1f}{r['at_once_tok_s']:>15.1f}")

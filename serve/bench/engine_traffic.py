"""`manyfold bench engine --traffic`: the engine under real traffic, beside the same requests in lockstep.

Requests arrive spread in time (Poisson, at three rates up to the engine's saturation), with prompts as long as
the packaged BBC news articles (cut at 1,024 tokens) and outputs of 16 to 256 tokens (uniform), over every kind:
LoRA adapters on all seven linears at ranks 8 to 64 for tenants drawn by a power law, and a share of rows on two
full fine-tunes of the top two layers (FM-Delta) and on the three tasks of one EMR group (merged from three such
fine-tunes). Each request is streamed through Engine.complete_stream, the scheduler, the cache and the pools, as
a server runs it, greedy and without an end-of-text stop (every run writes the same tokens).

Each run twice, at the same KV memory (batch.kv_cache_mib's default, DEFAULT_KV_ROWS rows of max_model_len): in the
slot layout (one block of max_model_len a row, as the store was before it was paged) and in blocks of 16. For each
run: tokens/s (output tokens over the time from the first arrival to the last answer), time to first token and
time per output token after it (p50, p99), the rows running at once (mean and most over the steps), the share of
the blocks held that hold written tokens, rows parked for want of blocks, and the share of steps and of decode
tokens that ran in graphed launches (serve/engine/step/layout.py counts them). "lockstep" submits the same requests at
once: the rows and lengths of the Poisson runs, the engine's best case, whose requests per second are the saturation the
rates are fractions of. On a CPU the packaged SmolLM2-135M-Instruct and the articles' own tokens; on CUDA a model built
from its config (random weights) and random tokens with the articles' lengths (throughput does not depend on either).
"""

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from serve.bench.engine_models import ALL_LINEARS, floor_ms, module_dims, write_adapter
from serve.bench.report import percentile, sync

RANKS = (8, 16, 32, 64)
RATES = (0.5, 0.75, 0.9)
"""Poisson rates as fractions of the lockstep run's requests per second (its saturation)."""
LENGTHS_FILE = Path(__file__).with_name("news_prompt_lengths.json")
"""The BBC news articles' lengths in SmolLM2's tokens (news_prompt_lengths), for a machine without the packages."""


@dataclass(frozen=True)
class TrafficWorkload:
    requests: int
    tenants: int
    """LoRA adapters registered (all seven linears), drawn by a power law."""
    max_batch: int
    full_share: float = 0.1
    """Rows on the two full fine-tunes."""
    emr_share: float = 0.1
    """Rows on the three tasks of the EMR group."""
    max_prompt: int = 1024
    outputs: tuple[int, int] = (16, 256)


CPU_TRAFFIC = TrafficWorkload(requests=32, tenants=12, max_batch=256)
GPU_TRAFFIC = TrafficWorkload(requests=384, tenants=64, max_batch=256)
LAYOUTS = {"slots": (None, False, False), "paged": (16, True, False), "paged-nocache": (16, False, False),
           "paged-invariant": (16, True, True)}
"""KV layouts a run may be served in: (block tokens, None: max_model_len, one block a row; prefix caching;
engine.batch_invariant)."""
CONTEXT = 2048
"""max_model_len of the runs (the server's default): the slot layout holds DEFAULT_KV_ROWS rows of it."""


@dataclass(frozen=True)
class Request:
    model: str
    prompt: list[int]
    new_tokens: int


def news_prompts(tokenizer, most: int) -> list[list[int]]:
    """Every BBC news article of the packaged corpus (train and test) as its tokens, cut at `most`."""
    from serve.data.datasets import bbc_topics

    texts = [e.text for split in ("train", "test") for e in bbc_topics(split).examples]
    return [ids[:most] for ids in tokenizer(texts)["input_ids"]]


def news_prompt_lengths(most: int = 1024) -> list[int]:
    """The articles' lengths in SmolLM2's tokens (what LENGTHS_FILE holds)."""
    from transformers import AutoTokenizer

    from serve.data.models import smollm2_dir

    return [len(p) for p in news_prompts(AutoTokenizer.from_pretrained(smollm2_dir()), most)]


def plan(workload: TrafficWorkload, prompts: list[list[int]], seed: int = 0) -> list[Request]:
    """Each request's model, prompt and output length: kinds by their shares, LoRA tenants by a power law."""
    rnd = random.Random(seed)
    tenants = [f"tenant-{k}" for k in range(workload.tenants)]
    weights = [1.0 / (k + 1) for k in range(workload.tenants)]
    out = []
    for _ in range(workload.requests):
        u = rnd.random()
        if u < workload.full_share:
            model = f"full-{rnd.randrange(2)}"
        elif u < workload.full_share + workload.emr_share:
            model = f"emr/t{rnd.randrange(3)}"
        else:
            model = rnd.choices(tenants, weights)[0]
        out.append(Request(model, rnd.choice(prompts), rnd.randint(*workload.outputs)))
    return out


def write_top2_finetune(model_dir: Path, out: Path, seed: int, scale: float = 0.01) -> Path:
    """A copy of the model directory whose top two layers moved by `scale` of each tensor's spread: what a
    top-two-layer fine-tune stores and reads (FM-Delta codes only what changed)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from serve.store.tensors import weight_files

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    top = (f"layers.{layers - 2}.", f"layers.{layers - 1}.")
    g = torch.Generator().manual_seed(seed)
    for f in weight_files(model_dir):
        tensors = load_file(f)
        for n, t in tensors.items():
            if any(p in n for p in top) and t.is_floating_point():
                noise = torch.randn(t.shape, generator=g) * (scale * t.float().std().clamp(min=1e-3))
                tensors[n] = (t.float() + noise).to(t.dtype)
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    return out


def traffic_store(model_dir: Path, work: Path, workload: TrafficWorkload) -> Path:
    """A store (built once under `work`): the base as "bench", `tenants` LoRA adapters on all seven linears
    (ranks 8-64 in turn), two top-two-layer fine-tunes "full-0", "full-1", and an EMR group "emr" of three such
    fine-tunes' tasks t0..t2."""
    from serve.codecs import emr
    from serve.store.store import Store
    from serve.variants import variant_kind

    root = work / "store"
    if (root / "manifest.json").exists():
        return root
    store = Store(root, create=True)
    store.add_base("bench", model_dir)
    dims = module_dims(model_dir, ALL_LINEARS)
    lora = variant_kind("lora")
    for k in range(workload.tenants):
        lora.add(store, f"tenant-{k}", "bench", write_adapter(work / "adapters" / f"tenant-{k}", dims,
                                                              RANKS[k % len(RANKS)], 2000 + k))
    for k in range(2):
        variant_kind("full").add(store, f"full-{k}", "bench", write_top2_finetune(model_dir, work / f"full-{k}", k))
    tasks = {f"t{k}": write_top2_finetune(model_dir, work / f"task-{k}", 10 + k) for k in range(3)}
    variant_kind("emr").add(store, "emr", "bench", emr.merge(model_dir, tasks, work / "emr-bundle").path)
    return root


class TrafficRun:
    """One Engine over the traffic store; each call serves a list of requests arriving at given times."""

    def __init__(self, store_root: Path, device: torch.device, workload: TrafficWorkload,
                 block_tokens: int | None = None, prefix_caching: bool = True, batch_invariant: bool = False):
        from serve.config import ServeConfig
        from serve.engine.engine import Engine

        cfg = ServeConfig(store=store_root, device=str(device),
                          batch={"max_batch_size": workload.max_batch, "max_queue": 4096, "max_step_tokens": 512,
                                 "max_model_len": CONTEXT, "kv_block_tokens": block_tokens or CONTEXT,
                                 "prefix_caching": prefix_caching},
                          slots={"adapter_mib": 4096, "weights_mib": 4096},
                          cache={"device_mib": 8192, "cpu_mib": 8192}, limits={"max_tokens": workload.outputs[1]},
                          engine={"batch_invariant": batch_invariant})
        self.engine, self.device = Engine(cfg), device
        self.rt = self.engine.bases["bench"]
        self.rt.eos_ids = set()  # every request writes its own number of tokens

    def __call__(self, requests: list[Request], arrivals: list[float]) -> dict:
        """Serve every request at its arrival (seconds from the start); -> the run's figures."""
        from serve.engine.types import SamplingParams

        from serve.engine.kv.store import KVUsage

        steps, tokens = dict(self.rt.step_counts), dict(self.rt.token_counts)
        parked = self.engine.scheduler.preemptions["bench"]
        kv = self.rt.kv.usage = KVUsage()
        prefix = dict(self.rt.prefix_tokens)
        self.rt.kv.pool.drop_cached()  # each run starts cold: no prompt of an earlier run is cached
        first: list[float] = [0.0] * len(requests)
        done: list[float] = [0.0] * len(requests)
        counts: list[int] = [0] * len(requests)

        async def one(i: int, start: float) -> None:
            r = requests[i]
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            sent = time.perf_counter()
            params = SamplingParams(max_tokens=r.new_tokens, temperature=0.0)
            async for piece in self.engine.complete_stream(r.model, params, prompt=r.prompt):
                if not first[i] and (piece.text or piece.final is not None):
                    first[i] = time.perf_counter() - sent
                if piece.final is not None:
                    counts[i] = piece.final.completion_tokens
            done[i] = time.perf_counter() - sent

        async def everything() -> float:
            start = time.perf_counter()
            await asyncio.gather(*(one(i, start) for i in range(len(requests))))
            return time.perf_counter() - start

        sync(self.device)
        seconds = asyncio.run(everything())
        step_delta = {k: v - steps.get(k, 0) for k, v in self.rt.step_counts.items() if v - steps.get(k, 0)}
        token_delta = {k: v - tokens.get(k, 0) for k, v in self.rt.token_counts.items()}
        tpot = [(d - f) / (n - 1) for f, d, n in zip(first, done, counts) if n > 1]
        decode = token_delta.get("decode:graphed", 0) + token_delta.get("decode:eager", 0)
        return {"requests": len(requests), "seconds": seconds, "output_tokens": sum(counts),
                "tok_s": sum(counts) / seconds, "req_s": len(requests) / seconds,
                "rows_mean": kv.rows / max(1, kv.steps), "rows_most": kv.most_rows,
                "kv_live": kv.live / max(1, kv.held), "parked": self.engine.scheduler.preemptions["bench"] - parked,
                "ttft_p50_s": percentile(first, 0.5), "ttft_p99_s": percentile(first, 0.99),
                **first_and_later(requests, arrivals, first),
                "prefix_hit_rate": (self.rt.prefix_tokens["hits"] - prefix.get("hits", 0))
                / max(1, self.rt.prefix_tokens["queries"] - prefix.get("queries", 0)),
                "tpot_p50_ms": 1e3 * percentile(tpot, 0.5), "tpot_p99_ms": 1e3 * percentile(tpot, 0.99),
                "steps": step_delta, "steps_graphed": step_delta.get("graphed", 0) / max(1, sum(step_delta.values())),
                "decode_tokens_graphed": token_delta.get("decode:graphed", 0) / max(1, decode),
                "prompt_tokens_graphed": token_delta.get("prompt:graphed", 0)
                / max(1, token_delta.get("prompt:graphed", 0) + token_delta.get("prompt:eager", 0))}


def first_and_later(requests: list[Request], arrivals: list[float], ttft: list[float]) -> dict:
    """Time to first token (p50, p99) of each model's first request to arrive, and of its later ones: what a
    tenant's system prompt costs once, and then, cached, no more."""
    seen, first, later = set(), [], []
    for i in sorted(range(len(requests)), key=lambda i: (arrivals[i], i)):
        (later if requests[i].model in seen else first).append(ttft[i])
        seen.add(requests[i].model)
    return {"ttft_first_p50_s": percentile(first, 0.5), "ttft_first_p99_s": percentile(first, 0.99),
            "ttft_later_p50_s": percentile(later, 0.5) if later else None,
            "ttft_later_p99_s": percentile(later, 0.99) if later else None}


def with_system_prompts(requests: list[Request], prompts: list[list[int]], tokens: int, seed: int = 1
                        ) -> list[Request]:
    """Each model's requests behind a system prompt of its own (`tokens` tokens of the articles, drawn per model),
    their own prompts cut to a user turn of 32 to 128 tokens."""
    rnd = random.Random(seed)
    pool = [t for p in prompts for t in p]
    system = {}
    for m in sorted({r.model for r in requests}):
        start = rnd.randrange(max(1, len(pool) - tokens))
        system[m] = pool[start:start + tokens]
    return [Request(r.model, system[r.model] + r.prompt[:rnd.randint(32, 128)], r.new_tokens) for r in requests]


def poisson(n: int, rate: float, seed: int) -> list[float]:
    """n arrival times (seconds) of a Poisson process of `rate` per second."""
    rnd = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rnd.expovariate(rate)
        out.append(t)
    return out


def floor_tok_s(rt, rows: int, context: int, bandwidth: float | None) -> float | None:
    """Tokens per second of decode steps of `rows` rows at `context` tokens each at the GPU's memory floor
    (engine_models.floor_ms of the base alone: what the variants add is not counted, an upper bound)."""
    ms = floor_ms(rt, rows, context, bandwidth)
    return None if ms is None else 1e3 * rows / ms


def warmed(run: TrafficRun, requests: list[Request]) -> TrafficRun:
    """The run, its engine warmed: on a CPU every variant loaded once with short requests; on CUDA the requests
    themselves, so that every graph the runs replay is captured here."""
    if run.device.type == "cpu":
        warm = [Request(m, requests[0].prompt[:16], 2) for m in sorted({r.model for r in requests})]
    else:
        warm = requests
    run(warm, [0.0] * len(warm))
    return run


def bench_traffic(model_dir: Path, work: Path, device: torch.device, workload: TrafficWorkload,
                  bandwidth: float | None = None, rates: tuple[float, ...] = RATES,
                  layouts: tuple[str, ...] = ("slots", "paged"), system_prompt_tokens: int = 0,
                  rounds: int = 1) -> dict:
    """For each KV layout: lockstep, then Poisson at `rates` of the first layout's lockstep requests per second
    (the same arrivals for each layout); each run's figures. system_prompt_tokens: each model's requests behind a
    system prompt of its own that long (with_system_prompts). rounds: lockstep runs of each layout, the layouts
    taking turns (so that a machine's drift falls on all of them alike); the run of median tokens/s is reported,
    with every round's tokens/s."""
    from transformers import AutoTokenizer

    if device.type == "cpu":
        prompts = news_prompts(AutoTokenizer.from_pretrained(model_dir), workload.max_prompt)
    else:  # the articles' lengths, random tokens of the model's vocabulary
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in json.loads(LENGTHS_FILE.read_text())]
    requests = plan(workload, prompts)
    if system_prompt_tokens:
        requests = with_system_prompts(requests, prompts, system_prompt_tokens)
    lengths = [len(r.prompt) for r in requests]
    outputs = [r.new_tokens for r in requests]
    context = int(statistics.mean(lengths) + statistics.mean(outputs) / 2)
    store = traffic_store(model_dir, work, workload)
    built = {layout: warmed(TrafficRun(store, device, workload, *LAYOUTS[layout]), requests) for layout in layouts}
    tries: dict[str, list[dict]] = {layout: [] for layout in layouts}
    for _ in range(rounds):
        for layout in layouts:
            tries[layout].append(r := built[layout](requests, [0.0] * len(requests)))
            print(f"  {layout} lockstep: {json.dumps(_rounded(r))}", flush=True)
    runs: dict[str, dict] = {}
    saturation, kv, floor = None, {}, None
    for layout in layouts:
        run = built.pop(layout)
        median = sorted(tries[layout], key=lambda r: r["tok_s"])[(rounds - 1) // 2]
        runs[f"{layout} lockstep"] = {**median, "tok_s_rounds": [r["tok_s"] for r in tries[layout]]}
        saturation = saturation or median["req_s"]
        for k, fraction in enumerate(rates):
            rate = fraction * saturation
            runs[f"{layout} poisson {fraction:g}x"] = r = {"offered_req_s": rate,
                                                           **run(requests, poisson(len(requests), rate, k))}
            print(f"  {layout} poisson {fraction:g}x: {json.dumps(_rounded(r))}", flush=True)
        asyncio.run(run.engine.drain(5))
        kv = {"kv_cache_mib": run.rt.kv.nbytes / (1 << 20), **kv, layout: run.rt.kv.blocks}
        floor = floor_tok_s(run.rt, workload.max_batch, context, bandwidth)
        del run
    kinds = {k: sum(r.model.startswith(p) for r in requests) for k, p in
             (("lora", "tenant-"), ("full", "full-"), ("emr", "emr/"))}
    return {"requests": len(requests), "max_batch": workload.max_batch, "tenants": workload.tenants,
            "system_prompt_tokens": system_prompt_tokens,
            "max_model_len": CONTEXT, "kv_blocks": kv,
            "ranks": list(RANKS), "rows_by_kind": kinds,
            "prompt_tokens": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
            "output_tokens": {"min": min(outputs), "median": statistics.median(outputs), "max": max(outputs),
                              "total": sum(outputs)},
            "floor_tok_s": floor, "runs": runs}


def _rounded(d: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}


def print_traffic(t: dict) -> None:
    blocks = t.get("kv_blocks", {})
    print(f"\nreal traffic: {t['requests']} requests, prompts {t['prompt_tokens']['min']}-{t['prompt_tokens']['max']} "
          f"tokens (median {t['prompt_tokens']['median']:.0f}) from BBC news, outputs {t['output_tokens']['min']}-"
          f"{t['output_tokens']['max']}; rows by kind {t['rows_by_kind']} (LoRA on all seven linears, ranks "
          f"{'-'.join(map(str, (t['ranks'][0], t['ranks'][-1])))}, {t['tenants']} power-law tenants; two top-two-"
          f"layer fine-tunes; three EMR tasks of one group); max_batch_size {t['max_batch']}, max_model_len "
          f"{t.get('max_model_len')}; KV cache {blocks.get('kv_cache_mib', 0):.0f} MiB: "
          + ", ".join(f"{k} {v} blocks" for k, v in blocks.items() if k != "kv_cache_mib"))
    if t.get("floor_tok_s"):
        print(f"floor: {t['floor_tok_s']:.0f} tokens/s (max_batch_size rows a decode step, the base's weights and the "
              "rows' keys and values read once a step)")
    names = {name: f"{name} (median)" if len(r.get("tok_s_rounds", ())) > 1 else name
             for name, r in t["runs"].items()}
    w = max(24, *(len(n) + 1 for n in names.values()))
    print(f"{'run':<{w}}{'offered req/s':>14}{'tokens/s':>10}{'TTFT p50':>10}{'p99 (s)':>9}{'TPOT p50':>10}"
          f"{'p99 (ms)':>10}{'rows mean':>11}{'most':>6}{'KV live':>9}{'parked':>8}{'steps graphed':>15}")
    for name, r in t["runs"].items():
        offered = f"{r['offered_req_s']:.2f}" if "offered_req_s" in r else "all at once"
        print(f"{names[name]:<{w}}{offered:>14}{r['tok_s']:>10.1f}{r['ttft_p50_s']:>10.2f}{r['ttft_p99_s']:>9.2f}"
              f"{r['tpot_p50_ms']:>10.1f}{r['tpot_p99_ms']:>10.1f}{r.get('rows_mean', 0):>11.1f}"
              f"{r.get('rows_most', 0):>6}{r.get('kv_live', 0):>9.0%}{r.get('parked', 0):>8}"
              f"{r['steps_graphed']:>14.0%}")
    rounds = {name: r["tok_s_rounds"] for name, r in t["runs"].items() if len(r.get("tok_s_rounds", ())) > 1}
    if rounds:
        print("tokens/s of each round, the layouts taking turns: "
              + "; ".join(f"{name} {', '.join(f'{x:.1f}' for x in v)}" for name, v in rounds.items()))
    if t.get("system_prompt_tokens") or any(r.get("prefix_hit_rate") for r in t["runs"].values()):
        print(f"\nprefix cache (system prompts of {t.get('system_prompt_tokens', 0)} tokens, each model its own): "
              "time to first token of each model's first request and of its later ones")
        print(f"{'run':<24}{'hit rate':>9}{'first p50':>11}{'p99 (s)':>9}{'later p50':>11}{'p99 (s)':>9}")
        for name, r in t["runs"].items():
            later = (f"{r['ttft_later_p50_s']:>11.2f}{r['ttft_later_p99_s']:>9.2f}"
                     if r.get("ttft_later_p50_s") is not None else f"{'n/a':>11}{'n/a':>9}")
            print(f"{name:<24}{r.get('prefix_hit_rate', 0):>9.0%}{r['ttft_first_p50_s']:>11.2f}"
                  f"{r['ttft_first_p99_s']:>9.2f}{later}")

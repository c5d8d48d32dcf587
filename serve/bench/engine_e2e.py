"""`manyfold bench engine`, end to end: every request submitted at once to the engine, to PEFT's generate over
static batches and to the bare base's (serve/bench/engine.py has the workloads' description and the report)."""

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from serve.bench.engine_models import module_dims, peft_with, write_adapter
from serve.bench.report import sync


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_tokens: int | None
    """None: the real texts' own lengths (CPU)."""
    new_tokens: int
    adapters: int
    """Registered adapters."""
    static_batch: int
    power_law: bool
    """Request i's adapter drawn by a power law (else i % adapters)."""


CPU_WORKLOAD = Workload(requests=32, prompt_tokens=None, new_tokens=48, adapters=16, static_batch=16, power_law=False)
GPU_WORKLOAD = Workload(requests=128, prompt_tokens=128, new_tokens=128, adapters=100, static_batch=64,
                        power_law=True)


def prompts_for(workload: Workload, tokenizer, vocab: int, seed: int = 0) -> list[list[int]]:
    if workload.prompt_tokens is not None:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(3, vocab, (workload.prompt_tokens,), generator=g).tolist()
                for _ in range(workload.requests)]
    from serve.data.datasets import fortunes

    texts = [t for t in fortunes("test") if 60 <= len(t) <= 400][:workload.requests]
    return [tokenizer(t)["input_ids"] for t in texts]


def assignment(workload: Workload, seed: int = 0) -> list[int]:
    """Request i's adapter index."""
    if not workload.power_law:
        return [i % workload.adapters for i in range(workload.requests)]
    rnd = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(workload.adapters)]
    return rnd.choices(range(workload.adapters), weights, k=workload.requests)


class EngineRun:
    """One Engine over the store (every request at once through Engine.complete), warmed once: adapters loaded
    and staged, graphs captured."""

    def __init__(self, store_root: Path, device: torch.device, base: str, max_batch: int):
        from serve.config import ServeConfig
        from serve.engine.engine import Engine

        cfg = ServeConfig(store=store_root, device=str(device),
                          batch={"max_batch_size": max_batch, "max_queue": 4096, "max_step_tokens": 2048},
                          slots={"adapter_mib": 1024}, cache={"device_mib": 4096, "cpu_mib": 4096})
        self.engine, self.base, self.device = Engine(cfg), base, device
        self.rt = self.engine.bases[base]
        self.rt.eos_ids = set()
        self.warm: set[tuple] = set()

    def __call__(self, models: list[str | None], prompts: list[list[int]], new_tokens: int
                 ) -> tuple[float, list[list[int]], dict]:
        """Seconds for every request at once, the tokens of each, the step counts."""
        from serve.engine.types import SamplingParams

        params = SamplingParams(max_tokens=new_tokens, temperature=0.0)

        async def everything():
            return await asyncio.gather(*(self.engine.complete(m or self.base, params, prompt=p)
                                          for m, p in zip(models, prompts)))

        if tuple(models) not in self.warm:
            asyncio.run(everything())
            self.warm.add(tuple(models))
        self.rt.step_counts.clear()
        sync(self.device)
        t0 = time.perf_counter()
        results = asyncio.run(everything())
        return time.perf_counter() - t0, [r.token_ids for r in results], dict(self.rt.step_counts)


def run_generate(model, prompts: list[list[int]], new_tokens: int, batch: int, pad_id: int, device: torch.device,
                 names: list[str] | None = None, batches: int | None = None) -> tuple[float, list[list[int]]]:
    """transformers' generate over static batches (left-padded, greedy, no stop): seconds, the tokens of each
    request run (the first `batches` batches)."""
    out, seconds = [], 0.0
    for b, start in enumerate(range(0, len(prompts), batch)):
        if batches is not None and b >= batches:
            break
        chunk = prompts[start:start + batch]
        longest = max(map(len, chunk))
        ids = torch.full((len(chunk), longest), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, longest - len(p):] = torch.tensor(p)
            mask[i, longest - len(p):] = 1
        kwargs = {"adapter_names": names[start:start + batch]} if names is not None else {}
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id, **kwargs)
        sync(device)
        seconds += time.perf_counter() - t0
        out += gen[:, longest:].tolist()
    return seconds, out


def adapter_store(model_dir: Path, work: Path, n: int, ranks: tuple[int, ...]) -> tuple[Path, dict[str, Path]]:
    """A store (built once under `work`) of the base as "bench" and n adapters tenant-0.. of the ranks in turn,
    registered from PEFT directories as a tenant would; -> its root and the directories by name."""
    from serve.store.store import Store
    from serve.variants import variant_kind

    dims = module_dims(model_dir)
    adapters = {f"tenant-{k}": write_adapter(work / "adapters" / f"tenant-{k}", dims, ranks[k % len(ranks)], 1000 + k)
                for k in range(n)}
    store_root = work / "store"
    if not (store_root / "manifest.json").exists():
        store = Store(store_root, create=True)
        store.add_base("bench", model_dir)
        for name, path in adapters.items():
            variant_kind("lora").add(store, name, "bench", path)
    return store_root, adapters


def bench_end_to_end(model_dir: Path, work: Path, device: torch.device, workload: Workload, ranks: tuple[int, ...],
                     peft_batches: int | None, rounds: int = 1) -> dict:
    """Every system in turn, `rounds` times; tokens/s medians (each round's figures in the report)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
    prompts = prompts_for(workload, tokenizer, plain.config.vocab_size)
    store_root, adapters = adapter_store(model_dir, work, workload.adapters, ranks)
    names = [f"tenant-{k}" for k in assignment(workload)]
    new = workload.new_tokens
    wide = 2 * workload.static_batch  # the engine takes every request at once: a batch twice the static one
    used = sorted(set(names))
    at_static, at_wide = EngineRun(store_root, device, "bench", workload.static_batch), \
        EngineRun(store_root, device, "bench", wide)
    own = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()  # PEFT wraps in place
    peft = peft_with(own, {n: adapters[n] for n in used}).to(device)
    pad = tokenizer.pad_token_id
    systems = {  # label -> () -> (seconds, tokens of each request run, steps)
        "engine": lambda: at_static(names, prompts, new),
        "engine_base": lambda: at_static([None] * len(prompts), prompts, new),
        "engine_wide": lambda: at_wide(names, prompts, new),
        "transformers": lambda: (*run_generate(plain, prompts, new, workload.static_batch, pad, device), {}),
        "peft": lambda: (*run_generate(peft, prompts, new, workload.static_batch, pad, device, names, peft_batches),
                         {}),
    }
    runs: dict[str, list[float]] = {k: [] for k in systems}
    last: dict[str, tuple] = {}
    for _ in range(rounds):  # the systems take turns, round after round: this VM's speed drifts
        for label, run in systems.items():
            last[label] = run()
            seconds, outputs, _ = last[label]
            runs[label].append(len(outputs) * new / seconds)
    asyncio.run(at_static.engine.drain(5))
    asyncio.run(at_wide.engine.drain(5))
    p_tokens = last["peft"][1]
    p_done = len(p_tokens)
    median = {k: statistics.median(v) for k, v in runs.items()}
    report = {"requests": workload.requests, "new_tokens": new, "adapters_registered": workload.adapters,
              "adapters_used": len(used), "static_batch": workload.static_batch, "rounds": rounds,
              "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
              "tok_s": runs, "engine_tok_s": median["engine"], "engine_base_tok_s": median["engine_base"],
              "engine_wide_rows": wide, "engine_wide_tok_s": median["engine_wide"],
              "engine_wide_equal_peft": f"{sum(a == b for a, b in zip(last['engine_wide'][1], p_tokens))} of {p_done}",
              "engine_wide_steps": last["engine_wide"][2],
              "transformers_tok_s": median["transformers"], "peft_tok_s": median["peft"],
              "peft_requests_timed": p_done,
              "engine_equal_peft": f"{sum(a == b for a, b in zip(last['engine'][1], p_tokens))} of {p_done}",
              "engine_steps": last["engine"][2], "engine_base_steps": last["engine_base"][2]}
    return report

"""`manyfold bench coldstart`: what a variant's first and later requests cost, against loading it in full.

For every full variant of the store, medians over repeats, on one machine in one run:
  baseline  load the fine-tune's uncompressed safetensors with transformers and run the request
  cold      the engine (bases already resident) serves the variant's first request: FM-Delta decode + run,
            decoding into the buffers of an evicted variant, as every cold load does once the cache is full
            (or into the pool's reserve, faulted in at start, as the first cold load after a start does)
  fresh     the same with the buffer pool emptied first: into newly allocated memory, as when cold loads come
            back to back faster than the pool's background top-up
  hot       the same request with the variant resident
  base      the same request on the base model itself (what a hot variant should cost)
The request is one classification for classifier variants, 8 greedy tokens for causal LM variants.
Each cold and baseline run is measured twice: with the files in the OS page cache, and with them evicted
first (posix_fadvise DONTNEED: the variant is cold on disk too, as a rarely called variant is). Every timing
starts on a quiet machine: a background top-up of the buffer pool is let finish first.
"""

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from serve.bench.report import machine
from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.store.model_dir import is_causal_lm
from serve.store.store import Store
from serve.variants.full import extract_full_variant

TEXT = "The central bank raised interest rates again as inflation stayed high."
MESSAGES = [{"role": "user", "content": "Give me one short piece of advice."}]
PARAMS = SamplingParams(max_tokens=8, temperature=0)


def evict_page_cache(paths: list[Path]) -> None:
    """Drop these files' pages from the OS page cache, so the next read comes from disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _baseline(model_dir: Path, causal: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        if causal:
            model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
            ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            model.generate(**ids, max_new_tokens=PARAMS.max_tokens, do_sample=False)
        else:
            model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
            model(**tok([TEXT], return_tensors="pt")).logits.softmax(-1)


async def _request(engine: Engine, model: str, causal: bool) -> None:
    if causal:
        await engine.complete(model, PARAMS, messages=MESSAGES)
    else:
        await engine.embed(model, [TEXT]) if model in engine.bases else await engine.classify(model, [TEXT])


async def _timed(engine: Engine, model: str, causal: bool) -> float:
    await engine.cache.settle()
    t0 = time.perf_counter()
    await _request(engine, model, causal)
    return time.perf_counter() - t0


async def _measure(engine: Engine, store: Store, name: str, base: str, causal: bool, ref_dir: Path,
                   repeats: int) -> dict:
    """One variant's medians: baseline and cold with the page cache warm and evicted, fresh, hot and base."""
    await _request(engine, base, causal)  # warm the scheduler and the base's code paths
    engine.cache.drop(name)
    await _request(engine, name, causal)  # and the codec's JIT cache
    ref_files = [p for p in ref_dir.iterdir() if p.is_file()]
    variant_files = [store.root / f.path for f in store.variant(name).files]
    t: dict[str, list[float]] = {k: [] for k in ("baseline_s", "cold_s", "fresh_s", "baseline_disk_s",
                                                 "cold_disk_s", "hot_s", "base_s")}
    for _ in range(repeats):
        for suffix, evict in (("_s", False), ("_disk_s", True)):
            if evict:
                evict_page_cache(ref_files)
            await engine.cache.settle()
            t0 = time.perf_counter()
            await asyncio.to_thread(_baseline, ref_dir, causal)
            t["baseline" + suffix].append(time.perf_counter() - t0)
            engine.cache.drop(name)
            if evict:
                evict_page_cache(variant_files)
            t["cold" + suffix].append(await _timed(engine, name, causal))
        engine.cache.drop(name)
        engine.cache.buffers.clear()
        t["fresh_s"].append(await _timed(engine, name, causal))
    for _ in range(max(5, repeats)):
        t["hot_s"].append(await _timed(engine, name, causal))
        t["base_s"].append(await _timed(engine, base, causal))
    med = {k: statistics.median(v) for k, v in t.items()}
    return {"variant": name, "base": base, **med, "cold_over_baseline": med["cold_s"] / med["baseline_s"],
            "fresh_over_baseline": med["fresh_s"] / med["baseline_s"],
            "cold_over_baseline_disk": med["cold_disk_s"] / med["baseline_disk_s"],
            "hot_over_base": med["hot_s"] / med["base_s"]}


def _print_table(rows: list[dict], repeats: int) -> None:
    """The rows as one table under the machine's name, then what each column means."""
    print(f"machine: {machine()}")
    print(f"{'':<20} {'page cache warm':^46} {'evicted (cold on disk)':^28}")
    print(f"{'variant':<20} {'baseline s':>10} {'cold s':>8} {'ratio':>8} {'fresh s':>8} {'ratio':>8} "
          f"{'baseline s':>10} {'cold s':>8} {'ratio':>8} {'hot s':>8} {'base s':>8} {'hot/base':>8}")
    for r in rows:
        print(f"{r['variant']:<20} {r['baseline_s']:>10.3f} {r['cold_s']:>8.3f} {r['cold_over_baseline']:>8.2f} "
              f"{r['fresh_s']:>8.3f} {r['fresh_over_baseline']:>8.2f} "
              f"{r['baseline_disk_s']:>10.3f} {r['cold_disk_s']:>8.3f} {r['cold_over_baseline_disk']:>8.2f} "
              f"{r['hot_s']:>8.3f} {r['base_s']:>8.3f} {r['hot_over_base']:>8.2f}")
    print("baseline: load the uncompressed fine-tune with transformers + run the request; cold: the variant's first "
          "request through the engine, FM-Delta decode included, into pooled buffers (an evicted variant's, or the "
          "reserve made at start); fresh: the same into new memory (pool emptied); hot: resident variant; base: the base "
          f"model itself; request: 1 classification or 8 greedy tokens; medians of {repeats} (cold, fresh, "
          f"baseline) and {max(5, repeats)} (hot, base)")


def run_coldstart_bench(store_dir: Path | None, out: Path, repeats: int = 3) -> list[dict]:
    """Measure every variant of the store (the demo store when None), print the table and write it to `out`."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if store_dir is None:
        from serve.demo import build_demo_store

        store_dir = build_demo_store().root
    store = Store(store_dir)
    engine = Engine(ServeConfig(store=store_dir))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for v in store.manifest.variants.values():
            causal = is_causal_lm(v.architecture)
            ref_dir = extract_full_variant(store, v.name, Path(tmp) / v.name)
            rows.append(asyncio.run(_measure(engine, store, v.name, v.base, causal, ref_dir, repeats)))
    _print_table(rows, repeats)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "repeats": repeats, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return rows

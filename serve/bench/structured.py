"""`manyfold bench structured`: structured outputs in the engine's mixed step, on SmolLM2 of the demo store.

Sixteen rows at once over a PiSSA adapter (served as LoRA), an EMR task, a full fine-tune and the base held as
NeuZip, four of each, each asked to read a BBC News article (the test split, packaged) and answer with a JSON object
that matches Article's schema:
- the decode step at 16 rows, half of them under the schema's grammar (its bitmask filled and applied every step)
  against all of them free, compile excluded: median seconds of the steps where all 16 rows decode, taken by the
  batch itself (serve/engine/generation/decode_batch.py) with the same prompts, a wave of each in turn, three times. A
  step holds one base's rows, so this runs on the plain base (the adapter, the task, the fine-tune and the base itself)
  and on the NeuZip base (the base, its adapter and its fine-tune) in turn;
- a grammar's compile, cold (the tokenizer's tables too, then another schema) and cached;
- the share of the 16 answers that parse and validate against the schema, with the constraint and without it
  (the same prompt, which spells the schema out), greedy, through Engine.complete.
"""

import asyncio
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from serve.bench.report import finish, machine

ROWS = 16
STEP_TOKENS = 24
"""Decode steps timed a wave: each row runs (ignore_eos) past them."""
MIX = ("smollm2-spam-pissa", "smollm2-emr/news", "smollm2-fortunes", "smollm2-nz")
"""The models of the 16 rows, four each: a PiSSA adapter, an EMR task, a full fine-tune, the NeuZip base."""
STEP_SETS = {"plain base": ("smollm2-spam-pissa", "smollm2-emr/news", "smollm2-fortunes", "smollm2"),
             "neuzip base": ("smollm2-nz", "smollm2-nz-spam-pissa", "smollm2-nz-fortunes", "smollm2-nz")}
"""The rows of each timed step: four models of one base, four rows each."""


class Article(BaseModel):
    topic: Literal["business", "entertainment", "politics", "sport", "tech"]
    title: str = Field(max_length=80)
    sentiment: Literal["positive", "neutral", "negative"]


SCHEMA = Article.model_json_schema()
OTHER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}}, "required": ["answer"]}
"""A second schema, for the second cold compile."""


def prompts() -> list[list[dict]]:
    from serve.data.datasets import bbc_topics

    articles = [e.text for e in bbc_topics("test").examples][:ROWS]
    ask = ("Read the article, then answer with only a JSON object that matches this JSON schema:\n"
           f"{json.dumps(SCHEMA)}\n\nArticle: ")
    return [[{"role": "user", "content": ask + " ".join(a.split())[:500]}] for a in articles]


def valid(text: str) -> bool:
    try:
        Article.model_validate_json(text)
        return True
    except ValidationError:
        return False


def run_structured_bench(store_root: Path | None, out: Path, max_tokens: int = 96, repeats: int = 3) -> dict:
    """store_root None: the demo store, built if missing."""
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.types import Constraint, SamplingParams

    if store_root is None:
        from serve.demo import build_demo_store

        store_root = build_demo_store().root
    config = ServeConfig(store=store_root, batch={"max_batch_size": ROWS, "max_step_tokens": 512},
                         limits={"max_tokens": max_tokens})
    engine = Engine(config)
    chats = prompts()
    constraint = Constraint("json", json.dumps(SCHEMA))
    report = {"machine": machine(), "rows": ROWS, "schema": SCHEMA, "compile_ms": _compile_times(engine)}
    report["steps"] = {name: _step_times(engine, models, chats, constraint, repeats)
                       for name, models in STEP_SETS.items()}
    greedy = SamplingParams(max_tokens=max_tokens)
    report["answers"] = {how: _answers(engine, chats, replace(greedy, constraint=c))
                         for how, c in (("constrained", constraint), ("free", None))}
    asyncio.run(engine.drain(5))
    return finish(report, out, print_structured)


def _compile_times(engine) -> dict:
    """Milliseconds: the first compile on a base (its tokenizer's tables built too), a second schema's, and the
    first one's again (from the cache)."""
    from serve.engine.types import Constraint

    grammars = engine.grammars["smollm2"]

    async def timed(schema: dict) -> float:
        t0 = time.perf_counter()
        await grammars.compile(Constraint("json", json.dumps(schema)), "bench")
        return (time.perf_counter() - t0) * 1e3

    async def all_three():
        return await timed(SCHEMA), await timed(OTHER), await timed(SCHEMA)

    first, second, cached = asyncio.run(all_three())
    return {"cold_first": first, "cold": second, "cached": cached, "compiles": grammars.stats.compiles}


def _step_times(engine, models: tuple[str, ...], chats: list[list[dict]], constraint, repeats: int) -> dict:
    """Median seconds of a decode step with all ROWS rows decoding: all free, and every other row under the
    constraint (greedy, ignore_eos: every row runs past STEP_TOKENS), a wave of each in turn `repeats` times after
    one untimed wave (the first use of a variant's slots and an EMR task's formed weights)."""
    return asyncio.run(_timed_steps(engine, models, chats, constraint, repeats))


async def _timed_steps(engine, models: tuple[str, ...], chats: list[list[dict]], constraint, repeats: int) -> dict:
    from serve.engine.generation.decode_batch import DecodeBatch
    from serve.engine.generation.row import NewRow
    from serve.engine.types import SamplingParams

    params = SamplingParams(max_tokens=STEP_TOKENS + 8, ignore_eos=True)
    holds = []
    for m in models:
        base, _, key = await engine.resolve(m)
        holds.append((m, await engine.cache.acquire(key) if key else None))
    rt = engine.bases[base]
    compiled = await engine.grammars[rt.name].compile(constraint, "bench")
    rows = [(rt.prompts.chat(chats[i]), holds[i % len(holds)]) for i in range(ROWS)]

    def wave(constrained: bool) -> list[float]:
        batch, seconds = DecodeBatch(rt), []
        batch.run([NewRow(i, ids, params, h.variant.member(m) if h else None,
                          compiled if constrained and i % 2 else None) for i, (ids, (m, h)) in enumerate(rows)])
        while len(batch) and len(seconds) < STEP_TOKENS:
            full = len(batch.decoding) == ROWS and not batch.prefilling
            t0 = time.perf_counter()
            batch.run([])
            if full:
                seconds.append(time.perf_counter() - t0)
        batch.close()
        return seconds

    times: dict[str, list[float]] = {"free": [], "half constrained": []}
    try:
        wave(False)
        for _ in range(repeats):
            for how in times:
                times[how] += wave(how != "free")
    finally:
        for _, h in holds:
            if h is not None:
                engine.cache.release(h)
    out = {"models": list(models), "repeats": repeats}
    out |= {how: {"median_s": statistics.median(t), "steps": len(t)} for how, t in times.items()}
    out["ratio"] = out["half constrained"]["median_s"] / out["free"]["median_s"]
    return out


def _answers(engine, chats: list[list[dict]], params) -> dict:
    """Each model's answers (four rows each, at once) -> how many parse and validate, and how they ended."""

    async def everything():
        return await asyncio.gather(*(engine.complete(MIX[i % len(MIX)], params, messages=chats[i])
                                      for i in range(ROWS)))

    t0 = time.perf_counter()
    gens = asyncio.run(everything())
    seconds = time.perf_counter() - t0
    ok = [valid(g.text) for g in gens]
    by_model = {m: {"valid": 0, "rows": 0} for m in MIX}
    for i, good in enumerate(ok):
        by_model[MIX[i % len(MIX)]]["rows"] += 1
        by_model[MIX[i % len(MIX)]]["valid"] += good
    return {"valid": sum(ok), "rows": len(gens), "by_model": by_model, "seconds": seconds,
            "finish": {r: sum(g.finish_reason == r for g in gens) for r in ("stop", "length")},
            "examples": [g.text for g in gens[:len(MIX)]]}


def print_structured(r: dict) -> None:
    print(f"structured outputs, {r['rows']} rows, on {r['machine']}")
    c = r["compile_ms"]
    print(f"compile: cold {c['cold_first']:.1f} ms (with the tokenizer's tables), another schema cold "
          f"{c['cold']:.1f} ms, cached {c['cached']:.3f} ms")
    print(f"{'step (16 rows decoding)':28} {'free s':>8} {'half constrained s':>19} {'ratio':>6}")
    for name, s in r["steps"].items():
        print(f"{name:28} {s['free']['median_s']:8.3f} {s['half constrained']['median_s']:19.3f} {s['ratio']:6.3f}")
    print(f"{'answers':12} {'valid':>8} " + " ".join(f"{m:>20}" for m in MIX))
    for how, a in r["answers"].items():
        print(f"{how:12} {a['valid']:>4}/{a['rows']:<3} " + " ".join(
            f"{a['by_model'][m]['valid']:>18}/{a['by_model'][m]['rows']}" for m in MIX))
